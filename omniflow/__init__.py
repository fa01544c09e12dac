"""omniflow: a durable workflow engine for multi-stage model serving."""
from __future__ import annotations

__version__ = "0.1.0"
