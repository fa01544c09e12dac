"""Priorities and fair share over real HTTP: bad priorities, allowances, the fair-share 429, the
tenants admin routes."""
from __future__ import annotations

import json

from apiserver import ADMIN_KEY, KEYS, api_factory, auth_settings  # noqa: F401 - fixture


async def test_priority_errors_are_clear_4xx(api_factory):
    async with api_factory(workers=False, **auth_settings()) as (engine, server), server.client(KEYS["alice"]) as alice:
        r = await alice.post("/v1/workflows", json={"input": {"text": "x"}, "priority": "urgent"})
        assert r.status_code == 422 and "unknown priority 'urgent'" in r.text
        r = await alice.post("/v1/chat/completions", json={"model": engine.pipeline.name, "priority": "vip",
                                                           "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code in (400, 422) and "unknown priority 'vip'" in r.text
        r = await alice.post("/v1/workflows", json={"input": {"text": "x"}, "priority": "batch"})
        assert r.status_code == 202
        doc = (await alice.get(f"/v1/workflows/{r.json()['id']}")).json()
        assert doc["priority"] == "batch"


async def test_a_priority_over_the_allowance_is_403(api_factory):
    async with api_factory(workers=False, **auth_settings(tenant_priorities="alice=api")) as (_engine, server), \
            server.client(KEYS["alice"]) as alice, server.client(KEYS["bob"]) as bob:
        r = await alice.post("/v1/workflows", json={"input": {"text": "x"}, "priority": "interactive"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed"
        assert "above what tenant 'alice' may ask for" in r.json()["error"]["message"]
        r = await bob.post("/v1/workflows", json={"input": {"text": "x"}, "priority": "interactive"})
        assert r.status_code == 202


async def test_a_tenant_over_its_fair_share_gets_429_with_retry_after(api_factory):
    async with api_factory(workers=False, **auth_settings(max_in_flight=6, fair_share_from=0.5)) as (
            _engine, server), server.client(KEYS["alice"]) as alice, server.client(KEYS["bob"]) as bob:
        for _ in range(2):
            assert (await bob.post("/v1/workflows", json={"input": {"text": "x"}})).status_code == 202
        codes = [(await alice.post("/v1/workflows", json={"input": {"text": "x"}})) for _ in range(4)]
        # bob holds 2 of 6; once 3 are in flight the shares hold: alice may hold 3 (half)
        assert [r.status_code for r in codes] == [202, 202, 202, 429]
        refused = codes[3]
        assert refused.json()["error"]["code"] == "over_fair_share" and int(refused.headers["retry-after"]) >= 1
        assert "tenant 'alice' is over its fair share" in refused.json()["error"]["message"]


async def test_tenant_weights_are_set_over_http_by_an_admin_only(api_factory):
    async with api_factory(workers=False, **auth_settings()) as (_engine, server), \
            server.client(KEYS["alice"]) as alice, server.client(ADMIN_KEY) as admin:
        assert (await alice.put("/v1/admin/tenants/alice/weight", json={"weight": 9})).status_code == 403
        r = await admin.put("/v1/admin/tenants/alice/weight", json={"weight": 3})
        assert r.status_code == 200 and r.json()["weight"] == 3 and r.json()["source"] == "live"
        for bad in (0, -1, 1001):
            r = await admin.put("/v1/admin/tenants/alice/weight", json={"weight": bad})
            assert r.status_code == 422 and "out of range" in r.json()["error"]["message"], bad
        assert (await admin.put("/v1/admin/tenants/a,b/weight", json={"weight": 1})).status_code == 422
        rows = {r["tenant"]: r for r in (await admin.get("/v1/admin/tenants")).json()}
        assert rows["alice"]["weight"] == 3
        r = await admin.put("/v1/admin/tenants/alice/weight", json={"weight": None})
        assert r.status_code == 200 and r.json()["source"] == "default"


async def test_a_chat_completion_predicted_late_is_degraded_and_says_so(api_factory):
    from test_shedding import _backlog, _spec

    async with api_factory(_spec(on_late="degrade")) as (engine, server), server.client() as http:
        queued = await _backlog(engine, 4)
        body = {"model": engine.pipeline.name, "modalities": ["text", "audio"], "deadline_s": 1.0,
                "messages": [{"role": "user", "content": "quick"}]}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["degraded"]["dropped"] == ["audio"] and "runs without audio" in reply["degraded"]["reason"]
        assert reply["choices"][0]["message"]["content"] and reply["choices"][0]["message"].get("audio") is None
        # (a streamed chat is interactive by default and passes the api backlog: ask for api here)
        async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "priority": "api"}) as streamed:
            first = next(line for line in [x async for x in streamed.aiter_lines()] if line.startswith("data: {"))
        assert json.loads(first[6:])["degraded"]["dropped"] == ["audio"]
        for wf_id in queued:
            await engine.store.abort(wf_id)
