"""`POST /v1/audio/transcriptions`, driven by the official `openai` client over real HTTP, against a
toy speech-to-text pipeline (`ToyASR` hears one word per half second of audio, sent as soon as that
half second is in)."""
from __future__ import annotations

import io

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf
from openai import AsyncOpenAI

from apiserver import api_factory  # noqa: F401 - fixture

from omniflow.workers.toy import HEARD

MODEL = "asr-toy"
RATE = 16000
pytestmark = pytest.mark.timeout(60)


def asr_spec(**params: object) -> dict:
    return {"name": MODEL, "inputs": {"audio": "asr"},
            "stages": {"asr": {"executor": "omniflow.workers.toy:ToyASR", "final_output": "text", "max_sessions": 8,
                               "params": {"word_s": 0.5, **params},
                               "retry": {"max_attempts": 2, "backoff_s": 0.01, "backoff_max_s": 0.05}}}}


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def audio_file(fmt: str, seconds: float = 2.0, rate: int = 24000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (np.sin(2 * np.pi * 220 * t) * 8000).astype(np.int16)
    buf = io.BytesIO()
    subtype = {"wav": "PCM_16", "flac": "PCM_16", "ogg": "VORBIS", "mp3": "MPEG_LAYER_III"}[fmt]
    sf.write(buf, pcm, rate, format={"mp3": "MP3"}.get(fmt, fmt.upper()), subtype=subtype)
    return buf.getvalue()


def expected(seconds: float) -> str:
    return " ".join(HEARD[: int(np.ceil(seconds / 0.5 - 1e-9))])


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "ogg"])
async def test_uploads_in_every_format_are_heard(api_factory, fmt: str) -> None:
    async with api_factory(asr_spec()) as (_engine, server), client(server) as oai:
        result = await oai.audio.transcriptions.create(model=MODEL, file=(f"speech.{fmt}", audio_file(fmt)))
    # mp3 pads its frames: a few ms more audio than was encoded (still four words)
    assert result.text == expected(2.0), result


async def test_response_formats(api_factory) -> None:
    async with api_factory(asr_spec()) as (_engine, server), client(server) as oai:
        data = audio_file("wav", 1.4)
        text = await oai.audio.transcriptions.create(model=MODEL, file=("a.wav", data), response_format="text")
        verbose = await oai.audio.transcriptions.create(model=MODEL, file=("a.wav", data),
                                                        response_format="verbose_json",
                                                        timestamp_granularities=["segment"])
        srt = await oai.audio.transcriptions.create(model=MODEL, file=("a.wav", data), response_format="srt")
        vtt = await oai.audio.transcriptions.create(model=MODEL, file=("a.wav", data), response_format="vtt")
    assert text.strip() == expected(1.4) == "hello omniflow please"
    assert verbose.language == "english" and verbose.duration == pytest.approx(1.4)
    assert [(s.start, s.end, s.text.strip()) for s in verbose.segments] == [
        (0.0, 0.5, "hello"), (0.5, 1.0, "omniflow"), (1.0, 1.5, "please")]
    assert "00:00:00,500 --> 00:00:01,000\nomniflow" in srt and srt.startswith("1\n")
    assert vtt.startswith("WEBVTT") and "00:00:01.000 --> 00:00:01.500\nplease" in vtt


async def test_streamed_transcription(api_factory) -> None:
    async with api_factory(asr_spec()) as (_engine, server), client(server) as oai:
        stream = await oai.audio.transcriptions.create(model=MODEL, file=("a.wav", audio_file("wav", 2.0)),
                                                       stream=True)
        events = [event async for event in stream]
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert deltas and "".join(deltas) == expected(2.0)     # emits written together arrive as one delta
    assert events[-1].type == "transcript.text.done" and events[-1].text == expected(2.0)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b"RIFF\x00\x00\x00\x00WAVEfmt garbage" * 8, "not audio that can be decoded"),
    (b"\xff\xfb" + bytes(3000), "not audio|corrupt|no samples"),
])
async def test_bad_audio_is_a_400_and_the_worker_goes_on(api_factory, data: bytes, message: str) -> None:
    async with api_factory(asr_spec()) as (_engine, server), client(server) as oai:
        with pytest.raises(openai.BadRequestError) as err:
            await oai.audio.transcriptions.create(model=MODEL, file=("bad.wav", data))
        assert err.value.body["param"] == "file" and __import__("re").search(message, err.value.body["message"])
        ok = await oai.audio.transcriptions.create(model=MODEL, file=("a.wav", audio_file("wav", 0.5)))
        assert ok.text == "hello"


async def test_limits_and_unknown_values(api_factory) -> None:
    async with api_factory(asr_spec(), max_upload_s=1.0, max_upload_bytes=200_000, max_body_bytes=50_000) as (
            _engine, server), \
            client(server) as oai:
        with pytest.raises(openai.BadRequestError, match="over the limit of 1 s|longer than the limit"):
            await oai.audio.transcriptions.create(model=MODEL, file=("long.wav", audio_file("wav", 3.0, 16000)))
        with pytest.raises(openai.APIStatusError) as big:
            await oai.audio.transcriptions.create(model=MODEL, file=("big.wav", bytes(300_000)))
        assert big.value.status_code == 413
        with pytest.raises(openai.NotFoundError, match="unknown pipeline 'whisper-1'"):
            await oai.audio.transcriptions.create(model="whisper-1", file=("a.wav", audio_file("wav", 0.5)))
        with pytest.raises(openai.BadRequestError, match="response_format"):
            await oai.audio.transcriptions.create(model=MODEL, file=("a.wav", audio_file("wav", 0.5)),
                                                  response_format="diarized_json")
        async with httpx.AsyncClient(base_url=server.url) as http:      # no file at all: 422, OpenAI's shape
            missing = await http.post("/v1/audio/transcriptions", data={"model": MODEL})
        assert missing.status_code == 422 and missing.json()["error"]["type"] == "invalid_request_error"


async def test_a_pipeline_without_audio_input_does_not_transcribe(api_factory) -> None:
    async with api_factory() as (engine, server), client(server) as oai:
        with pytest.raises(openai.BadRequestError, match="takes no audio input"):
            await oai.audio.transcriptions.create(model=engine.pipeline.name, file=("a.wav", audio_file("wav", 0.5)))
