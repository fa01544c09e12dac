"""The executor plugin contract: what a model author implements for one stage.

    from omniflow.executor import Executor, Session

    class Echo(Executor):
        async def run(self, session: Session):
            await session.emit(text=session.text)
            return {"tokens": 1}

One instance lives in each worker process (load weights in `setup`); `run` is
called once per session and runs concurrently with others up to the stage's
`max_sessions`. Raise `NonRetryableError` for bad input; any other exception
is retried per the stage's retry policy. `Session` is a Protocol: the members
an executor may use (the engine's session and `omniflow.testing.FakeSession`
both implement it).

Where it runs (`runs_on`): by default ("auto") `setup`, `run` and `close` run on the
stage's own compute thread (`omniflow.engine.compute`), in an event loop of their own,
so a blocking forward pass never delays the worker's heartbeat, claims or abort
fan-out; once `run`'s steps (between two awaits) have shown they take microseconds,
its sessions run on the worker's loop, and go back at the first long step
(`omniflow.engine.placement`). "thread" pins an executor to its thread, "loop" to the
worker's loop (pure asyncio that never blocks: the toy stages).

Continuous batching: subclass `BatchedExecutor` and implement `join`, `step`,
`leave`; its `StepLoop` (`omniflow.executor.stepping`) steps every joined
session together and emits each one's output through its own session. An
engine that batches internally (vLLM) subclasses plain `Executor` and consumes
its engine's async stream in `run`.

    base.py       Executor, Session (Protocol), Chunk, StepOutput: the contract
    stepping.py   StepLoop: the continuous-batching scheduler (knows its executor as a `Steppable`)
    batched.py    BatchedExecutor: `run` on the step loop

`omniflow.workers.base` is the old path of this module and re-exports it.
"""
from __future__ import annotations

from omniflow.errors import NonRetryableError, StageError
from omniflow.executor.base import Chunk, Executor, Session, StepOutput
from omniflow.executor.batched import DEFAULT_MAX_BATCH, BatchedExecutor
from omniflow.executor.stepping import Steppable, StepLoop, StepStats

__all__ = ["DEFAULT_MAX_BATCH", "BatchedExecutor", "Chunk", "Executor", "NonRetryableError", "Session", "StageError",
           "StepLoop", "StepOutput", "StepStats", "Steppable"]
