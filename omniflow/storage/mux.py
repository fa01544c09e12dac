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

from omniflow.storage.client import RedisClient

from omniflow.storage.keys import Keys
from omniflow.storage.redisio import REDIS_ERRORS, translate
from omniflow.runtime import Backoff

logger = logging.getLogger(__name__)

Entry = tuple[bytes, dict[bytes, bytes]]
#: the wake stream expires this long after its last poke: one left by a killed process goes away
WAKE_TTL_S = 3600


class StreamMux:
    def __init__(self, redis: RedisClient, keys: Keys, *, owner_id: str | None = None, block_ms: int = 5_000,
                 count: int = 512, cell: int = 0) -> None:
        """Watched streams must all be in the slot of `cell` on a cluster (one mux per cell there)."""
        self._redis = redis
        self.wake_key = keys.wake(owner_id or uuid.uuid4().hex, cell)
        self._block_ms = block_ms
        self._count = count
        self._watched: dict[str, tuple[bytes | str, asyncio.Queue[Any], Any]] = {}
        self._wake_id: bytes | str = "$"
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.reads = 0              # blocking reads issued
        self._reading = False       # one is outstanding (the streams watched since are not in it)
        self._poked = 0             # the read a poke was sent for

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"mux:{self.wake_key}")

    def watch(self, key: str, from_id: str = "0-0", *, queue: asyncio.Queue[Any] | None = None,
              tag: Any = None) -> asyncio.Queue[Any]:
        """Deliver entries of `key` after `from_id` into `queue` (a new one by default).

        With a `tag`, items are `(tag, entry)`, so one queue can serve several streams.
        """
        queue = queue if queue is not None else asyncio.Queue()
        self._watched[key] = (from_id, queue, tag)
        return queue

    def unwatch(self, key: str, queue: asyncio.Queue[Any] | None = None) -> None:
        """Stop delivering `key`; with `queue`, only if it is still the one being fed (a newer
        watcher of the same key, e.g. the retry of a session on this worker, keeps its watch)."""
        slot = self._watched.get(key)
        if slot is not None and (queue is None or slot[1] is queue):
            del self._watched[key]

    def needs_poke(self) -> bool:
        """Whether a stream watched now needs a `poke` to be read soon: True once per outstanding read
        (the read after it takes every stream watched meanwhile), False when no read is outstanding."""
        if self._reading and self._poked != self.reads:
            self._poked = self.reads
            return True
        return False

    async def poke(self) -> None:
        """Wake the reader so it picks up newly watched streams now."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self.wake_key, {"w": "1"}, maxlen=64, approximate=True)
        pipe.expire(self.wake_key, WAKE_TTL_S)
        await pipe.execute()

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            await self._redis.delete(self.wake_key)
        except REDIS_ERRORS as exc:
            logger.warning("stream reader: could not delete %s (it expires): %s", self.wake_key, translate(exc))

    async def _run(self) -> None:
        backoff = Backoff()
        while not self._closed:
            streams: dict[Any, Any] = {self.wake_key: self._wake_id}
            asked = dict(self._watched)
            streams.update({k: v[0] for k, v in asked.items()})
            self.reads += 1
            self._reading = True
            try:
                reply = await self._redis.xread(streams, count=self._count, block=self._block_ms)
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as exc:          # lost, BUSY, LOADING...: wait and read again
                self._reading = False
                await backoff.wait(logger, "stream reader", translate(exc))
                continue
            finally:
                self._reading = False
            for raw_key, entries in reply or []:
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                if not entries:
                    continue
                if key == self.wake_key:
                    self._wake_id = entries[-1][0]
                    continue
                slot = self._watched.get(key)
                if slot is None or slot is not asked.get(key):
                    continue    # (re)watched while we read from the old position: read again from the new one
                _, queue, tag = slot
                self._watched[key] = (entries[-1][0], queue, tag)
                for entry in entries:
                    queue.put_nowait(entry if tag is None else (tag, entry))
