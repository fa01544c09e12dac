"""Group commit for Redis commands: whatever piles up while one pipeline is in
flight goes out together in the next one.

At low load every command is sent at once (no added latency); under load the
round trips per command fall towards zero. Callers await their own result;
a caller that is cancelled does not cancel the write (it is already queued or
on the wire), so final writes survive cancellation.

A command the server refuses for now (OOM, READONLY, BUSY, LOADING...: nothing
of it was applied) is sent again with backoff, for up to `refused_retry_s`,
before anything queued after it: a session's writes keep their order, and a
passing refusal costs a delay instead of a failed attempt. Callers that must
hear a refusal at once (a submit is `busy` under OOM) opt out per command.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.storage import redisio
from omniflow.errors import RedisRefused
from omniflow.runtime import Backoff

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 512
DEFAULT_REFUSED_RETRY_S = 30.0
REFUSED_BACKOFF_FIRST_S = 0.05
REFUSED_BACKOFF_CAP_S = 1.0

Command = tuple[Any, ...] | Callable[[], tuple[Any, ...]]


class Batcher:
    """Auto-pipelining front for one Redis client."""

    def __init__(self, redis: RedisClient, *, max_batch: int = DEFAULT_MAX_BATCH,
                 refused_retry_s: float = DEFAULT_REFUSED_RETRY_S) -> None:
        self._redis = redis
        self._max_batch = max_batch
        self.refused_retry_s = refused_retry_s
        # a queued command is its argument tuple, or a function that builds it at flush time
        # (lazy commands let callers keep adding to one command until it is on the wire),
        # its future, and whether a refusal is retried
        self._queue: list[tuple[Command, asyncio.Future[Any], bool]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.closing = False            # set at shutdown: refused commands fail at once
        self._holding = False           # the flusher is sending refused commands again
        self._bypassing: set[asyncio.Task[None]] = set()
        self.round_trips = 0
        self.commands = 0
        self.refusals = 0

    def send(self, *command: Any, retry_refused: bool = True) -> asyncio.Future[Any]:
        """Queue one raw command; the future resolves to its reply (or its translated error)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        cmd = command[0] if len(command) == 1 and callable(command[0]) else command
        if not retry_refused and self._holding:
            # refused writes are being held and sent again (the flusher waits on them): a command
            # that must not wait (a submit: busy is its answer) takes a round trip of its own
            self._bypass([(cmd, fut, False)])
            return fut
        self._queue.append((cmd, fut, retry_refused))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop())
        return fut

    @staticmethod
    def _build(queued: list[tuple[Command, asyncio.Future[Any], bool]]) -> list[tuple[tuple[Any, ...], asyncio.Future[Any], bool]]:
        """The commands of `queued`, lazy ones built now; one that cannot be built fails alone."""
        built: list[tuple[tuple[Any, ...], asyncio.Future[Any], bool]] = []
        for cmd, fut, retry in queued:
            try:
                built.append((cmd() if callable(cmd) else cmd, fut, retry))
            except Exception as exc:  # noqa: BLE001 - a command that cannot be built fails alone
                _resolve(fut, exc)
        return built

    def _bypass(self, queued: list[tuple[Command, asyncio.Future[Any], bool]]) -> None:
        built = self._build(queued)
        if built:
            task = asyncio.create_task(self._execute(built))
            self._bypassing.add(task)
            task.add_done_callback(self._bypassing.discard)

    def send_lazy(self, build: Callable[[], tuple[Any, ...]]) -> asyncio.Future[Any]:
        """Queue a command built only when its pipeline is assembled."""
        return self.send(build)

    async def call(self, *command: Any) -> Any:
        # No shield needed: a cancelled caller cancels only its future; the command is
        # already queued and goes out anyway (the flusher skips futures that are done).
        return await self.send(*command)

    async def drain(self) -> None:
        """Wait until everything queued so far has been written."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_loop(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            built = self._build(batch)
            if built:
                await self._execute(built)

    async def _execute(self, built: list[tuple[tuple[Any, ...], asyncio.Future[Any], bool]]) -> None:
        """Send the batch and resolve each future; commands the server refused (and that may wait)
        are sent again, in order, with backoff, while every other future is resolved at once."""
        held: list[tuple[tuple[Any, ...], asyncio.Future[Any], Any]] = []
        try:
            results = await self._run([cmd for cmd, _, _ in built])
        except Exception as exc:  # noqa: BLE001 - the round trip failed: every waiter must hear it
            results = [exc] * len(built)
        for (cmd, fut, retry), result in zip(built, results):
            if retry and isinstance(result, RedisRefused) and not self.closing:
                held.append((cmd, fut, result))
            else:
                _resolve(fut, result)
        if not held:
            return
        logger.warning("Redis refused %d command(s) (%s); holding them and retrying for up to %.0fs",
                       len(held), held[0][2], self.refused_retry_s)
        deadline = time.monotonic() + self.refused_retry_s
        backoff = Backoff(first_s=REFUSED_BACKOFF_FIRST_S, cap_s=REFUSED_BACKOFF_CAP_S)
        self._holding = True
        waiting = [q for q in self._queue if not q[2]]      # queued meanwhile, and must not wait either
        if waiting:
            self._queue = [q for q in self._queue if q[2]]
            self._bypass(waiting)
        try:
            await self._resend(held, deadline, backoff)
        finally:
            self._holding = False

    async def _resend(self, held: list[tuple[tuple[Any, ...], asyncio.Future[Any], Any]], deadline: float,
                      backoff: Backoff) -> None:
        while held and not self.closing and time.monotonic() < deadline:
            self.refusals += 1
            await backoff.sleep()
            try:
                results = await self._run([cmd for cmd, _, _ in held])
            except Exception as exc:  # noqa: BLE001 - the round trip failed: every waiter must hear it
                results = [exc] * len(held)
            still = []
            for (cmd, fut, _), result in zip(held, results):
                if isinstance(result, RedisRefused):
                    still.append((cmd, fut, result))
                else:
                    _resolve(fut, result)
            held = still
        for _, fut, result in held:         # refused for longer than our patience: the caller decides
            _resolve(fut, result)

    async def _run(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        self.round_trips += 1
        self.commands += len(commands)
        try:
            return await redisio.execute(self._redis, commands)
        except RedisRefused as exc:      # the whole round trip was refused (e.g. LOADING): none was applied
            return [exc] * len(commands)


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if fut.done():                  # its caller was cancelled: the command went out anyway
        return
    if isinstance(result, BaseException):
        fut.set_exception(result)
    else:
        fut.set_result(result)
