"""The executor plugin protocol: what a model author implements for one stage.

    class Echo(Executor):
        async def run(self, session):
            await session.emit(text=session.text)
            return {"tokens": 1}

One instance lives in each worker process (load weights in `setup`); `run` is
called once per session and runs concurrently with others up to the stage's
`max_sessions`. Raise `NonRetryableError` for bad input; any other exception
is retried per the stage's retry policy.

Where it runs (`runs_on`): by default `setup`, `run` and `close` run on the
stage's own compute thread (`omniflow.engine.compute`), in an event loop of their own,
so a blocking forward pass never delays the worker's heartbeat, claims or
abort fan-out. Pure-asyncio executors that never block (the toy stages) may say
`runs_on = "loop"` and run on the worker's loop, saving a thread hop per call.

Continuous batching: subclass `BatchedExecutor` and implement `join`, `step`,
`leave`; the runtime's `StepLoop` (`omniflow.engine.stepping`) steps every joined
session together and emits each one's output through its own session. An
engine that batches internally (vLLM) subclasses plain `Executor` and consumes
its engine's async stream in `run`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from omniflow.errors import NonRetryableError, StageError
from omniflow.engine.session import Chunk, Session
from omniflow.engine.stepping import StepLoop, StepOutput

__all__ = ["BatchedExecutor", "Chunk", "Executor", "NonRetryableError", "Session", "StageError", "StepOutput"]

DEFAULT_MAX_BATCH = 8


class Executor(ABC):
    """Base class of stage executors."""

    #: True when `run` continues from `session.resume_seq` (or is deterministic, so that
    #: re-emitted steps are suppressed). Non-resumable stages restart their output.
    resumable: ClassVar[bool] = True

    #: "thread": setup/run/close run on the stage's compute thread (blocking code is fine);
    #: "loop": on the worker's event loop (only for executors that never block).
    runs_on: ClassVar[Literal["thread", "loop"]] = "thread"

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


class BatchedExecutor(Executor):
    """An executor that steps many sessions together (continuous batching).

    `join`, `step` and `leave` are plain (blocking) methods: they run on the stage's compute
    thread, one at a time, never concurrently with each other. Sessions join and leave between
    steps; at most `max_batch` (param `max_batch`, default 8) are stepped together.
    """

    def __init__(self, *, stage: str, params: Mapping[str, Any]) -> None:
        super().__init__(stage=stage, params=params)
        self.max_batch = int(self.params.get("max_batch", DEFAULT_MAX_BATCH))
        if self.max_batch < 1:
            raise ValueError(f"stage {stage}: max_batch must be at least 1, got {self.max_batch}")
        self._step_loop: StepLoop | None = None

    @abstractmethod
    def join(self, session: Session) -> Any:
        """Admit one session (prefill); returns its per-session state.

        `session.checkpoint` holds what earlier attempts checkpointed and `session.resume_seq`
        how many steps they wrote (emits up to it are suppressed): resume from there."""

    @abstractmethod
    def step(self, states: list[Any]) -> list[StepOutput]:
        """Advance every given session by one step; one `StepOutput` per state, same order."""

    def leave(self, state: Any) -> None:
        """Drop one session's state (its KV cache): after its last step, an abort or a failure."""

    @property
    def step_loop(self) -> StepLoop | None:
        """The scheduler, once a session has run (its `stats` show the batch sizes reached)."""
        return self._step_loop

    async def run(self, session: Session) -> Mapping[str, Any] | None:
        if self._step_loop is None:
            self._step_loop = StepLoop(self)
        return await self._step_loop.serve(session)
