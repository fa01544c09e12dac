"""Durability settings: no eviction, WAITAOF, and garbage collection back to baseline."""
from __future__ import annotations

import asyncio

import pytest

from omniflow.ops.embedded import EmbeddedServer
from omniflow.errors import ConfigError
from omniflow.engine.reconciler import Reconciler
from omniflow.engine.worker import Worker

from conftest import toy_spec
from helpers import eventually, request


async def test_processes_refuse_a_server_that_may_evict_keys(tmp_path, settings_factory) -> None:
    server = EmbeddedServer(data_dir=tmp_path, appendonly=False,
                            extra_args=["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]).start()
    try:
        from omniflow.pipeline import build_pipeline

        settings = settings_factory(server.url)
        pipeline = build_pipeline(toy_spec())
        for process in (Reconciler(settings=settings, pipeline=pipeline, redis_url=server.url),
                        Worker(settings=settings, pipeline=pipeline, stage="thinker", redis_url=server.url)):
            with pytest.raises(ConfigError, match="maxmemory-policy is 'allkeys-lru'.*noeviction"):
                await asyncio.wait_for(process.run(), 10)
    finally:
        server.stop()


async def test_wait_aof_acknowledges_after_the_write_is_on_disk(engine_factory) -> None:
    async with engine_factory(wait_aof=True) as eng:
        sub = await eng.store.submit(request("fsynced"))
        assert (await eng.store.wait(sub.id, timeout_s=10))["state"] == "completed"


@pytest.mark.slow
async def test_finished_workflows_expire_and_memory_returns_to_baseline(engine_factory) -> None:
    async with engine_factory(result_ttl_s=3, tombstone_ttl_s=3, idempotency_ttl_s=3, max_deadline_s=10,
                              default_deadline_s=10) as eng:
        prefix = eng.settings.prefix

        async def wf_keys() -> list[bytes]:
            # SCAN also reclaims keys whose TTL has passed, like a client touching them would
            return [k async for k in eng.redis.scan_iter(match=f"{prefix}:*", count=5000)
                    if b":wf:" in k or b":tomb:" in k or b":idem:" in k]

        baseline = (await eng.redis.info("memory"))["used_memory"]
        aborted = await eng.store.submit(request("gc aborted", request_id="gc-aborted"))
        await eng.store.abort(aborted.id)           # leaves a tombstone and an idempotency key
        subs = await asyncio.gather(*(eng.store.submit(request(f"gc {i}", request_id=f"gc-{i}")) for i in range(150)))
        # A 10 s deadline (the listing index is trimmed at result TTL + deadline): 150 workflows on a loaded
        # 2-core machine took longer than a 5 s one, failed it and never reached the completed index.
        # Completion is read from the `completed` listing index, not with `wait`: with 3 s TTLs, a record may
        # already have expired by the time a waiter on a loaded machine reads its document.
        completed = eng.store.keys.state_index("completed", 0)

        async def all_completed() -> bool:
            return await eng.redis.zcard(completed) >= len(subs)

        await eventually(all_completed, timeout_s=90, what="all 150 workflows in the completed index")
        assert all(score is not None for score in await eng.redis.zmscore(completed, [s.id for s in subs]))
        peak = (await eng.redis.info("memory"))["used_memory"]
        assert await wf_keys()
        # the keys go when their 3 s TTL lapses: wait for that, not for 3 s
        await eventually(lambda: _empty(wf_keys), timeout_s=13, what="every workflow, tombstone and idempotency key expired")
        await eventually(lambda: _zero(eng.redis.zcard(eng.store.keys.all_wf(0))), timeout_s=40,
                         what="the listing index trimmed to empty")
        after = (await eng.redis.info("memory"))["used_memory"]
        growth, left = peak - baseline, after - baseline
        assert growth > 0
        assert left < 0.2 * growth, f"baseline {baseline}, peak {peak}, after {after}"


async def _empty(keys_fn) -> bool:
    return not await keys_fn()


async def _zero(aw) -> bool:
    return await aw == 0
