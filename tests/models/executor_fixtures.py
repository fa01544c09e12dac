"""Executors used only by the model tests (importable by in-process workers as `models.executor_fixtures`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniflow.errors import NonRetryableError
from omniflow.executor import Executor, Session, StepOutput
from omniflow.workers.thinker import HFThinker, ThinkerState


class FailingThinker(HFThinker):
    """HFThinker whose `fail_at_token`-th token step raises once per attempt <= `fail_attempts`
    (a crash in the middle of the stream)."""

    def step(self, states: list[ThinkerState]) -> list[StepOutput]:
        for state in states:
            params = state.session_params
            fail_at = int(params.get("fail_at_token", 0))
            if fail_at and len(state.seq.generated) + 1 == fail_at and state.attempt <= int(params.get("fail_attempts", 1)):
                raise RuntimeError(f"injected failure before token {fail_at}")
        return super().step(states)

    def join(self, session: Session) -> ThinkerState:
        state = super().join(session)
        state.session_params, state.attempt = dict(session.params), session.attempt  # type: ignore[attr-defined]
        return state


class ClauseChecker(Executor):
    """A final text stage fed by the thinker: checks every clause's tensors and echoes its text."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        import torch

        shapes = []
        async for chunk in session.inputs():
            hidden, ids = chunk.data["hidden"], chunk.data["token_ids"]
            if not (isinstance(hidden, torch.Tensor) and hidden.dtype == torch.float32
                    and hidden.ndim == 2 and hidden.shape[0] == len(ids) > 0):
                raise NonRetryableError(f"bad clause tensors: {type(hidden)} {getattr(hidden, 'shape', None)}")
            shapes.append(list(hidden.shape))
            await session.emit(text=chunk.data["text"])
        return {"shapes": shapes}


class SlowThinker(HFThinker):
    """HFThinker with `step_delay_s` of sleep per step (a slower device), so a test can kill its
    worker in the middle of the stream."""

    def step(self, states: list[ThinkerState]) -> list[StepOutput]:
        import time

        time.sleep(float(self.params.get("step_delay_s", 0.0)))      # the slower device (simulated)
        return super().step(states)
