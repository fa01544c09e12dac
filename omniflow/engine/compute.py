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
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_STOP_TIMEOUT_S = 5.0


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
        return await asyncio.wrap_future(self.submit(coro))

    def stop(self, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        """Cancel what still runs there and end the thread (idempotent)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("compute thread %s did not stop within %.1fs (a blocking call?)", self.name, timeout_s)
