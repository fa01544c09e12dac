"""`client.chat.completions.create` with `input_audio` content parts, over real HTTP, against the toy
pipeline that takes audio (ToyASR -> Thinker -> Talker -> Code2Wav): the audio is heard, and the
answer is to what was heard (after the message's text parts)."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
import soundfile as sf
from openai import AsyncOpenAI

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_audio_spec, toy_spec

pytestmark = pytest.mark.timeout(60)


def clip(fmt: str, seconds: float) -> str:
    rate = 16000
    pcm = (np.sin(np.arange(int(seconds * rate)) / 7) * 6000).astype(np.int16)
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="WAV" if fmt == "wav" else "MP3",
             subtype="PCM_16" if fmt == "wav" else "MPEG_LAYER_III")
    return base64.b64encode(buf.getvalue()).decode()


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def audio_message(fmt: str, seconds: float, text: str | None = None) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": text}] if text else []
    parts.append({"type": "input_audio", "input_audio": {"data": clip(fmt, seconds), "format": fmt}})
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
async def test_chat_hears_input_audio(api_factory, fmt: str) -> None:
    spec = toy_audio_spec(thinker={"max_words": 12})
    async with api_factory(spec) as (_engine, server), client(server) as oai:
        done = await oai.chat.completions.create(model=spec["name"], messages=audio_message(fmt, 1.0))
        both = await oai.chat.completions.create(model=spec["name"], messages=audio_message(fmt, 1.0, "Listen:"),
                                                 modalities=["text", "audio"], audio={"voice": "alloy",
                                                                                      "format": "wav"})
    assert done.choices[0].message.content.startswith("You said: hello omniflow -")
    assert both.choices[0].message.content.startswith("You said: Listen: hello omniflow -")
    pcm, rate = sf.read(io.BytesIO(base64.b64decode(both.choices[0].message.audio.data)), dtype="int16")
    assert rate == 22050 and pcm.size > 0


async def test_chat_streams_the_answer_to_audio(api_factory) -> None:
    spec = toy_audio_spec()
    async with api_factory(spec) as (_engine, server), client(server) as oai:
        stream = await oai.chat.completions.create(model=spec["name"], messages=audio_message("wav", 1.5),
                                                   modalities=["text", "audio"], stream=True)
        chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    audio = [c for c in chunks if c.choices and getattr(c.choices[0].delta, "audio", None)]
    assert text.startswith("You said: hello omniflow please") and audio


async def test_chat_audio_errors(api_factory) -> None:
    spec = toy_audio_spec()
    async with api_factory(spec) as (_engine, server), client(server) as oai:
        bad = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "bm90IGF1ZGlv",
                                                                                    "format": "wav"}}]}]
        with pytest.raises(openai.BadRequestError, match="not audio that can be decoded") as err:
            await oai.chat.completions.create(model=spec["name"], messages=bad)
        assert err.value.body["param"] == "messages.content.0.input_audio.data"
        bad[0]["content"][0]["input_audio"]["format"] = "aac"
        with pytest.raises(openai.BadRequestError, match="wav or mp3"):
            await oai.chat.completions.create(model=spec["name"], messages=bad)
        bad[0]["content"][0]["input_audio"] = {"data": "%%%", "format": "wav"}
        with pytest.raises(openai.BadRequestError, match="not base64"):
            await oai.chat.completions.create(model=spec["name"], messages=bad)
        ok = await oai.chat.completions.create(model=spec["name"], messages=audio_message("wav", 0.5))
        assert ok.choices[0].message.content.startswith("You said: hello -")
    async with api_factory(toy_spec()) as (engine, server), client(server) as oai:
        with pytest.raises(openai.BadRequestError, match="takes no audio input"):
            await oai.chat.completions.create(model=engine.pipeline.name, messages=audio_message("wav", 0.5))
