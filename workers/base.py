"""The executor plugin protocol: what a model author implements for one stage.

    class Echo(Executor):
        async def run(self, session):
            await session.emit(text=session.text)
            return {"tokens": 1}

One instance lives in each worker process (load weights in `setup`); `run` is
called once per session and runs concurrently with others up to the stage's
`max_sessions`. Raise `NonRetryableError` for bad input; any other exception
is retried per the stage's retry policy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from omniflow.errors import NonRetryableError, StageError
from omniflow.session import Chunk, Session

__all__ = ["Chunk", "Executor", "NonRetryableError", "Session", "StageError"]


class Executor(ABC):
    """Base class of stage executors."""

    #: True when `run` continues from `session.resume_seq` (or is deterministic, so that
    #: re-emitted steps are suppressed). Non-resumable stages restart their output.
    resumable: ClassVar[bool] = True

    def __init__(self, *, stage: str, params: Mapping[str, Any]) -> None:
        self.stage = stage
        self.params = dict(params)

    async def setup(self) -> None:
        """Load weights, warm up. Called once before the worker takes sessions."""

    @abstractmethod
    async def run(self, session: Session) -> Mapping[str, Any] | None:
        """Do one session's work; return usage (token counts, audio seconds...)."""

    async def close(self) -> None:
        """Release what `setup` took. Called once at shutdown."""
