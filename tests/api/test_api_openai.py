"""The OpenAI-compatible API, driven by the official `openai` client."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from openai import AsyncOpenAI

from apiserver import KEYS, api_factory, auth_settings  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import eventually

MODEL = "omni-toy"


def client(server, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)


async def test_openai_models_lists_the_pipeline(api_factory):
    async with api_factory() as (_engine, server):
        async with client(server) as oai:
            models = await oai.models.list()
        assert [m.id for m in models.data] == [MODEL]


async def test_openai_chat_non_stream_text_and_audio(api_factory):
    async with api_factory() as (_engine, server):
        async with client(server) as oai:
            reply = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hello audio"}],
                modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
            text_only = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": [{"type": "text", "text": "just text"}]}])
        message = reply.choices[0].message
        assert message.content.startswith("You said: hello audio")
        assert message.audio is not None and message.audio.transcript == message.content
        data, rate = sf.read(io.BytesIO(base64.b64decode(message.audio.data)))
        assert rate == 22050 and len(data) > 0 and np.abs(data).max() > 0.05
        assert reply.usage.completion_tokens == 8 and reply.choices[0].finish_reason == "stop"
        assert text_only.choices[0].message.content.startswith("You said: just text")
        assert text_only.choices[0].message.audio is None


async def test_openai_chat_stream_with_audio(api_factory):
    async with api_factory(toy_spec(thinker={"token_delay_s": 0.01})) as (_engine, server):
        async with client(server) as oai:
            stream = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "stream audio"}], stream=True,
                modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"},
                stream_options={"include_usage": True})
            text, pcm, finish, usage, transcript = [], [], None, None, None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                text.append(delta.content or "")
                audio = getattr(delta, "audio", None)
                if audio and audio.data:
                    pcm.append(np.frombuffer(base64.b64decode(audio.data), dtype="<i2"))
                if audio and audio.transcript is not None:
                    transcript = audio.transcript
                finish = chunk.choices[0].finish_reason or finish
        assert "".join(text).startswith("You said: stream audio") and transcript == "".join(text)
        assert finish == "stop" and usage.completion_tokens == 8
        assert sum(p.size for p in pcm) == 8 * int(22050 * 0.08)


async def test_openai_stream_disconnect_aborts_workflow(api_factory):
    spec = toy_spec(thinker={"token_delay_s": 0.2, "max_words": 40})
    async with api_factory(spec) as (engine, server):
        async with client(server) as oai:
            stream = await oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "long answer"}], stream=True)
            wf_id = None
            async for chunk in stream:
                wf_id = chunk.id.removeprefix("chatcmpl-")
                if chunk.choices and chunk.choices[0].delta.content:
                    break
            await stream.close()       # the client goes away
        doc = await engine.store.wait(wf_id, timeout_s=5)
        assert doc["state"] == "aborted" and "disconnected" in doc["error"]


async def test_openai_non_stream_disconnect_aborts_workflow(api_factory):
    spec = toy_spec(thinker={"token_delay_s": 0.2, "max_words": 40})
    async with api_factory(spec) as (engine, server):
        async with httpx.AsyncClient(base_url=server.url) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/chat/completions", timeout=0.5,
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hang up"}]})
        async def aborted() -> dict | None:
            rows = await engine.store.list()
            return rows[0] if rows and rows[0]["state"] == "aborted" else None

        row = await eventually(aborted, timeout_s=5, interval_s=0.05, what="the workflow aborted by the disconnect")
        assert "disconnected" in row["error"]


async def test_openai_errors_are_openai_shaped(api_factory):
    async with api_factory(**auth_settings()) as (_engine, server):
        async with client(server, "wrong") as oai:
            with pytest.raises(openai.AuthenticationError):
                await oai.models.list()
        async with client(server, KEYS["alice"]) as oai:
            with pytest.raises(openai.NotFoundError) as info:
                await oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
            assert info.value.code == "model_not_found"
            with pytest.raises(openai.UnprocessableEntityError):
                await oai.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "x"}])
            with pytest.raises(openai.BadRequestError) as info:
                await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                  modalities=["text", "audio"], audio={"voice": "nobody", "format": "wav"})
            assert info.value.param == "audio.voice" and "alloy" in info.value.message


async def test_chat_refuses_n_and_tools_it_cannot_honour(api_factory):
    async with api_factory(workers=False) as (engine, server), server.client() as http:
        base = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        for extra, field in (({"n": 2}, "body.n"), ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                                                     "body.tools"), ({"functions": [{"name": "f"}]}, "body.functions")):
            r = await http.post("/v1/chat/completions", json={**base, **extra})
            assert r.status_code == 422 and r.json()["error"]["fields"][0]["loc"] == field, extra
        assert await engine.redis.zcard(engine.store.keys.all_wf(0)) == 0
