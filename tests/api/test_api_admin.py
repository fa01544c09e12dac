"""The operator's routes over real HTTP: pools (JSON and SSE), workers, drain, timeline, retry, /ui."""
from __future__ import annotations

import json

from apiserver import ADMIN_KEY, KEYS, api_factory, auth_settings  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import eventually


async def test_admin_routes_need_an_admin_key(api_factory):
    async with api_factory(**auth_settings()) as (_engine, server), server.client() as anon, \
            server.client(KEYS["alice"]) as alice, server.client(ADMIN_KEY) as admin:
        for path in ("/v1/admin/pools", "/v1/admin/workers", "/v1/admin/pools/events?count=1"):
            assert (await anon.get(path)).status_code == 401, path
            r = await alice.get(path)
            assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", path
        assert (await alice.post("/v1/admin/workers/w1/drain")).status_code == 403
        assert (await admin.get("/v1/admin/pools")).status_code == 200
        # the page itself holds no data: it loads without a key and asks for one
        page = await anon.get("/ui")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for asset, kind in (("app.js", "text/javascript"), ("app.css", "text/css")):
            r = await anon.get(f"/ui/{asset}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and len(r.content) > 1000
        assert (await anon.get("/ui/secrets.txt")).status_code == 404


async def test_pools_snapshot_counts_workers_sessions_and_the_last_minute(api_factory):
    async with api_factory() as (engine, server), server.client() as http:
        for i in range(3):
            wf = (await http.post("/v1/workflows", json={"input": {"text": f"pool {i}"}})).json()["id"]
            await http.get(f"/v1/workflows/{wf}", params={"wait": 10})
        # the workers publish their last minute with the next heartbeat
        pools = await eventually(lambda: _pools_with_done(http, 3), timeout_s=10)
        assert pools["workflows"]["completed"] == 3 and pools["in_flight"] == 0
        assert pools["max_in_flight"] == engine.settings.max_in_flight
        for name in ("thinker", "talker", "code2wav"):
            st = pools["stages"][name]
            assert st["live_workers"] == 1 and st["capacity"] > 0 and st["active_sessions"] == 0
            assert st["last_minute"]["done"] == 3 and st["last_minute"]["p50_s"] is not None
            assert st["last_minute"]["p50_s"] <= st["last_minute"]["p99_s"]
        assert {w["stages"][0] for w in pools["workers"]} == {"thinker", "talker", "code2wav"}
        assert all(w["alive"] and not w["draining"] and w["heartbeat_age_s"] < 5 for w in pools["workers"])


async def _pools_with_done(http, n: int) -> dict | None:
    pools = (await http.get("/v1/admin/pools")).json()
    return pools if all(st["last_minute"]["done"] >= n for st in pools["stages"].values()) else None


async def test_pools_events_stream_snapshots(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        async with http.stream("GET", "/v1/admin/pools/events", params={"interval": 0.5, "count": 2}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            body = "".join([chunk async for chunk in r.aiter_text()])
        events = [block for block in body.split("\n\n") if block.startswith("event: pools")]
        assert len(events) == 2
        snapshot = json.loads(events[0].split("data: ", 1)[1])
        assert set(snapshot["stages"]) == {"thinker", "talker", "code2wav"}


async def test_drain_stops_claiming_and_undrain_resumes(api_factory):
    async with api_factory() as (engine, server), server.client() as http:
        thinker = engine.workers["thinker"][0]
        r = await http.post(f"/v1/admin/workers/{thinker.id}/drain")
        assert r.status_code == 200 and r.json()["draining"] is True
        await eventually(lambda: _true(thinker.draining))
        wf = (await http.post("/v1/workflows", json={"input": {"text": "held back"}})).json()["id"]
        doc = (await http.get(f"/v1/workflows/{wf}", params={"wait": 1.5})).json()
        assert doc["stages"]["thinker"]["status"] == "pending"          # nobody claimed it
        pools = (await http.get("/v1/admin/pools")).json()
        assert pools["stages"]["thinker"]["draining_workers"] == 1 and pools["stages"]["thinker"]["lag"] == 1
        ready = await http.get("/readyz")       # its only worker drained: nothing takes new thinker work
        assert ready.status_code == 503 and ready.json()["missing"] == ["thinker"], ready.json()
        r = await http.post(f"/v1/admin/workers/{thinker.id}/undrain")
        assert r.status_code == 200 and r.json()["draining"] is False
        assert (await http.get("/readyz")).status_code == 200
        assert (await http.get(f"/v1/workflows/{wf}", params={"wait": 10})).json()["state"] == "completed"
        r = await http.post("/v1/admin/workers/no-such-worker/drain")
        assert r.status_code == 422 and "no live worker" in r.json()["error"]["message"]


async def _true(value: bool) -> bool:
    return value


async def test_timeline_lanes_show_attempts_replicas_ticks_and_retries(api_factory):
    spec = toy_spec(thinker={"fail_at_step": 3, "fail_attempts": 1})
    async with api_factory(spec) as (engine, server), server.client() as http:
        wf = (await http.post("/v1/workflows", json={"input": {"text": "retry once"}})).json()["id"]
        doc = (await http.get(f"/v1/workflows/{wf}", params={"wait": 10})).json()
        assert doc["state"] == "completed"
        tl = (await http.get(f"/v1/workflows/{wf}/timeline")).json()
        lanes = {lane["stage"]: lane for lane in tl["lanes"]}
        assert list(lanes) == ["thinker", "talker", "code2wav"]
        thinker = lanes["thinker"]
        assert [a["attempt"] for a in thinker["attempts"]] == [1, 2]
        assert [a["outcome"] for a in thinker["attempts"]] == ["failed", "done"]      # then retried (the mark)
        assert all(a["replica"] == engine.workers["thinker"][0].id for a in thinker["attempts"])
        assert [r["attempt"] for r in thinker["retries"]] == [2] and "injected failure" in thinker["retries"][0]["reason"]
        steps = [n for t in thinker["ticks"] for n in range(t["first"], t["seq"] + 1)]      # a tick per write
        assert sorted(set(steps)) == list(range(1, 9)) and {t["kind"] for t in thinker["ticks"]} == {"text"}
        assert all(t["kind"] == "audio" for t in lanes["code2wav"]["ticks"]) and lanes["code2wav"]["ticks"]
        talker = lanes["talker"]["attempts"][0]
        assert talker["start"] <= talker["running"] <= talker["end"] <= tl["duration_ms"]
        assert tl["events"][-1]["event"] == "terminal" and tl["events"][-1]["state"] == "completed"
        assert (await http.get("/v1/workflows/nope/timeline")).status_code == 404


async def test_retry_route_resubmits_a_failed_workflow_for_its_tenant_only(api_factory):
    spec = toy_spec(thinker={"fail_at_step": 1, "fail_retryable": False})
    async with api_factory(spec, **auth_settings()) as (_engine, server), \
            server.client(KEYS["alice"]) as alice, server.client(KEYS["bob"]) as bob:
        wf = (await alice.post("/v1/workflows", json={"input": {"text": "doomed"}})).json()["id"]
        assert (await alice.get(f"/v1/workflows/{wf}", params={"wait": 10})).json()["state"] == "failed"
        assert (await bob.post(f"/v1/workflows/{wf}/retry")).status_code == 404
        r = await alice.post(f"/v1/workflows/{wf}/retry")
        assert r.status_code == 202 and r.json()["id"] != wf
        new = (await alice.get(f"/v1/workflows/{r.json()['id']}")).json()
        assert new["tenant"] == "alice"
        r = await alice.post(f"/v1/workflows/{r.json()['id']}/retry")        # not failed (yet): refused
        assert r.status_code in (422, 202) and (r.status_code == 202 or r.json()["error"]["code"] == "invalid_request")
