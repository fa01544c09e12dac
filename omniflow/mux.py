"""One blocking XREAD for many streams.

Workers wait on the edge logs of all their sessions, and the API on the event
logs of all its waiters, through one connection each: the reader blocks on
every watched stream plus a private *wake* stream, so adding a stream never
waits for the block to time out (whoever adds one XADDs to the wake stream;
the worker's claim script does it in the same round trip).
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omniflow.keys import Keys

logger = logging.getLogger(__name__)

Entry = tuple[bytes, dict[bytes, bytes]]


class StreamMux:
    def __init__(self, redis: Redis, keys: Keys, *, owner_id: str | None = None, block_ms: int = 5_000,
                 count: int = 512) -> None:
        self._redis = redis
        self.wake_key = keys.wake(owner_id or uuid.uuid4().hex)
        self._block_ms = block_ms
        self._count = count
        self._watched: dict[str, tuple[bytes | str, asyncio.Queue[Entry]]] = {}
        self._wake_id: bytes | str = "$"
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mux:{self.wake_key}")

    def watch(self, key: str, from_id: str = "0-0") -> asyncio.Queue[Entry]:
        """Start delivering entries of `key` after `from_id` into the returned queue."""
        queue: asyncio.Queue[Entry] = asyncio.Queue()
        self._watched[key] = (from_id, queue)
        return queue

    def unwatch(self, key: str) -> None:
        self._watched.pop(key, None)

    async def poke(self) -> None:
        """Wake the reader so it picks up newly watched streams now."""
        await self._redis.xadd(self.wake_key, {"w": "1"}, maxlen=64, approximate=True)

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self._redis.delete(self.wake_key)
        except (RedisConnectionError, RedisTimeoutError, OSError):
            pass

    async def _run(self) -> None:
        backoff = 0.05
        while not self._closed:
            streams: dict[Any, Any] = {self.wake_key: self._wake_id}
            streams.update({k: v[0] for k, v in self._watched.items()})
            try:
                reply = await self._redis.xread(streams, count=self._count, block=self._block_ms)
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                logger.warning("stream reader: %s; retrying in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            for raw_key, entries in reply or []:
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                if not entries:
                    continue
                if key == self.wake_key:
                    self._wake_id = entries[-1][0]
                    continue
                slot = self._watched.get(key)
                if slot is None:
                    continue
                self._watched[key] = (entries[-1][0], slot[1])
                for entry in entries:
                    slot[1].put_nowait(entry)
