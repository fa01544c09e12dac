"""Reads about the fleet shared by /readyz and /metrics: live workers per stage."""
from __future__ import annotations

from omniflow.keys import Keys
from omniflow.store import now_ms, s
from redis.asyncio import Redis


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
