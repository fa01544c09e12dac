"""`POST /v1/audio/speech` and `GET /v1/audio/voices`, driven by the official `openai` client over
real HTTP, against a toy text-to-speech pipeline (the toy Talker speaking the input's words, the
toy Code2Wav making 80 ms of tones per word)."""
from __future__ import annotations

import io
import time

import numpy as np
import openai
import pytest
import soundfile as sf
from openai import AsyncOpenAI

from apiserver import KEYS, api_factory, auth_settings  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import eventually

from omniflow.api.routes.audio import WORKFLOW_HEADER
from omniflow.workers import voices

MODEL = "tts-toy"
WORDS = "one two three four five six"
RATE = 22050
WORD_SAMPLES = int(RATE * 0.08)


def tts_spec(**params: dict) -> dict:
    """The toy omni pipeline without its Thinker: text -> Talker -> Code2Wav."""
    raw = toy_spec(**params)
    del raw["stages"]["thinker"]
    raw["name"] = MODEL
    raw["edges"] = [{"from": "talker", "to": "code2wav", "mode": "chunk"}]
    return raw


def client(server, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)


def pcm_samples(n_in: int, rate: int = RATE) -> int:
    """How many samples the 24 kHz conversion of `n_in` samples has."""
    return -(-n_in * 24000 // rate)


def read_back(fmt: str, data: bytes) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2"), 24000
    if fmt == "flac":       # streamed: its length is 'unknown' in STREAMINFO, which libsndfile refuses
        av = pytest.importorskip("av", reason="decoding a streamed FLAC needs ffmpeg (PyAV, the models extra)")
        with av.open(io.BytesIO(data)) as container:
            frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
            return np.concatenate(frames).astype(np.int16), container.streams.audio[0].rate
    pcm, rate = sf.read(io.BytesIO(data), dtype="int16")
    return pcm, rate


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
async def test_speech_in_every_format(api_factory, fmt: str) -> None:
    async with api_factory(tts_spec()) as (_engine, server), client(server) as oai:
        reply = await oai.audio.speech.create(model=MODEL, voice="alloy", input=WORDS, response_format=fmt)
        data = reply.content
    pcm, rate = read_back(fmt, data)
    total = 6 * WORD_SAMPLES
    if fmt == "wav":
        assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff"      # the streaming header: sizes unknown
        assert rate == RATE and pcm.size == total
    elif fmt == "pcm":
        assert pcm.size == pcm_samples(total)                                 # raw pcm16 at 24 kHz, resampled
    elif fmt == "flac":
        assert rate == RATE and pcm.size == total
    else:
        assert rate in (RATE, 48000) and abs(pcm.size / rate - total / RATE) < 0.15
    assert np.abs(pcm.astype(np.int32)).max() > 1000                          # tones, not silence


async def test_speech_streams_as_it_is_produced(api_factory) -> None:
    spec = tts_spec(code2wav={"chunk_delay_s": 0.25})         # each word's audio takes 250 ms to "decode"
    words = "one two three four five six seven eight"
    async with api_factory(spec) as (engine, server), client(server) as oai:
        await oai.audio.speech.create(model=MODEL, voice="echo", input="warm", response_format="pcm")   # connections up
        started = time.perf_counter()
        arrivals: list[tuple[float, int]] = []
        async with oai.audio.speech.with_streaming_response.create(
                model=MODEL, voice="echo", input=words, response_format="pcm") as response:
            assert response.headers["content-type"].startswith("audio/")
            assert "content-length" not in response.headers            # chunked: sent as it comes
            wf_id = response.headers[WORKFLOW_HEADER]
            async for piece in response.iter_bytes():
                arrivals.append((time.perf_counter() - started, len(piece)))
        doc = await engine.store.document(wf_id)
    first_s, total_s = arrivals[0][0], arrivals[-1][0]
    assert len(arrivals) >= 4 and sum(n for _, n in arrivals) == 2 * pcm_samples(8 * WORD_SAMPLES)
    # the first byte comes about when the first word is decoded (1/8 of the way), long before the last one
    assert first_s < total_s / 2, arrivals
    assert doc["state"] == "completed" and doc["final_stages"] == ["code2wav"]


async def test_speech_speed_is_honoured_where_the_pipeline_declares_it(api_factory) -> None:
    async with api_factory(tts_spec()) as (_engine, server), client(server) as oai:
        normal = (await oai.audio.speech.create(model=MODEL, voice="alloy", input=WORDS, response_format="wav")).content
        fast = (await oai.audio.speech.create(model=MODEL, voice="alloy", input=WORDS, response_format="wav",
                                              speed=2.0)).content
    assert sf.read(io.BytesIO(fast))[0].size * 2 == pytest.approx(sf.read(io.BytesIO(normal))[0].size, abs=12)
    spec = tts_spec()
    del spec["stages"]["code2wav"]["params"]["speed"]        # no stage declares `speed`: refused, not ignored
    async with api_factory(spec) as (engine, server), client(server) as oai:
        with pytest.raises(openai.BadRequestError) as info:
            await oai.audio.speech.create(model=MODEL, voice="alloy", input=WORDS, speed=1.5)
        assert info.value.code == "unsupported_parameter" and info.value.param == "speed"
        await oai.audio.speech.create(model=MODEL, voice="alloy", input=WORDS, speed=1.0)     # neutral: fine
        assert await engine.redis.zcard(engine.store.keys.all_wf(0)) == 1


async def test_voices_list_every_name_a_request_may_use(api_factory) -> None:
    async with api_factory(tts_spec(), **auth_settings()) as (_engine, server), client(server, KEYS["alice"]) as oai:
        listed = await oai.get("/audio/voices", cast_to=object)
    ids = [v["id"] for v in listed["data"]]
    assert listed["object"] == "list" and ids == [v["id"] for v in voices.list_voices()]
    assert {"alloy", "echo", "shimmer", "joe"} <= set(ids)
    assert {v["voice"] for v in listed["data"]} == {"joe"} and all(v["object"] == "audio.voice" for v in listed["data"])


async def test_speech_bad_input_is_a_clear_4xx_and_submits_nothing(api_factory) -> None:
    async with api_factory(tts_spec(), **auth_settings()) as (engine, server):
        async with client(server, "wrong-key") as oai:
            with pytest.raises(openai.AuthenticationError):
                await oai.audio.speech.create(model=MODEL, voice="alloy", input=WORDS)
        async with client(server, KEYS["bob"]) as oai:
            with pytest.raises(openai.NotFoundError) as info:
                await oai.audio.speech.create(model="tts-1", voice="alloy", input=WORDS)
            assert info.value.code == "model_not_found" and MODEL in info.value.message
            cases = [
                ({"voice": "nobody"}, openai.BadRequestError, "voice"),
                ({"response_format": "aac"}, openai.BadRequestError, "response_format"),
                ({"response_format": "ogg-vorbis"}, openai.BadRequestError, "response_format"),
                ({"instructions": "whisper it"}, openai.BadRequestError, "instructions"),
                ({"stream_format": "sse"}, openai.BadRequestError, "stream_format"),
                ({"input": "   "}, openai.BadRequestError, "input"),
                ({"input": ""}, openai.UnprocessableEntityError, "input"),
                ({"input": "x" * 4097}, openai.UnprocessableEntityError, "input"),
                ({"speed": 9.0}, openai.UnprocessableEntityError, "speed"),
            ]
            for overrides, error, param in cases:
                args = {"model": MODEL, "voice": "alloy", "input": WORDS, **overrides}
                with pytest.raises(error) as info:
                    await oai.audio.speech.create(**args)
                body = info.value.body
                assert body["param"] == param and body["type"] == "invalid_request_error", (overrides, body)
                assert body["message"] and body["code"]
            with pytest.raises(openai.BadRequestError) as info:
                await oai.audio.speech.create(model=MODEL, voice="nobody", input=WORDS)
            assert "alloy" in info.value.message and "joe" in info.value.message      # it names the known ones
        assert await engine.redis.zcard(engine.store.keys.all_wf(0)) == 0


async def test_speech_of_a_model_without_audio_is_refused(api_factory) -> None:
    spec = toy_spec()
    del spec["stages"]["talker"], spec["stages"]["code2wav"]
    spec["edges"] = []
    async with api_factory(spec) as (_engine, server), client(server) as oai:
        with pytest.raises(openai.BadRequestError) as info:
            await oai.audio.speech.create(model="omni-toy", voice="alloy", input=WORDS)
        assert info.value.param == "model" and "makes no audio" in info.value.message


async def test_speech_that_fails_before_it_speaks_is_a_502(api_factory) -> None:
    spec = tts_spec(talker={"fail_at_step": 1, "fail_retryable": False})
    async with api_factory(spec) as (_engine, server), client(server) as oai:
        with pytest.raises(openai.InternalServerError) as info:
            await oai.audio.speech.create(model=MODEL, voice="alloy", input=WORDS)
        assert info.value.status_code == 502 and info.value.code == "workflow_failed"
        assert "injected failure" in info.value.message


async def test_speech_that_fails_mid_stream_is_cut_not_passed_off_as_whole(api_factory) -> None:
    spec = tts_spec(code2wav={"fail_at_step": 3, "fail_retryable": False, "chunk_delay_s": 0.05})
    async with api_factory(spec) as (_engine, server), client(server) as oai:
        got = bytearray()
        with pytest.raises(Exception, match="incomplete chunked read"):      # the connection is cut
            async with oai.audio.speech.with_streaming_response.create(
                    model=MODEL, voice="alloy", input=WORDS, response_format="pcm") as response:
                async for piece in response.iter_bytes():
                    got += piece
        assert 0 < len(got) < 2 * pcm_samples(6 * WORD_SAMPLES)


async def test_speech_client_gone_aborts_the_workflow(api_factory) -> None:
    spec = tts_spec(code2wav={"chunk_delay_s": 0.3})
    async with api_factory(spec) as (engine, server), client(server) as oai:
        async with oai.audio.speech.with_streaming_response.create(
                model=MODEL, voice="alloy", input=WORDS, response_format="wav") as response:
            wf_id = response.headers[WORKFLOW_HEADER]
            async for _piece in response.iter_bytes():
                break                                        # the first bytes, then the client goes away
        doc = await eventually(lambda: _terminal(engine, wf_id), timeout_s=10, what="the workflow aborted")
    assert doc["state"] == "aborted" and "disconnected" in doc["error"]


async def _terminal(engine, wf_id: str) -> dict | None:
    doc = await engine.store.document(wf_id)
    return doc if doc["state"] in ("completed", "failed", "aborted") else None
