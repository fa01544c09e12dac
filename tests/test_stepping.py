"""Continuous batching (`omniflow.executor.stepping`) and the fake session, without Redis."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from omniflow.executor import BatchedExecutor, StepOutput
from workers_fixtures import CountingLM

from omniflow.errors import Fenced
from omniflow.testing import FakeSession, run_executor, run_many


def lm(**params: Any) -> CountingLM:
    return CountingLM(stage="thinker", params={"max_words": 5, **params})


def session(prompt: str, **kw: Any) -> FakeSession:
    return FakeSession(input={"text": prompt}, stage="thinker", downstream=("talker",), **kw)


async def test_batched_output_equals_unbatched() -> None:
    alone = [session(f"p{i}") for i in range(4)]
    for s in alone:
        await run_executor(lm(max_batch=1), s)
    together = [session(f"p{i}") for i in range(4)]
    executor = lm(max_batch=8)
    await run_many(executor, together)
    assert [s.text_out for s in together] == [s.text_out for s in alone]
    words = lambda s: [d["word"] for d in s.data_to("talker")]
    assert [words(s) for s in together] == [words(s) for s in alone]
    assert executor.step_loop is not None and executor.step_loop.stats.max_batch_seen == 4


async def test_sessions_join_between_steps_and_max_batch_holds() -> None:
    executor = lm(max_batch=2, max_words=4)
    sessions = [session(f"s{i}") for i in range(5)]
    await run_many(executor, sessions)
    assert all(s.text_out == " ".join(f"s{i}-{k}" for k in range(4)) for i, s in enumerate(sessions))
    stats = executor.step_loop.stats
    assert stats.max_batch_seen == 2
    assert stats.stepped_sessions == 5 * 4
    # the batch-size histogram (what /metrics shows as omniflow_batch_size): every step in the bucket of
    # its size, sizes 1 or 2 only (bucket bounds 1, 2, 4, ...)
    snap = stats.snapshot()
    assert snap["steps"] == stats.steps == sum(snap["hist"]) and snap["sessions"] == 20
    assert snap["hist"][0] + 2 * snap["hist"][1] == 20 and sum(snap["hist"][2:]) == 0


class Tracking(BatchedExecutor):
    """Records joins and leaves; each session runs `n` steps (param) emitting its step number."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.live: set[str] = set()
        self.left: list[str] = []

    def join(self, session: Any) -> dict[str, Any]:
        self.live.add(session.text)
        return {"name": session.text, "i": 0, "n": int(session.params.get("n", 3))}

    def step(self, states: list[Any]) -> list[StepOutput]:
        if any(st["name"] == "boom" and st["i"] == 1 for st in states):
            raise ValueError("kernel exploded")
        for st in states:
            st["i"] += 1
        return [StepOutput(text=f"{st['i']},", done=st["i"] >= st["n"]) for st in states]

    def leave(self, state: Any) -> None:
        self.live.discard(state["name"])
        self.left.append(state["name"])


async def test_a_cancelled_session_leaves_the_batch_and_frees_its_state() -> None:
    executor = Tracking(stage="s", params={})
    slow = FakeSession(input={"text": "slow"}, params={"n": 10_000})
    quick = FakeSession(input={"text": "quick"}, params={"n": 3})
    slow_task = asyncio.create_task(executor.run(slow))
    await run_executor(executor, quick)
    assert quick.text_out == "1,2,3,"
    slow_task.cancel()                                     # an abort
    with pytest.raises(asyncio.CancelledError):
        await slow_task
    assert executor.live == set() and sorted(executor.left) == ["quick", "slow"]


async def test_a_failed_step_fails_the_sessions_in_it_and_the_loop_goes_on() -> None:
    executor = Tracking(stage="s", params={})
    boom = FakeSession(input={"text": "boom"}, params={"n": 5})
    other = FakeSession(input={"text": "other"}, params={"n": 5})
    results = await asyncio.gather(executor.run(boom), executor.run(other), return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)
    assert executor.live == set()
    after = FakeSession(input={"text": "after"}, params={"n": 2})
    await run_executor(executor, after)
    assert after.text_out == "1,2,"


async def test_fake_session_resume_suppresses_written_steps_and_carries_the_checkpoint() -> None:
    first = session("r", params={"fail_at_step": 3, "fail_attempts": 1})
    with pytest.raises(RuntimeError, match="injected"):
        await run_executor(lm(), first)
    assert first.text_out == "r-0 r-1"
    retry = first.retried()
    assert retry.resume_seq == 2 and retry.checkpoint == "r-0 r-1 "
    await run_executor(lm(), retry)
    assert first.text_out + retry.text_out == "r-0 r-1 r-2 r-3 r-4"     # nothing repeated, nothing missing


async def test_fake_session_round_trips_payloads_and_refuses_after_abort() -> None:
    np = pytest.importorskip("numpy")
    s = FakeSession(stage="talker", downstream=("code2wav",), finals=("code2wav",),
                    chunks=[("thinker", {"hidden": np.arange(4, dtype=np.float32)})])
    got = [c async for c in s.inputs()]
    assert got[0].seq == 1 and got[0].data["hidden"].dtype == np.float32
    await s.emit(data={"codes": np.arange(3)})
    assert s.data_to("code2wav")[0]["codes"].tolist() == [0, 1, 2]
    s.aborted = True
    with pytest.raises(Fenced):
        await s.emit(text="late")
