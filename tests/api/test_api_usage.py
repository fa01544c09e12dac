"""GET /v1/usage over real HTTP: an admin key sees every tenant, a tenant's key its own only."""
from __future__ import annotations

from apiserver import ADMIN_KEY, KEYS, api_factory, auth_settings  # noqa: F401 - fixture

from omniflow.api.schemas import UsageReport


async def test_usage_per_tenant_admin_and_tenant_keys(api_factory) -> None:
    async with api_factory(**auth_settings()) as (engine, server):
        async with server.client(KEYS["alice"]) as alice, server.client(KEYS["bob"]) as bob:
            for http, text in ((alice, "from alice"), (bob, "from bob, text only")):
                body = {"input": {"text": text}} if http is alice else {"input": {"text": text},
                                                                         "output_modalities": ["text"]}
                wf_id = (await http.post("/v1/workflows", json=body)).json()["id"]
                assert (await http.get(f"/v1/workflows/{wf_id}", params={"wait": 15})).json()["state"] == "completed"

            mine = UsageReport.model_validate((await alice.get("/v1/usage")).json())
            assert mine.tenant == "alice" and {r.tenant for r in mine.rows} == {"alice"}
            assert {r.stage for r in mine.rows} == {"thinker", "talker", "code2wav"}
            assert next(r for r in mine.rows if r.stage == "code2wav").audio_s > 0
            assert (await alice.get("/v1/usage", params={"tenant": "alice", "since": "30m"})).status_code == 200
            other = await alice.get("/v1/usage", params={"tenant": "bob"})
            assert other.status_code == 403 and other.json()["error"]["code"] == "forbidden"
            assert (await alice.get("/v1/usage", params={"tenant": "nobody"})).status_code == 403

        async with server.client(ADMIN_KEY) as admin:
            every = UsageReport.model_validate((await admin.get("/v1/usage", params={"since": "2h"})).json())
            assert {(t.tenant, t.pipeline) for t in every.tenants} == {("alice", engine.pipeline.name),
                                                                         ("bob", engine.pipeline.name)}
            assert {r.stage for r in every.rows if r.tenant == "bob"} == {"thinker"}
            bobs = UsageReport.model_validate((await admin.get("/v1/usage", params={"tenant": "bob"})).json())
            assert [r.tenant for r in bobs.rows] == ["bob"] and bobs.rows[0].completion_tokens > 0
            for params, says in (({"since": "yesterday"}, "not a duration"), ({"since": "-5m"}, "positive"),
                                 ({"tenant": "nobody"}, "no tenant 'nobody'"),
                                 ({"pipeline": "omni-gpu"}, "no pipeline 'omni-gpu'")):
                r = await admin.get("/v1/usage", params=params)
                assert r.status_code == 422 and says in r.json()["error"]["message"], (params, r.text)
            assert (await admin.get("/v1/usage", params={"tenant": ""})).status_code == 422

        async with server.client() as anonymous:
            assert (await anonymous.get("/v1/usage")).status_code == 401
