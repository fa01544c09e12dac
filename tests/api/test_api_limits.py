"""Auth, tenants and limits."""
from __future__ import annotations

from apiserver import ADMIN_KEY, KEYS, api_factory, auth_settings  # noqa: F401 - fixture
from conftest import toy_spec


async def test_auth_requires_a_known_key(api_factory):
    async with api_factory(**auth_settings()) as (_engine, server):
        async with server.client() as anon, server.client("nope") as wrong:
            for http in (anon, wrong):
                r = await http.get("/v1/workflows")
                assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
                assert r.headers["www-authenticate"] == "Bearer"
            assert (await anon.get("/healthz")).status_code == 200


async def test_tenants_see_only_their_own_workflows(api_factory):
    spec = toy_spec(thinker={"token_delay_s": 0.05})
    async with api_factory(spec, **auth_settings()) as (_engine, server), \
            server.client(KEYS["alice"]) as alice, server.client(KEYS["bob"]) as bob, \
            server.client(ADMIN_KEY) as admin:
        mine = (await alice.post("/v1/workflows", json={"input": {"text": "private"}, "request_id": "same"})).json()
        theirs = (await bob.post("/v1/workflows", json={"input": {"text": "other"}, "request_id": "same"})).json()
        assert mine["id"] != theirs["id"]       # idempotency keys are per tenant
        wf = mine["id"]
        for path in (f"/v1/workflows/{wf}", f"/v1/workflows/{wf}/events", f"/v1/workflows/{wf}/audio"):
            r = await bob.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
        assert (await bob.post(f"/v1/workflows/{wf}/abort")).status_code == 404
        assert [x["id"] for x in (await bob.get("/v1/workflows")).json()["items"]] == [theirs["id"]]
        assert {x["id"] for x in (await admin.get("/v1/workflows")).json()["items"]} == {wf, theirs["id"]}
        doc = (await admin.get(f"/v1/workflows/{wf}", params={"wait": 10})).json()
        assert doc["tenant"] == "alice" and doc["state"] == "completed"
        assert (await alice.get(f"/v1/workflows/{wf}")).status_code == 200
        assert (await admin.post(f"/v1/workflows/{theirs['id']}/abort")).status_code == 200


async def test_body_size_limit_is_413(api_factory):
    async with api_factory(max_body_bytes=2048) as (_engine, server), server.client() as http:
        r = await http.post("/v1/workflows", json={"input": {"text": "x" * 4000}})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

        async def chunks():                       # no Content-Length: counted while read
            for _ in range(10):
                yield b"x" * 1000
        r = await http.post("/v1/workflows", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413


async def test_prompt_length_and_deadline_limits_are_422(api_factory):
    async with api_factory(engine_settings={"max_prompt_chars": 10, "max_deadline_s": 30}) as (_engine, server), \
            server.client() as http:
        r = await http.post("/v1/workflows", json={"input": {"text": "far too long a prompt"}})
        assert r.status_code == 422 and "input.text" in r.json()["error"]["message"]
        r = await http.post("/v1/workflows", json={"input": {"text": "short"}, "deadline_s": 31})
        assert r.status_code == 422 and "deadline_s" in r.json()["error"]["message"]
        r = await http.post("/v1/workflows", json={"input": {"text": "short"}, "deadline_s": 30})
        assert r.status_code == 202


async def test_submit_rate_per_tenant_is_429_with_retry_after(api_factory):
    async with api_factory(**auth_settings(submit_rate_per_s=2.0)) as (_engine, server), \
            server.client(KEYS["alice"]) as alice, server.client(KEYS["bob"]) as bob:
        codes = [(await alice.post("/v1/workflows", json={"input": {"text": f"r{i}"}})).status_code for i in range(3)]
        assert codes == [202, 202, 429]
        r = await alice.post("/v1/workflows", json={"input": {"text": "again"}})
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert int(r.headers["retry-after"]) >= 1
        assert (await bob.post("/v1/workflows", json={"input": {"text": "bob"}})).status_code == 202
