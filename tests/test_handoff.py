"""Handoffs between a stage's compute thread and the worker's loop (`omniflow.engine.compute`): calls
batched into one wake-up, kept in order, coroutines run on the other loop with their outcome (result,
error, cancellation) brought back; a session read from a compute thread loses no chunk it took in a
batch."""
from __future__ import annotations

import asyncio
import gc
import os
import threading
import weakref
from typing import Any

import pytest
from helpers import eventually

from omniflow.dataplane import codec
from omniflow.engine.compute import ComputeThread, handoff, run_on, start_on
from omniflow.engine.session import Session
from omniflow.models import SessionState
from omniflow.storage.keys import Keys


async def test_a_burst_of_calls_from_a_thread_wakes_the_loop_once_and_runs_in_order() -> None:
    loop = asyncio.get_running_loop()
    hop = handoff(loop)
    assert handoff(loop) is hop             # one per loop: every thread's calls share one order
    seen: list[int] = []
    queued = threading.Event()

    def producer() -> None:
        for i in range(1000):
            hop.call(seen.append, i)
        queued.set()

    wakeups = hop.wakeups
    thread = threading.Thread(target=producer)
    thread.start()
    queued.wait()          # the loop is held here, so every call of the burst waits for one drain
    thread.join()
    await eventually(lambda: len(seen) == 1000, what="the handed-off calls")
    assert seen == list(range(1000))
    assert hop.wakeups - wakeups == 1


async def test_a_failing_call_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.get_running_loop()
    seen: list[str] = []

    def boom() -> None:
        raise ValueError("boom")

    threading.Thread(target=lambda: [handoff(loop).call(boom), handoff(loop).call(seen.append, "after")]).start()
    await eventually(lambda: seen == ["after"], what="the call after the failing one")
    assert "boom" in caplog.text


class _Forever:
    """A coroutine that runs until it is cancelled, and says both (from any thread)."""

    def __init__(self) -> None:
        self.running, self.cancelled = threading.Event(), threading.Event()

    async def __call__(self) -> None:
        self.running.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def test_run_on_brings_back_results_errors_and_cancels_the_remote_task() -> None:
    compute = ComputeThread("t")
    caller = asyncio.get_running_loop()
    try:
        async def where() -> bool:
            return asyncio.get_running_loop() is compute.loop

        assert await run_on(compute.loop, where()) is True
        assert await run_on(caller, where()) is False       # the calling loop itself: no hop

        async def fails() -> None:
            raise KeyError("remote")

        with pytest.raises(KeyError, match="remote"):
            await run_on(compute.loop, fails())

        forever = _Forever()
        task = asyncio.ensure_future(compute.run(forever()))
        await eventually(forever.running.is_set, what="the coroutine running on the compute thread")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await eventually(forever.cancelled.is_set, what="the remote task cancelled")
    finally:
        compute.stop()


class _Batcher:
    """A session's writes answered 'ok' at once (this test reads inputs only)."""

    def send(self, *command: Any, **_: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_result(b"ok")
        return fut

    def send_lazy(self, build: Any) -> asyncio.Future[Any]:
        return self.send(build)


def _reader(stage: str, upstream: str) -> Session:
    """A session of `stage` reading `upstream`'s chunks, its home the running loop (the worker's)."""
    return Session(wf_id="wf", stage=stage, attempt=1, input={}, params={}, finals=(), downstream=(),
                   resume_seq=0, _batcher=_Batcher(), _keys=Keys("t"),  # type: ignore[arg-type]
                   upstream=(upstream,), state=SessionState.WAITING_INPUT, _home=asyncio.get_running_loop())


async def test_inputs_read_from_a_compute_thread_keep_what_a_batch_took() -> None:
    """Every chunk waiting is taken in one hop; an executor that stops reading after two and reads
    again later gets the rest, in order, then the end of the stream."""
    compute = ComputeThread("t")
    try:
        session = _reader("talker", "thinker")
        for seq in range(1, 6):
            session._queue.put_nowait(("thinker", {b"seq": str(seq).encode(), b"a": b"1", b"d": codec.dumps(seq)}))
        session._queue.put_nowait(("thinker", {b"eos": b"1"}))

        async def reads_in_two_goes() -> tuple[list[int], list[int]]:
            first: list[int] = []
            async for chunk in session.inputs():
                first.append(chunk.data)
                if len(first) == 2:
                    break
            return first, [chunk.data async for chunk in session.inputs()]

        assert await compute.run(reads_in_two_goes()) == ([1, 2], [3, 4, 5])
        assert session._queue.empty() and session.state is SessionState.RUNNING
    finally:
        compute.stop()


async def test_a_compute_thread_session_with_its_next_chunk_in_keeps_the_thread() -> None:
    """A session read from a compute thread whose next chunk (or end of stream) is already on the
    worker's loop takes it without yielding to the other coroutines on its thread, as it would on
    the worker's loop; with nothing there it yields to them while it waits."""
    compute = ComputeThread("t")
    loop = asyncio.get_running_loop()
    try:
        session = _reader("code2wav", "talker")

        def feed(*items: Any) -> None:
            for item in items:
                session._queue.put_nowait(("talker", item))
        chunk = {b"seq": b"1", b"a": b"1", b"d": codec.dumps("one")}
        fed = threading.Event()

        async def reader() -> list[str]:
            order: list[str] = []
            chunks = session.inputs().__aiter__()
            here = asyncio.get_running_loop()
            here.call_soon(order.append, "other")        # another session's turn, ready on this thread
            order.append((await chunks.__anext__()).data)    # nothing in yet: waits, and the other runs
            here.call_soon(order.append, "other again")
            loop.call_soon_threadsafe(feed, {b"eos": b"1"})
            loop.call_soon_threadsafe(fed.set)
            fed.wait(5)                                   # the end of the stream is in (this thread held)
            async for _ in chunks:                        # taken at once: the other waits its turn
                pass
            order.append("ended")
            await asyncio.sleep(0)
            return order

        task = asyncio.ensure_future(compute.run(reader()))
        await asyncio.sleep(0.05)
        feed(chunk)
        assert await task == ["other", "one", "ended", "other again"]
    finally:
        compute.stop()


async def test_a_hop_cancelled_on_the_worker_loop_is_a_cancellation_on_the_thread() -> None:
    """The thread blocked for chunks that are in sees the hop cancelled there (the worker stopping) as
    the asyncio cancellation a yielding hop would bring, not as a `concurrent.futures` error."""
    compute = ComputeThread("t")
    try:
        session = _reader("code2wav", "talker")
        session._queue.put_nowait(("talker", {b"seq": b"1", b"a": b"1", b"d": codec.dumps(1)}))   # in: it blocks
        started = asyncio.Event()

        async def held(_open: set[str]) -> list[Any]:
            started.set()
            await asyncio.sleep(3600)
            return []
        session._next_batch = held                   # type: ignore[method-assign]

        async def reader() -> str:
            try:
                async for _ in session.inputs():
                    pass
            except asyncio.CancelledError:
                return "cancelled"
            return "ended"

        task = asyncio.ensure_future(compute.run(reader()))
        await started.wait()
        next(t for t in asyncio.all_tasks() if t.get_coro().__name__ == "held").cancel()   # type: ignore[union-attr]
        assert await task == "cancelled"
    finally:
        compute.stop()


async def test_start_on_gives_a_future_any_thread_can_wait_on() -> None:
    compute = ComputeThread("t")
    try:
        async def where() -> str:
            return threading.current_thread().name

        assert start_on(compute.loop, where()).result(timeout=5) == "compute-t"

        async def fails() -> None:
            raise KeyError("remote")

        with pytest.raises(KeyError, match="remote"):
            await asyncio.wrap_future(start_on(compute.loop, fails()))
        forever = _Forever()
        fut = start_on(compute.loop, forever())
        await eventually(forever.running.is_set, what="the coroutine running on the compute thread")
        assert fut.cancel()
        await eventually(forever.cancelled.is_set, what="the remote task cancelled with its future")
    finally:
        compute.stop()


def _is_eventfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        return False


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="no eventfd here: every batch takes the self-pipe")
async def test_a_call_queued_while_the_loop_is_busy_runs_before_what_becomes_ready_after_it() -> None:
    """After the first batch the loop is woken through an eventfd, not the self-pipe; a call handed
    over while the loop is busy still joins its ready queue then, as call_soon_threadsafe's does."""
    loop = asyncio.get_running_loop()
    hop = handoff(loop)
    warmed = threading.Event()
    threading.Thread(target=hop.call, args=(warmed.set,)).start()
    await eventually(warmed.is_set, what="the first (self-pipe) batch")
    assert hop._fd is not None and _is_eventfd(hop._fd)
    order: list[str] = []
    queued = threading.Event()

    def busy() -> None:            # the loop is held here while a thread hands a call over
        threading.Thread(target=lambda: (hop.call(order.append, "handed over"), queued.set())).start()
        assert queued.wait(5)
        loop.call_soon(order.append, "ready after it")

    loop.call_soon(busy)
    await eventually(lambda: len(order) == 2, what="both callbacks")
    assert order == ["handed over", "ready after it"]


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="no eventfd here: every batch takes the self-pipe")
def test_a_closed_loop_refuses_calls_and_its_eventfd_is_closed() -> None:
    compute = ComputeThread("t")
    hop = handoff(compute.loop)
    ran = threading.Event()
    hop.call(ran.set)
    assert ran.wait(5)
    fd = hop._fd
    assert fd is not None and _is_eventfd(fd)
    compute.stop()
    with pytest.raises(RuntimeError, match="closed"):
        hop.call(print, "never")
    assert not _is_eventfd(fd)
    assert hop._fd is None


@pytest.mark.skipif(not hasattr(os, "eventfd"), reason="no eventfd here: every batch takes the self-pipe")
def test_a_collected_loop_takes_its_handoff_and_eventfd_with_it() -> None:
    compute = ComputeThread("t")
    ran = threading.Event()
    handoff(compute.loop).call(ran.set)
    assert ran.wait(5)
    fd = handoff(compute.loop)._fd
    assert fd is not None and _is_eventfd(fd)
    compute.stop()
    ref = weakref.ref(compute.loop)
    del compute
    gc.collect()
    assert ref() is None, "the handoff registry kept the loop alive"
    assert not _is_eventfd(fd)
