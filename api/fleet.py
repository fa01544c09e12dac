"""Reads about the fleet: live workers per stage (/readyz, /metrics) and the pools snapshot
shared by every dashboard and SSE stream of one API process."""
from __future__ import annotations

import asyncio
import time
from typing import Any

from omniflow.admin import collect_stats
from omniflow.store import Store

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


async def live_workers(store: Store) -> dict[str, int]:
    """Live workers per stage (`Store.live_workers`: a worker serving several stages counts for each)."""
    return await store.live_workers()
