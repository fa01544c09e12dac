"""The listing indexes, kept by the Lua transitions, and filtered paging over them (real Valkey)."""
from __future__ import annotations

from helpers import eventually, request

from omniflow.ops import fleet
from omniflow.ops.usage import known_tenants
from omniflow.storage import listing
from omniflow.storage.listing import ListFilter
from omniflow.storage.schema import now_ms, s


async def _index(eng, state: str) -> set[str]:
    return {s(x) for x in await eng.redis.zrange(eng.store.keys.state_index(state, 0), 0, -1)}


async def test_state_index_follows_every_transition(engine_factory) -> None:
    async with engine_factory(workers=False) as eng:
        done = await eng.store.submit(request("to completion", ["text"]))
        aborted = await eng.store.submit(request("to abort"))
        # pending has no index: the pending ones are the in-flight set less the running index
        assert not await eng.redis.exists(eng.store.keys.state_index("pending", 0))
        assert (await listing.state_counts(eng.redis, eng.store.keys))["pending"] == 2
        pending = await listing.query(eng.redis, eng.store.keys, ListFilter(state="pending"))
        assert {r["id"] for r in pending.rows} == {done.id, aborted.id} and pending.total is None
        await eng.store.abort(aborted.id)
        assert await _index(eng, "aborted") == {aborted.id}
        await eng.add_worker("thinker")
        await eng.store.wait(done.id, timeout_s=10)
        assert await _index(eng, "completed") == {done.id}
        assert await _index(eng, "running") == set()
        assert await listing.state_counts(eng.redis, eng.store.keys) == {
            "pending": 0, "running": 0, "completed": 1, "failed": 0, "aborted": 1}


async def test_running_index_holds_a_claimed_workflow(engine_factory) -> None:
    from conftest import toy_spec

    async with engine_factory(toy_spec(thinker={"token_delay_s": 0.5})) as eng:
        sub = await eng.store.submit(request("slow one", ["text"]))
        await eventually(lambda: _in(eng, "running", sub.id))
        counts = await listing.state_counts(eng.redis, eng.store.keys)
        assert counts["running"] == 1 and counts["pending"] == 0
        assert (await listing.query(eng.redis, eng.store.keys, ListFilter(state="pending"))).rows == []
        await eng.store.abort(sub.id)
        assert await _index(eng, "running") == set() and await _index(eng, "aborted") == {sub.id}


async def _in(eng, state: str, wf_id: str) -> bool:
    return wf_id in await _index(eng, state)


async def test_filters_and_paging(engine_factory) -> None:
    async with engine_factory(workers=False) as eng:
        store = eng.store
        ids = []
        for i in range(12):
            sub = await store.submit(request(f"p {i}", ["text"] if i % 3 else None, request_id=f"order-{i:03d}"),
                                     tenant="acme" if i % 2 else "globex")
            ids.append(sub.id)
            # distinct creation ms (a stable newest-first order): the next one is created once the clock has moved on
            created_ms = int(s(await store.client.hget(store.keys.wf(sub.id), "created_ms")))
            await eventually(lambda: now_ms() > created_ms, interval_s=0.001, what="the clock past a creation ms")
        for wf_id in ids[:4]:
            await store.abort(wf_id)
        newest_first = ids[::-1]

        page = await store.list_workflows(ListFilter(), limit=5)
        assert [r["id"] for r in page.rows] == newest_first[:5] and page.total == 12 and page.next_offset == 5
        rest = await store.list_workflows(ListFilter(), offset=page.next_offset, limit=50)
        assert [r["id"] for r in rest.rows] == newest_first[5:] and rest.next_offset is None

        aborted = await store.list_workflows(ListFilter(state="aborted"))
        assert [r["id"] for r in aborted.rows] == ids[:4][::-1] and aborted.total == 4
        acme = await store.list_workflows(ListFilter(tenant="acme"))
        assert {r["id"] for r in acme.rows} == set(ids[1::2]) and all(r["tenant"] == "acme" for r in acme.rows)
        both = await store.list_workflows(ListFilter(state="pending", tenant="globex"))
        assert [r["id"] for r in both.rows] == [x for x in newest_first if ids.index(x) >= 4 and ids.index(x) % 2 == 0]
        assert both.total is None                   # the second filter was checked on the records
        audio = await store.list_workflows(ListFilter(stage="code2wav"))
        assert {r["id"] for r in audio.rows} == {ids[i] for i in range(12) if i % 3 == 0}
        rid = await store.list_workflows(ListFilter(request_id="der-00"))
        assert {r["request_id"] for r in rid.rows} == {f"order-{i:03d}" for i in range(10)}
        created = {r["id"]: r["created_at"] for r in page.rows + rest.rows}
        since = await store.list_workflows(ListFilter(since_ms=int(created[ids[9]] * 1000)))
        assert [r["id"] for r in since.rows] == newest_first[:3] and since.total == 3


async def test_a_rare_match_is_searched_in_bounded_steps(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        for i in range(30):
            await eng.store.submit(request(f"x {i}"), tenant="t")
        flt = ListFilter(request_id="nothing-matches")
        first = await listing.query(eng.redis, eng.store.keys, flt, limit=5, max_scan=12)
        assert first.rows == [] and first.scanned == 12 and first.next_offset == 12
        last = await listing.query(eng.redis, eng.store.keys, flt, offset=24, limit=5, max_scan=12)
        assert last.scanned == 6 and last.next_offset is None


async def test_trim_drops_old_entries_from_every_index(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        sub = await eng.store.submit(request("old"), tenant="acme")
        keys = eng.store.keys
        await listing.trim(eng.redis, keys, cutoff_ms=0)
        assert await eng.redis.zcard(keys.tenant_index("acme", 0)) == 1
        created = int(await eng.redis.zscore(keys.all_wf(0), sub.id))
        await listing.trim(eng.redis, keys, cutoff_ms=created + 1)
        # the pending index of the layout before (its submits wrote one) is emptied with the others
        legacy = keys.state_index("pending", 0)
        await eng.redis.zadd(legacy, {sub.id: created})
        await listing.trim(eng.redis, keys, cutoff_ms=created + 1)
        for key in (keys.all_wf(0), legacy, keys.tenant_index("acme", 0)):
            assert await eng.redis.zcard(key) == 0


async def test_pending_and_the_default_tenant_are_listed_from_wider_indexes(engine_factory) -> None:
    """`state=pending` walks the in-flight set (by deadline) and `tenant=default` walks `all`: both
    check the record, `since` included (the in-flight set is not scored by creation)."""
    async with engine_factory(workers=False, reconciler=False) as eng:
        store, keys = eng.store, eng.store.keys
        ids = []
        for i in range(6):
            sub = await store.submit(request(f"d {i}", deadline_s=100 + i), tenant="default" if i % 2 else "acme")
            ids.append(sub.id)
            created_ms = int(s(await store.client.hget(keys.wf(sub.id), "created_ms")))
            await eventually(lambda: now_ms() > created_ms, interval_s=0.001, what="the clock past a creation ms")
        await store.abort(ids[5])
        assert not await eng.redis.exists(keys.tenant_index("default", 0))      # the default tenant: no index,
        assert {s(x) for x in await eng.redis.smembers(keys.tenants(0))} == {"acme"}    # nothing to trim
        assert await known_tenants(store) == {"acme", "default"}                # known all the same
        assert await eng.redis.zcard(keys.tenant_index("acme", 0)) == 3
        default = await store.list_workflows(ListFilter(tenant="default"))
        assert [r["id"] for r in default.rows] == [ids[5], ids[3], ids[1]] and default.total is None
        live_default = await store.list_workflows(ListFilter(state="pending", tenant="default"))
        assert [r["id"] for r in live_default.rows] == [ids[3], ids[1]]
        pending = await store.list_workflows(ListFilter(state="pending"), limit=3)
        assert [r["id"] for r in pending.rows] == ids[4::-1][:3] and pending.next_offset is not None
        rest = await store.list_workflows(ListFilter(state="pending"), offset=pending.next_offset)
        assert [r["id"] for r in rest.rows] == ids[1::-1]
        created = int(s(await store.client.hget(keys.wf(ids[3]), "created_ms")))
        since = await store.list_workflows(ListFilter(state="pending", since_ms=created))
        assert [r["id"] for r in since.rows] == [ids[4], ids[3]]
        first = int(s(await store.client.hget(keys.wf(ids[0]), "created_ms")))
        longest = int(store.settings.max_deadline_s * 1000)
        assert await listing.oldest_pending(eng.redis, keys, 0, 5, longest_ms=longest) == first
        assert await listing.oldest_pending(eng.redis, keys, 0, 5, longest_ms=longest, max_read=0) is None
        # the newest, first by deadline: the walk reads on past it (an older one may have a later deadline)
        await store.submit(request("hurried", deadline_s=10))
        assert (await listing.state_counts(eng.redis, keys))["pending"] == 6
        assert await listing.oldest_pending(eng.redis, keys, 0, 6, longest_ms=longest) == first
        assert await fleet.stuck(store) == {"past_deadline": 0, "oldest_ms": {"pending": first, "running": None}}
