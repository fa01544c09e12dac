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

from redis.asyncio import Redis

from omniflow import redisio, scripts
from omniflow.errors import RedisRefused

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 512
DEFAULT_REFUSED_RETRY_S = 30.0
REFUSED_BACKOFF_FIRST_S = 0.05
REFUSED_BACKOFF_CAP_S = 1.0

Command = tuple[Any, ...] | Callable[[], tuple[Any, ...]]


class Batcher:
    """Auto-pipelining front for one Redis client."""

    def __init__(self, redis: Redis, *, max_batch: int = DEFAULT_MAX_BATCH,
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
        self.round_trips = 0
        self.commands = 0
        self.refusals = 0

    def send(self, *command: Any, retry_refused: bool = True) -> asyncio.Future[Any]:
        """Queue one raw command; the future resolves to its reply (or its translated error)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        cmd = command[0] if len(command) == 1 and callable(command[0]) else command
        self._queue.append((cmd, fut, retry_refused))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_loop())
        return fut

    def send_lazy(self, build: Callable[[], tuple[Any, ...]]) -> asyncio.Future[Any]:
        """Queue a command built only when its pipeline is assembled."""
        return self.send(build)

    async def call(self, *command: Any) -> Any:
        # No shield needed: a cancelled caller cancels only its future; the command is
        # already queued and goes out anyway (the flusher skips futures that are done).
        return await self.send(*command)

    async def script(self, name: str, keys: list[str], args: list[Any], *, retry_refused: bool = True) -> Any:
        return await self.send(*scripts.evalsha_args(name, keys, args), retry_refused=retry_refused)

    async def drain(self) -> None:
        """Wait until everything queued so far has been written."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_loop(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            built: list[tuple[tuple[Any, ...], asyncio.Future[Any], bool]] = []
            for cmd, fut, retry in batch:
                try:
                    built.append((cmd() if callable(cmd) else cmd, fut, retry))
                except Exception as exc:  # noqa: BLE001 - a command that cannot be built fails alone
                    if not fut.done():
                        fut.set_exception(exc)
            if not built:
                continue
            try:
                results = await self._execute([c for c, _, _ in built], [r for _, _, r in built])
            except Exception as exc:  # noqa: BLE001 - the round trip failed: every waiter must hear it
                for _, fut, _ in built:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut, _), result in zip(built, results):
                if fut.done():
                    continue
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    async def _execute(self, commands: list[tuple[Any, ...]], retry: list[bool]) -> list[Any]:
        results = await self._run(commands)
        started = time.monotonic()
        delay_s = REFUSED_BACKOFF_FIRST_S
        while not self.closing and time.monotonic() - started < self.refused_retry_s:
            again = [i for i, r in enumerate(results) if retry[i] and isinstance(r, RedisRefused)]
            if not again:
                break
            if delay_s == REFUSED_BACKOFF_FIRST_S:
                logger.warning("Redis refused %d command(s) (%s); holding them and retrying for up to %.0fs",
                               len(again), results[again[0]], self.refused_retry_s)
            self.refusals += 1
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, REFUSED_BACKOFF_CAP_S)
            for i, result in zip(again, await self._run([commands[i] for i in again])):
                results[i] = result
        return results

    async def _run(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        self.round_trips += 1
        self.commands += len(commands)
        try:
            return await redisio.execute(self._redis, commands)
        except RedisRefused as exc:      # the whole round trip was refused (e.g. LOADING): none was applied
            return [exc] * len(commands)
