"""Continuous batching: one step loop per stage steps every joined session together.

A `BatchedExecutor` (`omniflow.executor.batched`) says how to add a session to
the batch (`join`: prefill), how to advance every joined session by one step
(`step`), and how to drop one (`leave`). The `StepLoop` does the scheduling,
the way vLLM's engine does: sessions join and leave *between* steps, at most
`max_batch` at once (the rest wait for room in arrival order), and each step's
outputs go out through each session's own `Session.emit` — so fencing, resume,
abort and per-session ordering are exactly those of an unbatched executor.

The loop knows its executor only as a `Steppable` (the members it calls), so this
module does not depend on `BatchedExecutor`, which depends on it.

Everything here runs on one event loop: in a worker, the stage's compute
thread (`omniflow.engine.compute`), where blocking in `join`/`step` is fine; in tests,
the test's loop.

    session A  ──join──┐ step step step ─────── done ─leave
    session B          └──────join──┐ step step step step ── done ─leave
                                    (B joined between two steps)
"""
from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from omniflow.executor.base import Session, StepOutput

logger = logging.getLogger(__name__)


class Steppable(Protocol):
    """What the step loop calls of its executor (a `BatchedExecutor` is one)."""

    @property
    def stage(self) -> str: ...

    @property
    def max_batch(self) -> int: ...

    def join(self, session: Session) -> Any: ...

    def step(self, states: list[Any]) -> list[StepOutput]: ...

    def leave(self, state: Any) -> None: ...


@dataclass(eq=False, slots=True)
class _Member:
    session: Session
    outputs: asyncio.Queue[StepOutput | BaseException] = field(default_factory=asyncio.Queue)
    state: Any = None


#: upper bounds of the batch-size histogram's buckets (the last bucket is everything above)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class StepStats:
    """What the step loop did: steps, their batch sizes (a histogram over `BATCH_BUCKETS`). Workers
    publish `snapshot()` with their heartbeat (`/metrics`: `omniflow_batch_size`)."""

    steps: int = 0
    stepped_sessions: int = 0        # sum over steps of the batch size
    max_batch_seen: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * (len(BATCH_BUCKETS) + 1))

    @property
    def mean_batch(self) -> float:
        return self.stepped_sessions / self.steps if self.steps else 0.0

    def stepped(self, size: int) -> None:
        """One step of `size` sessions."""
        self.steps += 1
        self.stepped_sessions += size
        self.max_batch_seen = max(self.max_batch_seen, size)
        self.hist[bisect.bisect_left(BATCH_BUCKETS, size)] += 1

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready counters (monotonic over the loop's life)."""
        return {"steps": self.steps, "sessions": self.stepped_sessions, "hist": list(self.hist)}


class StepLoop:
    """The continuous-batching scheduler of one batched executor on one event loop."""

    def __init__(self, executor: Steppable) -> None:
        self.executor = executor
        self.loop = asyncio.get_running_loop()
        self._members: list[_Member] = []
        self._room = asyncio.Condition()
        self._stepper: asyncio.Task[None] | None = None
        self.stats = StepStats()

    @property
    def batch_size(self) -> int:
        return len(self._members)

    async def serve(self, session: Session) -> Mapping[str, Any] | None:
        """Run one session through the batch until its last step; returns its usage."""
        member = _Member(session)
        async with self._room:
            await self._room.wait_for(lambda: len(self._members) < self.executor.max_batch)
            member.state = self.executor.join(session)     # prefill (blocking is fine on a compute thread)
            self._members.append(member)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._run(), name=f"steps-{self.executor.stage}")
        try:
            while True:
                out = await member.outputs.get()
                if isinstance(out, BaseException):
                    raise out
                if not out.empty:
                    await session.emit(text=out.text, data=out.data, checkpoint=out.checkpoint)
                if out.done:
                    return out.usage
        finally:
            await self._leave(member)

    async def _leave(self, member: _Member) -> None:
        if member in self._members:
            self._members.remove(member)
        try:
            self.executor.leave(member.state)
        finally:
            async with self._room:
                self._room.notify_all()

    async def _run(self) -> None:
        while self._members:
            batch = list(self._members)
            try:
                outs = self.executor.step([m.state for m in batch])
                if len(outs) != len(batch):
                    raise RuntimeError(f"{type(self.executor).__name__}.step returned {len(outs)} outputs "
                                       f"for {len(batch)} sessions")
            except Exception as exc:  # noqa: BLE001 - a failed step fails the sessions in it, not the loop
                logger.warning("stage %s: a step of %d session(s) failed: %r", self.executor.stage, len(batch), exc)
                for m in batch:
                    if m in self._members:
                        self._members.remove(m)
                    m.outputs.put_nowait(exc)
                await asyncio.sleep(0)
                continue
            self.stats.stepped(len(batch))
            for m, out in zip(batch, outs):
                m.outputs.put_nowait(out)
                if out.done and m in self._members:
                    self._members.remove(m)      # out of the next step; `leave` runs in its session
            # Between two steps: sessions emit what they got, new ones join, aborted ones leave.
            await asyncio.sleep(0)
