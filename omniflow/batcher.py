"""Group commit for Redis commands: whatever piles up while one pipeline is in
flight goes out together in the next one.

At low load every command is sent at once (no added latency); under load the
round trips per command fall towards zero. Callers await their own result;
a caller that is cancelled does not cancel the write (it is already queued or
on the wire), so final writes survive cancellation.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Union

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omniflow import scripts
from omniflow.errors import RedisUnavailable

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 512

Command = Union[tuple[Any, ...], Callable[[], tuple[Any, ...]]]


class Batcher:
    """Auto-pipelining front for one Redis client."""

    def __init__(self, redis: Redis, *, max_batch: int = DEFAULT_MAX_BATCH) -> None:
        self._redis = redis
        self._max_batch = max_batch
        # a queued command is its argument tuple, or a function that builds it at flush time
        # (lazy commands let callers keep adding to one command until it is on the wire)
        self._queue: list[tuple[Command, asyncio.Future[Any]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.round_trips = 0
        self.commands = 0

    def send(self, *command: Any) -> asyncio.Future[Any]:
        """Queue one raw command; the future resolves to its reply (or its error)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((command[0] if len(command) == 1 and callable(command[0]) else command, fut))
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

    async def script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self.send(*scripts.evalsha_args(name, keys, args))

    async def drain(self) -> None:
        """Wait until everything queued so far has been written."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_loop(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            try:
                results = await self._execute([cmd() if callable(cmd) else cmd for cmd, _ in batch])
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                err = RedisUnavailable(f"Redis unreachable: {exc}")
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            except Exception as exc:  # noqa: BLE001 - every waiter must hear about it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), result in zip(batch, results):
                if fut.done():
                    continue
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)

    async def _execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        results = await self._run(commands)
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            await scripts.load_all(self._redis)
            retried = await self._run([commands[i] for i in missing])
            for i, result in zip(missing, retried):
                results[i] = result
        return results

    async def _run(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        self.round_trips += 1
        self.commands += len(commands)
        if len(commands) == 1:
            try:
                return [await self._redis.execute_command(*commands[0])]
            except (RedisConnectionError, RedisTimeoutError, OSError):
                raise
            except Exception as exc:  # noqa: BLE001 - returned in place, like a pipeline
                return [exc]
        pipe = self._redis.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*cmd)
        return list(await pipe.execute(raise_on_error=False))
