"""`runs_on = "auto"` (the default): an executor's sessions move from its compute thread to the
worker's loop once their steps have shown they are short, and back at a long one
(`omniflow.engine.placement`). The unit tests drive `Placement` with a real compute thread; the last
test runs a real engine (Valkey) with a default executor."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from omniflow.client import AsyncClient
from omniflow.engine import placement
from omniflow.engine.compute import ComputeThread
from omniflow.engine.placement import Placement
from omniflow.engine.worker.pool import PoolCore
from omniflow.errors import PipelineError
from omniflow.executor import Executor, Session
from omniflow.ops.fleet import list_workers
from omniflow.pipeline import StageSpec
from tests.conftest import toy_spec
from tests.helpers import expected_text
from tests.workers_fixtures import CountingLM, WhereThinker

WINDOW = 8


@pytest.fixture(autouse=True)
def small_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of 8 sessions, and thresholds far above what a busy CI machine's preemption adds to a
    step of microseconds (the steps these tests call long block for 1.5 times a threshold)."""
    monkeypatch.setattr(placement, "WINDOW", WINDOW)
    monkeypatch.setattr(placement, "SHORT_STEP_S", 0.020)
    monkeypatch.setattr(placement, "SLOW_STEP_S", 0.040)
    monkeypatch.setattr(placement, "LONG_STEP_S", 0.080)


@pytest.fixture
def compute() -> Any:
    thread = ComputeThread("t")
    yield thread
    thread.stop()


def where(block_s: float = 0.0, hold_s: float = 0.0) -> Coroutine[Any, Any, tuple[str, float, float]]:
    """A session: one step of `block_s` (a blocking call), then `hold_s` awaited; returns the thread
    it ran on and when it started and ended (monotonic)."""
    async def run() -> tuple[str, float, float]:
        began = time.monotonic()
        if block_s:
            time.sleep(block_s)
        await asyncio.sleep(hold_s)
        return threading.current_thread().name, began, time.monotonic()
    return run()


async def held_until(release: threading.Event) -> tuple[str, float, float]:
    """A session that holds its place (awaiting, not blocking) until the test releases it: a hold
    that ends on the test's word, not after a time a busy machine may outrun."""
    began = time.monotonic()
    while not release.is_set():
        await asyncio.sleep(0.001)
    return threading.current_thread().name, began, time.monotonic()


async def sessions(p: Placement, compute: ComputeThread, n: int,
                   make: Callable[[], Coroutine[Any, Any, Any]] = where) -> list[str]:
    return [(await p.run(make(), compute))[0] for _ in range(n)]


async def test_short_sessions_move_to_the_loop_after_one_window(compute: ComputeThread) -> None:
    p = Placement("s", "auto")
    assert await sessions(p, compute, WINDOW) == ["compute-t"] * WINDOW
    assert p.want_loop and not p.on_loop        # decided; the next session moves it
    assert await sessions(p, compute, 3) == [threading.current_thread().name] * 3
    assert p.moves == 1 and p.on_loop


async def test_long_steps_keep_an_executor_on_its_thread(compute: ComputeThread) -> None:
    p = Placement("s", "auto")
    # one session in each window has a step over SLOW_STEP_S: no window passes
    n = 0

    def some_slow() -> Coroutine[Any, Any, Any]:
        nonlocal n
        n += 1
        return where(block_s=placement.SLOW_STEP_S * 1.5 if n % WINDOW == 1 else 0.0)

    assert set(await sessions(p, compute, 3 * WINDOW, some_slow)) == {"compute-t"}
    assert not p.want_loop and p.moves == 0
    # so do many steps over SHORT_STEP_S (more than an eighth of a window), none of them slow
    assert set(await sessions(p, compute, 2 * WINDOW, lambda: where(block_s=placement.SHORT_STEP_S * 1.5))) \
        == {"compute-t"}
    assert not p.want_loop


async def test_a_long_step_on_the_loop_sends_it_back_and_the_next_move_takes_longer(compute: ComputeThread) -> None:
    p = Placement("s", "auto")
    await sessions(p, compute, WINDOW + 1)
    assert p.on_loop
    name, *_ = await p.run(where(block_s=placement.LONG_STEP_S * 1.5), compute)     # ran on the loop, once
    assert name == threading.current_thread().name
    assert not p.want_loop and p.backs == 1
    # back on the thread; the next move needs BACKOFF windows in a row
    assert set(await sessions(p, compute, placement.BACKOFF * WINDOW - 1)) == {"compute-t"}
    assert not p.want_loop
    assert await sessions(p, compute, 2) == ["compute-t", threading.current_thread().name]
    assert p.moves == 3


async def test_a_window_of_slower_steps_on_the_loop_sends_it_back(compute: ComputeThread) -> None:
    p = Placement("s", "auto")
    await sessions(p, compute, WINDOW + 1)        # the last one the first of a window on the loop
    assert p.on_loop
    # steps over SLOW_STEP_S but under LONG_STEP_S: judged with the window, when it is full
    await sessions(p, compute, WINDOW - 2, lambda: where(block_s=placement.SLOW_STEP_S * 1.5))
    assert p.want_loop
    await sessions(p, compute, 1)
    assert not p.want_loop and p.backs == 1


async def test_one_slow_session_in_a_window_on_the_loop_does_not_send_it_back(
        compute: ComputeThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step stretched now and then (the machine preempted the loop's thread) is not a pattern."""
    monkeypatch.setattr(placement, "WINDOW", 16)
    p = Placement("s", "auto")
    await sessions(p, compute, 16)
    n = 0

    def one_slow() -> Coroutine[Any, Any, Any]:
        nonlocal n
        n += 1
        return where(block_s=placement.SLOW_STEP_S * 1.5 if n == 3 else 0.0)

    assert await sessions(p, compute, 2 * 16, one_slow) == [threading.current_thread().name] * 32
    assert p.want_loop and p.backs == 0


async def test_a_move_waits_for_the_old_place_to_empty(
        compute: ComputeThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor never runs on two threads at once: a session that starts while one still runs
    on the thread waits for it (up to MOVE_WAIT_S) before it starts on the loop."""
    monkeypatch.setattr(placement, "MOVE_WAIT_S", 30.0)     # the release below ends the wait, not this
    p = Placement("s", "auto")
    release = threading.Event()
    held = asyncio.ensure_future(p.run(held_until(release), compute))
    try:
        await asyncio.sleep(0.005)
        await sessions(p, compute, WINDOW)            # alongside it, on the thread: the window passes
        assert p.want_loop and p.running == 1
        moving = asyncio.ensure_future(p.run(where(), compute))
        await asyncio.sleep(0.02)
        assert not moving.done() and not p.on_loop    # waiting for the held one to leave the thread
    finally:
        release.set()           # (a failed assert above must not leave the compute thread held)
    name, began, _ = await moving
    held_name, _, held_end = await held
    assert held_name == "compute-t" and name == threading.current_thread().name
    assert began >= held_end and p.on_loop


async def test_a_move_that_cannot_wait_starts_in_the_old_place(compute: ComputeThread) -> None:
    p = Placement("s", "auto")
    release = threading.Event()
    held = asyncio.ensure_future(p.run(held_until(release), compute))
    try:
        await asyncio.sleep(0.005)
        await sessions(p, compute, WINDOW)
        assert p.want_loop and p.running == 1
        waited = time.monotonic()
        name, _, _ = await p.run(where(), compute)    # waits MOVE_WAIT_S, then runs where the held one does
        assert name == "compute-t" and time.monotonic() - waited >= placement.MOVE_WAIT_S * 0.9
        assert not p.on_loop
        name, _, _ = await p.run(where(), compute)    # no second wait within MOVE_PATIENCE_S
        assert name == "compute-t"
    finally:
        release.set()
    await held
    assert await sessions(p, compute, 1) == [threading.current_thread().name]     # empty: it moves


async def test_a_cancelled_session_leaves_its_place(compute: ComputeThread) -> None:
    p = Placement("s", "auto")
    task = asyncio.ensure_future(p.run(where(hold_s=5), compute))
    await asyncio.sleep(0.01)
    assert p.running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert p.running == 0


async def test_pinned_executors_never_move(compute: ComputeThread) -> None:
    thread = Placement("s", "thread")
    assert set(await sessions(thread, compute, 3 * WINDOW)) == {"compute-t"} and thread.moves == 0
    loop = Placement("s", "loop")
    assert set(await sessions(loop, None, 2)) == {threading.current_thread().name}
    lm = PoolCore("lm", StageSpec(executor="tests.workers_fixtures:CountingLM"), executor=CountingLM(stage="lm", params={}),
                  max_sessions=None)
    assert not lm.placement.auto and not lm.placement.on_loop


def test_runs_on_must_be_a_place_it_knows() -> None:
    class Somewhere(Executor):
        runs_on = "gpu"     # type: ignore[assignment]

        async def run(self, session: Session) -> None:
            return None

    with pytest.raises(PipelineError, match=r"runs_on must be one of auto, thread, loop, not 'gpu'"):
        PoolCore("s", StageSpec(executor="x:Somewhere"), executor=Somewhere(stage="s", params={}), max_sessions=None)


async def test_a_default_executor_moves_to_the_worker_loop_in_a_real_engine(engine_factory) -> None:
    """A thinker with no `runs_on`: its first window of sessions runs on its compute thread, the
    next ones on the worker's loop; every workflow completes with its text either way."""
    WhereThinker.threads = []
    spec = toy_spec()
    spec["stages"]["thinker"]["executor"] = "tests.workers_fixtures:WhereThinker"
    texts = [f"hello {i}" for i in range(4 * WINDOW)]
    async with engine_factory(spec) as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            docs: dict[str, Any] = {}
            for part in range(4):       # a window at a time: the first is judged before the next starts
                ids = await client.submit_many(texts[part * WINDOW:(part + 1) * WINDOW])
                docs.update(await client.wait_many(ids, timeout_s=30))
            # the worker's heartbeat says where (`omniflow workers`, GET /v1/admin/workers)
            for _ in range(100):
                runs = {s: w["runs_on"].get(s) for w in await list_workers(eng.store) for s in w["stages"]}
                if runs.get("thinker") == "loop":
                    break
                await asyncio.sleep(0.1)
            assert runs == {"thinker": "loop", "talker": "loop", "code2wav": "loop"}   # the toy ones: runs_on "loop"
    assert [d["state"] for d in docs.values()] == ["completed"] * len(texts)
    assert [d["outputs"]["thinker"]["text"] for d in docs.values()] == [expected_text(t) for t in texts]
    # the thread, then the loop, once (a cold executor's first window may not pass: its first steps
    # import and allocate)
    on_thread = WhereThinker.threads.count("compute-thinker")
    assert WINDOW <= on_thread <= 3 * WINDOW
    assert WhereThinker.threads == ["compute-thinker"] * on_thread + [threading.current_thread().name] * (
        len(texts) - on_thread)
