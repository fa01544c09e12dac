"""The workflows resource over HTTP."""
from __future__ import annotations

import io
import time

import numpy as np
import soundfile as sf

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import eventually

from omniflow.storage.schema import now_ms

SLOW = toy_spec(thinker={"token_delay_s": 0.05})


async def test_submit_returns_202_with_links_and_completes(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        r = await http.post("/v1/workflows", json={"input": {"text": "hello there"}})
        assert r.status_code == 202, r.text
        body = r.json()
        assert body["state"] == "pending" and body["links"]["self"] == f"/v1/workflows/{body['id']}"
        assert r.headers["location"] == body["links"]["self"]
        doc = (await http.get(body["links"]["self"], params={"wait": 10})).json()
        assert doc["state"] == "completed"
        assert doc["outputs"]["thinker"]["text"].startswith("You said: hello there")
        assert doc["outputs"]["code2wav"]["type"] == "audio" and doc["outputs"]["code2wav"]["duration_s"] > 0


async def test_submit_with_wait_answers_with_the_document_once_terminal(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        r = await http.post("/v1/workflows", params={"wait": 10}, json={"input": {"text": "wait for me"}})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["state"] == "completed" and r.headers["location"] == f"/v1/workflows/{doc['id']}"
        assert doc["outputs"]["thinker"]["text"].startswith("You said: wait for me")
        assert (await http.get(r.headers["location"])).json() == doc
        r = await http.post("/v1/workflows", params={"wait": 61}, json={"input": {"text": "x"}})
        assert r.status_code == 422


async def test_submit_with_wait_gives_the_current_document_when_the_wait_ends_first(api_factory):
    async with api_factory(SLOW) as (_engine, server), server.client() as http:
        r = await http.post("/v1/workflows", params={"wait": 0.05}, json={"input": {"text": "slow " * 20}})
        assert r.status_code == 200 and r.json()["state"] in ("pending", "running")


async def test_bad_input_is_422_with_field_messages(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        r = await http.post("/v1/workflows", json={"input": {}})
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["code"] == "invalid_request"
        assert any(f["loc"] == "body.input.text" for f in err["fields"])
        r = await http.post("/v1/workflows", json={"input": {"text": "x"}, "output_modalities": ["video"]})
        assert r.status_code == 422 and "video" in r.json()["error"]["message"]
        r = await http.post("/v1/workflows", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 422


async def test_idempotent_request_id_returns_same_workflow(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        body = {"input": {"text": "once"}, "request_id": "req-1"}
        first = await http.post("/v1/workflows", json=body)
        second = await http.post("/v1/workflows", json=body)
        assert first.status_code == 202 and second.status_code == 200
        assert second.json()["id"] == first.json()["id"] and second.json()["existing"] is True


async def test_resubmitting_aborted_request_id_is_409_retired(api_factory):
    async with api_factory(SLOW) as (_engine, server), server.client() as http:
        body = {"input": {"text": "abort me"}, "request_id": "req-retired"}
        wf_id = (await http.post("/v1/workflows", json=body)).json()["id"]
        r = await http.post(f"/v1/workflows/{wf_id}/abort")
        assert r.status_code == 200 and r.json() == {"id": wf_id, "state": "aborted"}
        r = await http.post("/v1/workflows", json=body)
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "retired" and "retired" in r.json()["error"]["message"]


async def test_over_admission_is_429_with_retry_after(api_factory):
    async with api_factory(workers=False, engine_settings={"max_in_flight": 1}) as (_engine, server), \
            server.client() as http:
        assert (await http.post("/v1/workflows", json={"input": {"text": "one"}})).status_code == 202
        r = await http.post("/v1/workflows", json={"input": {"text": "two"}})
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "over_capacity" and int(r.headers["retry-after"]) >= 1


async def test_long_poll_wakes_up_on_completion(api_factory):
    async with api_factory(SLOW) as (_engine, server), server.client() as http:
        wf_id = (await http.post("/v1/workflows", json={"input": {"text": "wait for me"}})).json()["id"]
        started = time.monotonic()
        doc = (await http.get(f"/v1/workflows/{wf_id}", params={"wait": 20})).json()
        took = time.monotonic() - started
        assert doc["state"] == "completed"
        assert 0.2 < took < 5        # 8 words x 50 ms: it waited, and woke at completion, not at the timeout
        # a long-poll that times out returns the live document
        slow = toy_spec(thinker={"token_delay_s": 1.0})["stages"]["thinker"]["params"]
        wf2 = (await http.post("/v1/workflows", json={"input": {"text": "slow"},
                                                      "stage_params": {"thinker": slow}})).json()["id"]
        started = time.monotonic()
        doc = (await http.get(f"/v1/workflows/{wf2}", params={"wait": 0.3})).json()
        assert doc["state"] in ("pending", "running") and 0.25 < time.monotonic() - started < 3
        await http.post(f"/v1/workflows/{wf2}/abort")


async def test_list_filters_by_state_and_paginates(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        ids = []
        for i in range(5):      # distinct submit ms: newest first is a stable order only then
            ids.append((await http.post("/v1/workflows", json={"input": {"text": f"n {i}"}})).json()["id"])
            submitted_ms = now_ms()
            await eventually(lambda: now_ms() > submitted_ms, timeout_s=10, interval_s=0.001, what="the clock to tick")
        for wf_id in ids:
            await http.get(f"/v1/workflows/{wf_id}", params={"wait": 10})
        page1 = (await http.get("/v1/workflows", params={"limit": 3, "state": "completed"})).json()
        assert [x["id"] for x in page1["items"]] == ids[::-1][:3]
        page2 = (await http.get("/v1/workflows", params={"limit": 3, "offset": page1["next_offset"],
                                                          "state": "completed"})).json()
        assert [x["id"] for x in page2["items"]] == ids[::-1][3:] and page2["next_offset"] is None
        assert (await http.get("/v1/workflows", params={"state": "failed"})).json()["items"] == []
        assert (await http.get("/v1/workflows", params={"state": "bogus"})).status_code == 422


async def test_audio_download_formats(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        wf_id = (await http.post("/v1/workflows", json={"input": {"text": "sing"}})).json()["id"]
        doc = (await http.get(f"/v1/workflows/{wf_id}", params={"wait": 10})).json()
        expected = doc["outputs"]["code2wav"]["duration_s"]
        for fmt, ctype in (("wav", "audio/wav"), ("flac", "audio/flac"), ("ogg", "audio/ogg")):
            r = await http.get(f"/v1/workflows/{wf_id}/audio", params={"format": fmt})
            assert r.status_code == 200 and r.headers["content-type"] == ctype
            assert int(r.headers["content-length"]) == len(r.content)
            data, rate = sf.read(io.BytesIO(r.content))
            assert rate == 22050 and abs(len(data) / rate - expected) < 0.05 and np.abs(data).max() > 0.05
        r = await http.get(f"/v1/workflows/{wf_id}/audio", params={"format": "pcm16"})
        assert len(r.content) == round(expected * 22050) * 2


async def test_audio_is_409_while_running_and_404_without_audio(api_factory):
    async with api_factory(SLOW) as (_engine, server), server.client() as http:
        wf_id = (await http.post("/v1/workflows", json={"input": {"text": "not yet"}})).json()["id"]
        r = await http.get(f"/v1/workflows/{wf_id}/audio")
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_ready"
        text_only = (await http.post("/v1/workflows", json={"input": {"text": "words"},
                                                            "output_modalities": ["text"]})).json()["id"]
        await http.get(f"/v1/workflows/{text_only}", params={"wait": 10})
        r = await http.get(f"/v1/workflows/{text_only}/audio")
        assert r.status_code == 404 and r.json()["error"]["code"] == "no_audio"      # as docs/api.md says
        r = await http.get("/v1/workflows/nope/audio")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        await http.get(f"/v1/workflows/{wf_id}", params={"wait": 10})


async def test_abort_of_unknown_workflow_is_404(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        r = await http.post("/v1/workflows/does-not-exist/abort")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_request_id_reused_with_a_different_body_is_409_idempotency_conflict(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        body = {"input": {"text": "the first"}, "request_id": "req-conflict", "stage_params": {"thinker": {"a": 1, "b": 2}}}
        first = await http.post("/v1/workflows", json=body)
        same = await http.post("/v1/workflows", json={**body, "stage_params": {"thinker": {"b": 2, "a": 1}}})
        assert first.status_code == 202 and same.status_code == 200 and same.json()["id"] == first.json()["id"]
        r = await http.post("/v1/workflows", json={**body, "input": {"text": "another"}})
        assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_conflict"
        assert first.json()["id"] in r.json()["error"]["message"]
        r = await http.post("/v1/workflows", json={**body, "deadline_s": 30})
        assert r.status_code == 409 and r.json()["error"]["code"] == "idempotency_conflict"


async def test_idempotency_key_header_is_the_request_id(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        body = {"input": {"text": "by header"}}
        first = await http.post("/v1/workflows", json=body, headers={"Idempotency-Key": "hdr-1"})
        again = await http.post("/v1/workflows", json={**body, "request_id": "hdr-1"})
        assert first.status_code == 202 and again.status_code == 200 and again.json()["id"] == first.json()["id"]
        doc = (await http.get(f"/v1/workflows/{first.json()['id']}")).json()
        assert doc["request_id"] == "hdr-1"
        r = await http.post("/v1/workflows", json={**body, "request_id": "other"}, headers={"Idempotency-Key": "hdr-1"})
        assert r.status_code == 422 and "Idempotency-Key" in r.json()["error"]["message"]
        r = await http.post("/v1/workflows", json=body, headers={"Idempotency-Key": "bad key/x"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"


async def test_whitespace_only_prompt_is_refused_at_submit(api_factory):
    async with api_factory() as (engine, server), server.client() as http:
        r = await http.post("/v1/workflows", json={"input": {"text": " \n\t "}})
        assert r.status_code == 422 and r.json()["error"]["fields"][0]["loc"] == "body.input.text"
        assert await engine.redis.zcard(engine.store.keys.all_wf(0)) == 0           # nothing was created


async def test_a_webhook_url_that_can_never_be_delivered_is_refused_at_submit(api_factory):
    async with api_factory() as (engine, server), server.client() as http:
        for url in ("http://127.0.0.1:9/hook", "http://169.254.169.254/latest", "http://[::1]/x",
                    "http://localhost/x", "ftp://example.com/x", "http://user:pw@example.com/x"):
            r = await http.post("/v1/workflows", json={"input": {"text": "x"}, "webhook_url": url})
            assert r.status_code == 422 and "webhook_url" in r.json()["error"]["message"], url
        assert await engine.redis.zcard(engine.store.keys.all_wf(0)) == 0
        r = await http.post("/v1/workflows", json={"input": {"text": "x"}, "webhook_url": "https://hooks.example.com/x"})
        assert r.status_code == 202              # a name is resolved (and checked again) at delivery time
        doc = (await http.get(r.json()["links"]["self"])).json()
        assert doc["webhook"] == {"url": "https://hooks.example.com/x", "outcome": "pending", "attempts": [],
                                  "next_attempt_at": None}


async def test_document_has_every_field_with_nulls(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        wf_id = (await http.post("/v1/workflows", json={"input": {"text": "fields"}})).json()["id"]
        doc = (await http.get(f"/v1/workflows/{wf_id}", params={"wait": 10})).json()
        assert doc["webhook"] is None and doc["error"] is None and doc["error_stage"] is None
        assert all({"usage", "error", "submitted_at", "started_at", "finished_at"} <= set(st)
                   for st in doc["stages"].values())
        assert doc["stages"]["thinker"]["error"] is None


async def test_list_filters_by_stage_tenant_age_and_request_id(api_factory):
    async with api_factory(workers=False) as (_engine, server), server.client() as http:
        text = (await http.post("/v1/workflows", json={"input": {"text": "t"}, "output_modalities": ["text"],
                                                      "request_id": "shop-order-17"})).json()["id"]
        both = (await http.post("/v1/workflows", json={"input": {"text": "b"}, "request_id": "shop-order-18"})).json()["id"]
        r = (await http.get("/v1/workflows", params={"stage": "code2wav"})).json()
        assert [x["id"] for x in r["items"]] == [both] and r["items"][0]["stages"] == ["thinker", "talker", "code2wav"]
        r = (await http.get("/v1/workflows", params={"request_id": "order-1"})).json()
        assert {x["id"] for x in r["items"]} == {text, both} and r["total"] is None and r["scanned"] == 2
        r = (await http.get("/v1/workflows", params={"request_id": "-17"})).json()
        assert [x["id"] for x in r["items"]] == [text]
        r = (await http.get("/v1/workflows", params={"since_s": 3600, "tenant": "default"})).json()
        # the tenant `default` has no index of its own: `all` is walked, the tenant checked on the records
        assert len(r["items"]) == 2 and r["total"] is None and r["scanned"] == 2
        assert (await http.get("/v1/workflows", params={"tenant": "other"})).json()["items"] == []
        assert (await http.get("/v1/workflows", params={"stage": "Bad!"})).status_code == 422
        assert (await http.get("/v1/workflows", params={"since_s": 0})).status_code == 422


async def test_webhook_body_is_the_same_json_as_get_nulls_included(api_factory):
    from jobs_support import FAST, SECRET, http_receiver, jobs_runner
    from standardwebhooks import Webhook

    from helpers import eventually

    with http_receiver() as rec:
        async with api_factory(toy_spec(thinker={"fail_at_step": 1, "fail_retryable": False}),
                               engine_settings=FAST) as (engine, server), jobs_runner(engine), \
                server.client() as http:
            wf_id = (await http.post("/v1/workflows", json={"input": {"text": "hook"},
                                                            "webhook_url": rec.url()})).json()["id"]
            await eventually(lambda: _delivered(http, wf_id), timeout_s=15)
            body = Webhook(SECRET).verify(rec.hits[0].body, rec.hits[0].headers)
            got = (await http.get(f"/v1/workflows/{wf_id}")).json()
        assert body["state"] == "failed" and body["stages"]["talker"]["usage"] is None    # nulls are sent
        assert {k: v for k, v in body.items() if k != "webhook"} == {k: v for k, v in got.items() if k != "webhook"}
        assert body["webhook"]["attempts"] == [] and got["webhook"]["attempts"][0]["outcome"] == "delivered"


async def _delivered(http, wf_id: str) -> bool:
    hook = (await http.get(f"/v1/workflows/{wf_id}")).json()["webhook"]
    return hook["outcome"] == "delivered"
