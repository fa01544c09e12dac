"""The workflows resource over HTTP."""
from __future__ import annotations

import asyncio
import io
import time

import numpy as np
import soundfile as sf

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_spec

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
        ids = [(await http.post("/v1/workflows", json={"input": {"text": f"n {i}"}})).json()["id"] for i in range(5)]
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
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert (await http.get("/v1/workflows/nope/audio")).status_code == 404
        await http.get(f"/v1/workflows/{wf_id}", params={"wait": 10})


async def test_abort_of_unknown_workflow_is_404(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        r = await http.post("/v1/workflows/does-not-exist/abort")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        await asyncio.sleep(0)
