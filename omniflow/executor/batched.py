"""`BatchedExecutor`: an executor whose sessions are stepped together (continuous batching).

It implements `Executor.run` with the step loop (`omniflow.executor.stepping`); a
subclass says how a session joins the batch, how one step advances every joined
session and how a session leaves.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any

from omniflow.executor.base import Executor, Session, StepOutput
from omniflow.executor.stepping import StepLoop

DEFAULT_MAX_BATCH = 8


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
