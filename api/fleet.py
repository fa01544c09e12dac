"""Reads about the fleet: live workers per stage (/readyz, /metrics) and the pools snapshot
shared by every dashboard and SSE stream of one API process."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.asyncio import Redis

from omniflow.admin import collect_stats
from omniflow.keys import Keys
from omniflow.store import Store, now_ms, s

POOLS_MAX_AGE_S = 0.5


class PoolsCache:
    """The pools snapshot, read at most once per `max_age_s` however many dashboards watch it."""

    def __init__(self, max_age_s: float = POOLS_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._value: dict[str, Any] | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()

    async def get(self, store: Store) -> dict[str, Any]:
        async with self._lock:
            if self._value is None or time.monotonic() - self._at > self.max_age_s:
                self._value = await collect_stats(store)
                self._at = time.monotonic()
            return self._value


async def live_workers(redis: Redis, keys: Keys, stages: tuple[str, ...]) -> dict[str, int]:
    """Live workers per stage: members of `<p>:workers` whose lease (score, ms) is in the future."""
    ids = await redis.zrangebyscore(keys.workers, f"({now_ms()}", "+inf")
    counts = dict.fromkeys(stages, 0)
    if ids:
        pipe = redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hget(keys.worker_info(s(worker_id)), "stage")
        for stage in await pipe.execute():
            name = s(stage)
            if name in counts:
                counts[name] += 1
    return counts
