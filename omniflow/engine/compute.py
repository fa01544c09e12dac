"""Compute threads: where model code runs, so it never blocks the worker's event loop.

A worker's event loop carries its heartbeat, intake, claims, inbox and abort
fan-out; a forward pass that holds it for seconds would let the lease lapse and
every session of the worker be declared lost. So each stage served by a worker
gets one `ComputeThread` (one thread per stage: stages share the host's cores,
as NOTES.md measured) running its own event loop, and the executor's `setup`,
`run` and `close` run there. Blocking calls inside `run` (torch, ONNX Runtime,
a vocoder) block only that stage's thread; torch and ONNX Runtime release the
GIL while they compute, so the worker's loop keeps its timing.

The session an executor sees hops back to the worker's loop for what touches
Redis (`Session.emit`, `inputs`, `flush`): see `omniflow.engine.session`.

    compute = ComputeThread("thinker")
    result = await compute.run(executor.run(session))   # awaited on the worker's loop
    compute.stop()

Handoffs between the two loops are batched (`Handoff`): calls for a loop wait in a deque, and
only the first call of a batch wakes that loop (one `call_soon_threadsafe`, one self-pipe write);
the loop runs every call queued by then in one turn, in order. So a burst of emits, or a batch of
input chunks, costs one wake-up instead of one per item, and no `concurrent.futures.Future` is
made per item (`run_on`: a coroutine started on another loop and awaited here, one handoff each
way). bench/hop.py measures the hop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_STOP_TIMEOUT_S = 5.0


class Handoff:
    """Calls handed to one event loop from other threads, in batches.

    `call(fn, *args)` from any thread queues the call; only the first call of a batch wakes the
    loop: the drain then runs every call queued by the time it runs, in the order they were queued
    (one FIFO per target loop, whichever thread queued them).

    The wake-up: the first batch goes through `call_soon_threadsafe`, and its drain (on the loop's
    own thread) registers an eventfd with the loop (`add_reader`). Every later batch does what
    `call_soon_threadsafe` does, the drain's Handle appended to the loop's ready queue (so calls run
    in the order they came, as before), but wakes the loop with one `eventfd_write` instead of the
    self-pipe's socket send, whose reader receives until a `BlockingIOError` on every wake-up (the
    eventfd's reader reads it once): about 5 µs of CPU less per wake-up (bench/hop.py), and the toy
    pipeline takes ~7 wake-ups per workflow at low load (bench/notes.md, round 10). Where there is
    no eventfd (not Linux), or the loop is not asyncio's own, or it cannot watch a file descriptor,
    every batch keeps the self-pipe. The eventfd is closed with the loop: when a call finds the loop
    closed, or when the loop is collected.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)      # not a strong reference: the registry's value would keep its key
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._lock = threading.Lock()
        self._armed = False         # a drain is scheduled and has not started yet
        self._fd: int | None = None  # the eventfd the loop reads, once its first drain registered it
        self._closer: weakref.finalize[Any, Any] | None = None    # closes it, once: on `_close` or the loop's collection
        self._wired = not hasattr(os, "eventfd")   # True: no eventfd to try (any more)
        self.calls = 0              # counters for bench/hop.py and the notes (not exact across threads)
        self.wakeups = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop()
        if loop is None:
            raise RuntimeError("Event loop is closed")
        return loop

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop soon (thread-safe; FIFO). Raises RuntimeError when the loop
        is closed (nothing runs there any more), as `call_soon_threadsafe` does."""
        self._calls.append((fn, args))
        self.calls += 1
        with self._lock:
            if self._armed:
                return              # the scheduled drain has not started: it takes this call too
            self._armed = True
        self.wakeups += 1
        loop = self.loop
        fd = self._fd
        try:
            if fd is None or loop.is_closed():
                if fd is not None:
                    self._close()
                loop.call_soon_threadsafe(self._drain)      # raises RuntimeError on a closed loop
            else:
                # what call_soon_threadsafe does (the drain's Handle joins the loop's ready queue, so
                # it runs in the order it was called, before what becomes ready later), less its wake-up
                loop._call_soon(self._drain, (), None)    # type: ignore[attr-defined]
                os.eventfd_write(fd, 1)
        except BaseException:
            with self._lock:
                self._armed = False
            raise

    def _reset(self) -> None:
        """The loop's reader of the eventfd: the wake-up is taken (the drain is in the ready queue)."""
        if self._fd is not None:
            try:
                os.eventfd_read(self._fd)
            except BlockingIOError:  # several wake-ups read at once
                pass

    def _drain(self) -> None:
        with self._lock:
            self._armed = False     # calls queued from here on schedule their own drain
        if not self._wired:
            self._wire()
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - as the loop does with a failing callback
                self.loop.call_exception_handler({"message": f"handed-off call {fn!r} failed", "exception": exc})

    def _wire(self) -> None:
        """On the loop's thread, once: the eventfd later batches wake the loop with."""
        self._wired = True
        loop = self.loop
        if not callable(getattr(loop, "_call_soon", None)):    # not asyncio's own loop: the self-pipe stays
            return
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        try:
            loop.add_reader(fd, self._reset)
        except (NotImplementedError, RuntimeError, OSError):   # e.g. a proactor loop: the self-pipe stays
            os.close(fd)
            return
        self._closer = weakref.finalize(loop, os.close, fd)
        self._fd = fd

    def _close(self) -> None:
        self._fd = None
        if self._closer is not None:
            self._closer()          # a finalizer runs once: the loop's collection later closes nothing


_handoffs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Handoff] = weakref.WeakKeyDictionary()
_handoffs_lock = threading.Lock()


def handoff(loop: asyncio.AbstractEventLoop) -> Handoff:
    """The one `Handoff` into `loop` (every thread shares it, so calls keep one order)."""
    found = _handoffs.get(loop)
    if found is None:
        with _handoffs_lock:
            found = _handoffs.get(loop)
            if found is None:
                found = _handoffs[loop] = Handoff(loop)
    return found


def _settle(fut: asyncio.Future[T] | concurrent.futures.Future[T], task: asyncio.Future[T]) -> None:
    """Copy how `task` (another loop's) ended into `fut` (this loop's, or a `concurrent.futures`
    one, which its waiter may cancel from its own thread meanwhile)."""
    if fut.done():
        return
    try:
        if task.cancelled():
            fut.cancel()
        elif (exc := task.exception()) is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(task.result())
    except concurrent.futures.InvalidStateError:    # cancelled by its waiter since `done()` said no
        pass


async def run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on `loop` (another thread's) and await its result here: one handoff to start it,
    one to bring its outcome back. Cancelling the caller cancels the coroutine there too (its task
    sees the `CancelledError` at its next await); the caller does not wait for that."""
    here = asyncio.get_running_loop()
    if here is loop:
        return await coro
    fut: asyncio.Future[T] = here.create_future()
    started: list[asyncio.Task[T]] = []
    cancelled = False

    def start() -> None:
        if cancelled:
            coro.close()
            return
        task = loop.create_task(coro)
        started.append(task)
        task.add_done_callback(lambda t: handoff(here).call(_settle, fut, t))

    def cancel() -> None:
        nonlocal cancelled
        cancelled = True
        if started:
            started[0].cancel()

    handoff(loop).call(start)
    try:
        return await fut
    except asyncio.CancelledError:
        if not fut.done() or fut.cancelled():
            handoff(loop).call(cancel)
        raise


def start_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start `coro` on `loop` (another thread's), in order with the other calls handed to it, and
    return a `concurrent.futures.Future` of its outcome: any thread may wait on it, block on it, or
    check it. Cancelling the future cancels the coroutine there."""
    out: concurrent.futures.Future[T] = concurrent.futures.Future()

    def start() -> None:
        if out.cancelled():
            coro.close()
            return
        task = loop.create_task(coro)
        task.add_done_callback(lambda t: _settle(out, t))

        def cancel_there(fut: concurrent.futures.Future[T]) -> None:
            if fut.cancelled() and not task.done():
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:        # the loop is closed: nothing runs there any more
                    pass
        out.add_done_callback(cancel_there)

    handoff(loop).call(start)
    return out


class ComputeThread:
    """One daemon thread with its own event loop; coroutines are submitted to it from another loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"compute-{name}", daemon=True)
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on this thread's loop (thread-safe)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on this thread and await its result from the calling loop.

        Cancelling the caller cancels the coroutine on the compute loop too; its task sees the
        `CancelledError` at its next await (a blocking call in progress finishes first)."""
        return await run_on(self.loop, coro)

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Cancel what still runs there and end the thread (idempotent)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("compute thread %s did not stop within %.1fs (a blocking call?)", self.name, timeout_s)
