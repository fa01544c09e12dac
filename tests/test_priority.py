"""Priority classes and per-tenant fair share against a real server: class task streams, the order
stage intake serves them in, allowances, fair-share admission (no timed assertions: orders and
counts of one run)."""
from __future__ import annotations

import pytest

from omniflow.errors import AdmissionRefused, FairShareRefused, PriorityNotAllowed
from omniflow.models import Priority
from omniflow.storage.fairshare import set_weight, weights_table
from omniflow.storage.schema import s

from conftest import toy_spec
from helpers import eventually, request


async def test_each_priority_class_has_its_own_task_stream_and_every_class_completes(engine_factory) -> None:
    async with engine_factory() as eng:
        ids = {p: (await eng.store.submit(request(f"{p.value} hello"), priority=p)).id for p in Priority}
        for prio, wf_id in ids.items():
            doc = await eng.store.wait(wf_id, timeout_s=20)
            assert doc["state"] == "completed" and doc["priority"] == prio.value
        for prio in Priority:
            info = await eng.redis.xinfo_stream(eng.store.keys.tasks(eng.pipeline.queue("thinker"), 0, prio.value))
            assert info["entries-added"] == 1          # the thinker's one session of that class, on its stream
        counts = await eng.redis.hgetall(eng.store.keys.tenant_inflight(0))
        assert {s(k): int(v) for k, v in counts.items()} == {"default": 0}      # every count given back


async def test_interactive_work_is_served_before_a_batch_backlog(engine_factory) -> None:
    # one thinker slot, sessions of a few chunks: a backlog of batch work queued before any worker runs
    spec = toy_spec(thinker={"token_delay_s": 0.005})
    spec["stages"]["thinker"].update(max_sessions=1, prefetch=1)
    async with engine_factory(spec, workers=False) as eng:
        batch = [(await eng.store.submit(request(f"batch {i}"), priority=Priority.BATCH)).id for i in range(12)]
        live = [(await eng.store.submit(request(f"live {i}"), priority=Priority.INTERACTIVE)).id for i in range(3)]
        for stage in eng.pipeline.order:
            await eng.add_worker(stage)
        for wf_id in batch + live:
            assert (await eng.store.wait(wf_id, timeout_s=60))["state"] == "completed"
        ends = {}
        for wf_id in batch + live:
            ends[wf_id] = int(s(await eng.redis.hget(eng.store.keys.stages(wf_id), "thinker:t_end")))
        order = sorted(ends, key=lambda w: ends[w])
        # all three live turns, queued behind twelve batch ones, finish their thinker among the first six
        assert max(order.index(w) for w in live) < 6, [("live" if w in live else "batch") for w in order]


async def test_a_running_batch_session_gives_way_to_a_live_one_at_a_chunk_boundary(engine_factory) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.05})
    spec["stages"]["thinker"].update(max_sessions=1, prefetch=1)
    async with engine_factory(spec) as eng:
        batch = (await eng.store.submit(request("a long batch line"), priority=Priority.BATCH)).id
        await eventually(lambda: _emitted(eng, batch, 1))          # it holds the one thinker slot, mid-stream
        live = (await eng.store.submit(request("live"), priority=Priority.INTERACTIVE)).id
        for wf_id in (live, batch):
            assert (await eng.store.wait(wf_id, timeout_s=30))["state"] == "completed"
        ends = [int(s(await eng.redis.hget(eng.store.keys.stages(w), "thinker:t_end"))) for w in (live, batch)]
        assert ends[0] < ends[1]            # the live turn did not wait for the batch line to end
        assert eng.workers["thinker"][0].pools[eng.pipeline.queue("thinker")].slots.yields >= 1


async def _emitted(eng, wf_id: str, n: int) -> bool:
    return int(await eng.redis.hget(eng.store.keys.stages(wf_id), "thinker:seq") or 0) >= n


async def test_a_priority_above_the_tenants_allowance_is_refused_and_a_default_is_lowered(engine_factory) -> None:
    async with engine_factory(workers=False, tenant_priorities="free=batch,pro=interactive") as eng:
        with pytest.raises(PriorityNotAllowed, match="above what tenant 'free' may ask for"):
            await eng.store.submit(request(priority=Priority.API), tenant="free")
        sub = await eng.store.submit(request(), tenant="free", priority=Priority.INTERACTIVE)
        assert (await eng.store.document(sub.id))["priority"] == "batch"
        sub = await eng.store.submit(request(priority=Priority.INTERACTIVE), tenant="pro")
        assert (await eng.store.document(sub.id))["priority"] == "interactive"


async def test_batch_requests_fill_only_their_share_of_max_in_flight(engine_factory) -> None:
    async with engine_factory(workers=False, max_in_flight=10, admission_share_batch=0.5, fair_share=False) as eng:
        for _ in range(5):
            await eng.store.submit(request(), priority=Priority.BATCH)
        with pytest.raises(AdmissionRefused, match="batch requests may fill 5 of it"):
            await eng.store.submit(request(), priority=Priority.BATCH)
        for _ in range(5):                          # the headroom is live traffic's
            await eng.store.submit(request(), priority=Priority.API)
        with pytest.raises(AdmissionRefused):
            await eng.store.submit(request(), priority=Priority.INTERACTIVE)


async def test_a_tenant_over_its_fair_share_gets_429_and_another_tenant_gets_in(engine_factory) -> None:
    async with engine_factory(workers=False, max_in_flight=10, fair_share_from=0.5) as eng:
        store = eng.store
        await store.abort((await store.submit(request(), tenant="other")).id)     # "other" was here lately
        await store.fair.refresh()
        assert store.fair.share("flood") == 5
        flood = [(await store.submit(request(), tenant="flood")).id for _ in range(5)]
        with pytest.raises(FairShareRefused, match="tenant 'flood' is over its fair share: it holds 5 live "
                                                   "workflow.s. and may hold 5 of max_in_flight 10"):
            await store.submit(request(), tenant="flood")
        for _ in range(5):                                          # the other half is the other's
            await store.submit(request(), tenant="other")
        with pytest.raises(AdmissionRefused):
            await store.submit(request(), tenant="other")           # the deployment is full
        counts = await eng.redis.hgetall(store.keys.tenant_inflight(0))
        assert {s(k): int(v) for k, v in counts.items()} == {"flood": 5, "other": 5}
        # the flood's queue holds: none of its admitted workflows was touched
        for wf_id in flood:
            assert (await store.document(wf_id))["state"] == "pending"


async def test_a_refused_submit_leaves_the_tenants_count_as_it_found_it(engine_factory, monkeypatch) -> None:
    """submit.lua counts the tenant first where a refusal needs it to hold one already, and takes the
    count back when it refuses; where a refusal at 0 is possible (no share or cap left from other
    cells) it reads first: an absent count stays absent (a field at 0 says "this tenant used the cell")."""
    async with engine_factory(workers=False, max_in_flight=10, fair_share_from=0.5, fair_hold_ms=0) as eng:
        store, tinf = eng.store, eng.store.keys.tenant_inflight(0)
        monkeypatch.setattr(store.fair, "submit_args", lambda tenant, cell: [1, 0, 100])
        await store.submit(request(), tenant="one")
        with pytest.raises(FairShareRefused, match="it holds 1 live"):
            await store.submit(request(), tenant="one")                 # counted, then taken back
        monkeypatch.setattr(store.fair, "submit_args", lambda tenant, cell: [0, 0, 100])
        with pytest.raises(FairShareRefused, match="it holds 0 live"):
            await store.submit(request(), tenant="none")                # read first: never counted
        monkeypatch.setattr(store.fair, "submit_args", lambda tenant, cell: [5, 0, 0])
        with pytest.raises(FairShareRefused, match="it holds 0 live"):
            await store.submit(request(), tenant="two")                 # no cap left, another tenant here
        counts = await eng.redis.hgetall(tinf)
        assert {s(k): int(v) for k, v in counts.items()} == {"one": 1}


async def test_a_tenant_alone_fills_all_but_the_reserve_and_a_newcomer_gets_in_at_once(engine_factory) -> None:
    async with engine_factory(workers=False, max_in_flight=10, fair_share_from=0.5) as eng:
        store = eng.store
        await store.abort((await store.submit(request(), tenant="other")).id)
        await eng.redis.hset(store.keys.tenant_seen(0), "other", 0)        # ... long ago: the flood is alone
        await store.fair.refresh()
        flood = [(await store.submit(request(), tenant="flood")).id for _ in range(9)]
        with pytest.raises(FairShareRefused, match="it holds 9"):
            await store.submit(request(), tenant="flood")           # the last 10 % is no single tenant's
        await store.submit(request(), tenant="other")               # a newcomer is admitted at once
        for wf_id in flood[:4]:                                     # four of the flood's end
            await store.abort(wf_id)
        await store.fair.refresh()
        assert store.fair.share("flood") == 5 and store.fair.share("other") == 5
        with pytest.raises(FairShareRefused, match="may hold 5"):
            await store.submit(request(), tenant="flood")           # 5 live: its share now that "other" is here
        for _ in range(4):
            await store.submit(request(), tenant="other")
        counts = await eng.redis.hgetall(store.keys.tenant_inflight(0))
        assert {s(k): int(v) for k, v in counts.items()} == {"flood": 5, "other": 5}


async def test_tenant_weights_change_live_and_bad_weights_are_refused(engine_factory) -> None:
    async with engine_factory(workers=False, max_in_flight=12, tenant_weights="gold=2") as eng:
        store = eng.store
        await store.submit(request(), tenant="gold")
        await store.submit(request(), tenant="free")
        await store.fair.refresh()
        assert store.fair.share("gold") == 8 and store.fair.share("free") == 4
        await set_weight(eng.redis, store.keys, "free", 4)
        await store.fair.refresh()
        assert store.fair.share("gold") == 4 and store.fair.share("free") == 8
        rows = {r["tenant"]: r for r in await weights_table(eng.redis, eng.settings, store.keys)}
        assert rows["free"]["source"] == "live" and rows["gold"]["source"] == "config" and rows["gold"]["live"] == 1
        with pytest.raises(ValueError, match="out of range"):
            await set_weight(eng.redis, store.keys, "free", 0)
        with pytest.raises(ValueError, match="bad tenant name"):
            await set_weight(eng.redis, store.keys, "a,b", 1)
        await set_weight(eng.redis, store.keys, "free", None)
        await eventually(lambda: _weight_of(eng, "free", 1.0))


async def _weight_of(eng, tenant: str, weight: float) -> bool:
    await eng.store.fair.refresh()
    return eng.store.fair.weights.get(tenant, 1.0) == weight


async def test_a_tenant_just_refused_over_its_share_is_refused_again_without_a_round_trip(engine_factory) -> None:
    async with engine_factory(workers=False, max_in_flight=10, fair_share_from=0.5, fair_hold_ms=10_000) as eng:
        store = eng.store
        await store.abort((await store.submit(request(), tenant="other")).id)     # "other" was here lately
        await store.fair.refresh()
        for _ in range(5):
            await store.submit(request(), tenant="flood")
        with pytest.raises(FairShareRefused, match="it holds 5 live"):
            await store.submit(request(), tenant="flood")
        calls = []
        real = store._submit_script

        async def counted(call):
            calls.append(call)
            return await real(call)

        store._submit_script = counted
        for _ in range(20):                 # the flood's retries: refused here, Redis never asked
            with pytest.raises(FairShareRefused, match="over its fair share") as refused:
                await store.submit(request(), tenant="flood")
            assert refused.value.retry_after_s == 1.0
        assert calls == []
        await store.submit(request(), tenant="other")               # another tenant is asked as always
        assert len(calls) == 1
        # a retry with an idempotency key asks Redis (it may name a workflow that exists)
        with pytest.raises(FairShareRefused):
            await store.submit(request(request_id="flood-retry-1"), tenant="flood")
        assert len(calls) == 2
        # a fresh view of the shares ends the hold: the flood's workflows may have ended
        await store.fair.refresh()
        with pytest.raises(FairShareRefused, match="it holds 5 live"):
            await store.submit(request(), tenant="flood")
        assert len(calls) == 3
