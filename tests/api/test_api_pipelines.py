"""Several pipelines behind one API: `/v1/models` lists them with their modalities, `model` (OpenAI
routes) and `pipeline` (`POST /v1/workflows`) pick one, an unknown one is a 404 in OpenAI's error
shape naming the known ones, and a pipeline a new worker registers is served without a restart."""
from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from apiserver import ApiServer
from conftest import Engine, toy_spec
from helpers import eventually

from omniflow.catalog import Catalog
from omniflow.config import Settings
from omniflow.engine.worker import Worker
from omniflow.pipeline import build_pipeline


def omni_spec() -> dict[str, Any]:
    spec = toy_spec()
    spec["name"] = "omni-t"
    return spec


def tts_spec() -> dict[str, Any]:
    omni = omni_spec()
    return {"name": "tts-t", "stages": {"talker": copy.deepcopy(omni["stages"]["talker"]),
                                       "code2wav": copy.deepcopy(omni["stages"]["code2wav"])},
            "edges": [{"from": "talker", "to": "code2wav", "mode": "chunk"}]}


def echo_spec() -> dict[str, Any]:
    return {"name": "echo-t", "stages": {"echo": {"executor": "omniflow.workers.toy:Echo", "final_output": "text"}}}


@pytest.fixture
async def served(valkey_url: str, settings_factory: Callable[..., Settings]) -> AsyncIterator[tuple[Engine, ApiServer]]:
    """The API and one worker process serving omni-t and tts-t (its identical stages: one pool)."""
    catalog = Catalog.of([build_pipeline(omni_spec()), build_pipeline(tts_spec())])
    engine = Engine(valkey_url, settings_factory(valkey_url), catalog)  # type: ignore[arg-type]
    await engine.add_reconciler()
    await engine.add_worker("all")
    server = ApiServer(engine).start()
    try:
        yield engine, server
    finally:
        server.stop()
        for stop, _task in engine._tasks:
            stop.set()
        keys = [k async for k in engine.redis.scan_iter(match=f"{engine.settings.prefix}:*")]
        if keys:
            await engine.redis.delete(*keys)
        await engine.close()


async def test_models_lists_every_pipeline_with_its_modalities(served: tuple[Engine, ApiServer]) -> None:
    engine, server = served
    async with server.client() as http:
        models = (await http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["input_modalities"], m["output_modalities"]) for m in models] == [
        ("omni-t", ["text"], ["audio", "text"]), ("tts-t", ["text"], ["audio"])]
    assert models[1]["version"] == engine.store.catalog.get("tts-t").digest
    # the official client reads them as models
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")
    assert [m.id async for m in client.models.list()] == ["omni-t", "tts-t"]
    await client.close()


async def test_model_picks_the_pipeline_in_every_openai_route(served: tuple[Engine, ApiServer]) -> None:
    _engine, server = served
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")
    try:
        chat = await client.chat.completions.create(model="omni-t", messages=[{"role": "user", "content": "hi there"}])
        assert chat.choices[0].message.content.startswith("You said: hi there") and chat.model == "omni-t"
        speech = await client.audio.speech.create(model="tts-t", voice="alloy", input="speak this", response_format="wav")
        assert speech.content[:4] == b"RIFF" and len(speech.content) > 44
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        err = info.value.body
        assert isinstance(err, dict) and err["code"] == "model_not_found" and err["param"] == "model"
        assert "unknown pipeline 'gpt-4o'" in err["message"] and "'omni-t', 'tts-t'" in err["message"]
        with pytest.raises(openai.NotFoundError):
            await client.audio.speech.create(model="nope", voice="alloy", input="x")
    finally:
        await client.close()


async def test_post_workflows_takes_a_pipeline(served: tuple[Engine, ApiServer]) -> None:
    engine, server = served
    tts = engine.store.catalog.get("tts-t")
    async with server.client() as http:
        r = await http.post("/v1/workflows", json={"input": {"text": "say it"}, "pipeline": "tts-t"})
        assert r.status_code == 202, r.text
        doc = (await http.get(f"/v1/workflows/{r.json()['id']}", params={"wait": 20})).json()
        assert doc["state"] == "completed" and (doc["pipeline"], doc["pipeline_version"]) == ("tts-t", tts.digest)
        assert set(doc["outputs"]) == {"code2wav"}
        # the default pipeline when none is named
        r = await http.post("/v1/workflows", json={"input": {"text": "hello"}, "output_modalities": ["text"]})
        doc = (await http.get(f"/v1/workflows/{r.json()['id']}", params={"wait": 20})).json()
        assert doc["pipeline"] == "omni-t" and doc["state"] == "completed"
        listed = (await http.get("/v1/workflows")).json()
        assert {row["pipeline"] for row in listed["items"]} == {"omni-t", "tts-t"}
        r = await http.post("/v1/workflows", json={"input": {"text": "x"}, "pipeline": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "pipeline" and "'omni-t', 'tts-t'" in r.json()["error"]["message"]
        r = await http.post("/v1/workflows", json={"input": {"text": "x"}, "pipeline": f"tts-t@{'0' * 16}"})
        assert r.status_code == 404 and "version 0000000000000000" in r.json()["error"]["message"]
        r = await http.post("/v1/workflows", json={"input": {"text": "x"}, "pipeline": "not a name!"})
        assert r.status_code == 422 and r.json()["error"]["param"] == "pipeline"
        r = await http.post("/v1/workflows", json={"input": {"text": "x"}, "pipeline": "tts-t",
                                                   "stage_params": {"thinker": {}}})
        assert r.status_code == 422 and "stages of tts-t" in r.json()["error"]["message"]


async def test_a_pipeline_registered_later_is_served_without_a_restart(served: tuple[Engine, ApiServer]) -> None:
    engine, server = served
    async with server.client() as http:
        r = await http.post("/v1/chat/completions", json={"model": "echo-t", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404
        newcomer = Worker(settings=engine.settings, pipeline=build_pipeline(echo_spec()), stage="all",
                          redis_url=engine.url)
        await engine._spawn(lambda stop: newcomer.run(stop, grace_s=5), newcomer.started)

        async def listed() -> bool:
            return "echo-t" in [m["id"] for m in (await http.get("/v1/models")).json()["data"]]

        await eventually(listed)
        r = await http.post("/v1/chat/completions", json={"model": "echo-t",
                                                          "messages": [{"role": "user", "content": "echo me"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "echo me" and r.json()["model"] == "echo-t"
        ready = await http.get("/readyz")
        assert ready.status_code == 200, ready.text


async def test_realtime_model_unknown_is_refused_with_404(served: tuple[Engine, ApiServer]) -> None:
    _engine, server = served
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.get("/v1/realtime", params={"model": "nope"},
                           headers={"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert "'omni-t', 'tts-t'" in r.json()["error"]["message"]
