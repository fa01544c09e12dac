"""Payload encoding across Redis: msgpack, with numpy arrays and torch tensors as extension types.

Never pickle. Arrays travel as (dtype, shape, raw bytes), so a consumer can rebuild
them without trusting any code in the payload; torch tensors keep their dtype
(float32, float16, bfloat16, int64, ...) and shape. This is the inline form of the
data plane's codec (`omniflow.dataplane.codec`, which also has the zero-copy frame
form for payloads in a Redis key or a shared-memory segment): one implementation.
"""
from __future__ import annotations

from omniflow.dataplane.codec import dumps, loads

__all__ = ["dumps", "loads"]
