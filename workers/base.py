"""The old import path of the executor contract: use `omniflow.executor`.

`omniflow.workers.base` re-exports `omniflow.executor` so that executors written
against it (`from omniflow.workers.base import Executor, Session`) keep working;
the contract itself lives in the engine (`omniflow/executor/`), documented in
docs/executors.md.
"""
from __future__ import annotations

from omniflow.executor import (
    DEFAULT_MAX_BATCH,
    BatchedExecutor,
    Chunk,
    Executor,
    NonRetryableError,
    Session,
    StageError,
    StepOutput,
)

__all__ = ["DEFAULT_MAX_BATCH", "BatchedExecutor", "Chunk", "Executor", "NonRetryableError", "Session", "StageError",
           "StepOutput"]
