"""Speech in, end to end on the real CPU models through the API over real HTTP and WebSocket with the
official `openai` client: the Piper voice says a question (the session's `speaker`), Whisper base hears
it in the asr-cpu pipeline (`/v1/audio/transcriptions`) and in omni-cpu (chat `input_audio`, a realtime
audio turn), SmolLM2 answers and Piper speaks the answer. Server VAD (Silero) finds the turn in the
voice's speech on the toy pipeline."""
from __future__ import annotations

import base64
import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import yaml
from openai import AsyncOpenAI

from omniflow.resample import resample

from .test_e2e import words

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS / "api") not in sys.path:        # the API test server (tests/api is not a package)
    sys.path.insert(0, str(TESTS / "api"))
from apiserver import ApiServer  # noqa: E402
from conftest import toy_audio_spec  # noqa: E402

PIPELINES = TESTS.parent / "deploy" / "pipelines"
SAID = "Durable workflows keep every request. Nothing is lost when a worker dies."
QUESTION = "What is the capital of France?"


def wav(pcm: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, pcm, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def appends(pcm: np.ndarray, rate: int, *, chunk_ms: int = 100) -> list[str]:
    """Speech as a realtime client streams it: pcm16 at 24 kHz, base64, `chunk_ms` a message."""
    pcm24 = np.asarray(resample(pcm, rate, 24000), dtype="<i2").tobytes()
    step = 48 * chunk_ms
    return [base64.b64encode(pcm24[i:i + step]).decode() for i in range(0, len(pcm24), step)]


def recall(text: str, said: str) -> float:
    got = set(words(text))
    return sum(w in got for w in words(said)) / len(words(said))


def oai(server: ApiServer) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_asr_cpu_transcribes_the_voice_through_the_openai_client(engine_factory, speaker: Any) -> None:
    pcm = await speaker.speak(SAID)
    spec = yaml.safe_load((PIPELINES / "asr-cpu.yaml").read_text())
    async with engine_factory(spec, lease_timeout_s=5.0) as engine:
        server = ApiServer(engine).start()
        try:
            async with oai(server) as client:
                verbose = await client.audio.transcriptions.create(
                    model="asr-cpu", file=("said.wav", wav(pcm, speaker.sample_rate)), response_format="verbose_json")
                stream = await client.audio.transcriptions.create(
                    model="asr-cpu", file=("said.wav", wav(pcm, speaker.sample_rate)), stream=True)
                events = [e async for e in stream]
        finally:
            server.stop()
    assert recall(verbose.text, SAID) >= 0.8, verbose.text
    assert verbose.language == "english" and verbose.duration == pytest.approx(pcm.size / speaker.sample_rate, abs=0.01)
    assert verbose.segments and verbose.segments[-1].end <= verbose.duration + 0.01
    assert events[-1].type == "transcript.text.done" and events[-1].text == verbose.text      # deterministic
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == verbose.text


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_omni_cpu_hears_a_spoken_question_in_chat_and_in_a_realtime_turn(engine_factory, speaker: Any) -> None:
    pcm = await speaker.speak(QUESTION)
    spec = yaml.safe_load((PIPELINES / "omni-cpu.yaml").read_text())
    spec["stages"]["thinker"]["params"]["max_tokens"] = 32
    async with engine_factory(spec, lease_timeout_s=5.0) as engine:
        server = ApiServer(engine).start()
        try:
            async with oai(server) as client:
                chat = await client.chat.completions.create(model="omni-cpu", messages=[{"role": "user", "content": [
                    {"type": "input_audio", "input_audio": {"data": base64.b64encode(
                        wav(pcm, speaker.sample_rate)).decode(), "format": "wav"}}]}])
                async with client.realtime.connect(model="omni-cpu") as conn:
                    await conn.recv()
                    for chunk in appends(pcm, speaker.sample_rate):
                        await conn.input_audio_buffer.append(audio=chunk)
                    await conn.input_audio_buffer.commit()
                    await conn.response.create()
                    events: list[Any] = []
                    while not events or events[-1].type != "response.done" or not any(
                            e.type == "conversation.item.input_audio_transcription.completed" for e in events):
                        events.append(await conn.recv())
        finally:
            server.stop()
        docs = [await engine.store.document(w["id"]) for w in await engine.store.list()]
    answer = chat.choices[0].message.content
    assert answer and len(words(answer)) >= 3, answer
    heard_chat = [d for d in docs if d["stages"].get("asr")]
    assert len(heard_chat) == 2 and all(d["state"] == "completed" for d in docs)
    heard = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed").transcript
    assert recall(heard, QUESTION) >= 0.8, heard
    done = next(e for e in events if e.type == "response.done")
    assert done.response.status == "completed"
    audio = [e for e in events if e.type == "response.output_audio.delta"]
    transcript = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")
    assert audio and len(words(transcript)) >= 3, transcript


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_server_vad_finds_the_turn_in_speech_and_answers_it(engine_factory, speaker: Any) -> None:
    pytest.importorskip("faster_whisper", reason="Silero VAD comes with faster-whisper (`make models`)")
    pcm = await speaker.speak(SAID)
    rate = speaker.sample_rate
    silence = np.zeros(rate, dtype=np.int16)
    stream = appends(np.concatenate([silence, pcm, silence, silence]), rate)
    async with engine_factory(toy_audio_spec(thinker={"max_words": 8})) as engine:
        server = ApiServer(engine).start()
        try:
            async with oai(server) as client, client.realtime.connect(model="omni-toy") as conn:
                await conn.recv()
                await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
                    "type": "server_vad", "silence_duration_ms": 500, "prefix_padding_ms": 300}}}})
                for chunk in stream:
                    await conn.input_audio_buffer.append(audio=chunk)
                events: list[Any] = []
                while not events or events[-1].type != "response.done":
                    events.append(await conn.recv())
        finally:
            server.stop()
    kinds = [e.type for e in events]
    started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.speech_stopped") < \
        kinds.index("input_audio_buffer.committed") < kinds.index("response.created")
    spoken_ms = pcm.size * 1000 / rate
    assert 700 <= started.audio_start_ms <= 1300                   # the voice starts after 1 s of silence
    assert spoken_ms * 0.8 < stopped.audio_end_ms - started.audio_start_ms < spoken_ms + 900
    assert events[-1].response.status == "completed" and started.item_id == stopped.item_id


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_server_vad_speech_over_a_playing_answer_interrupts_it(engine_factory, speaker: Any) -> None:
    pytest.importorskip("faster_whisper", reason="Silero VAD comes with faster-whisper (`make models`)")
    pcm = await speaker.speak("Tell me a long story.")
    rate = speaker.sample_rate
    silence = np.zeros(rate, dtype=np.int16)
    first = appends(np.concatenate([silence, pcm, silence]), rate)
    again = appends(np.concatenate([pcm, silence]), rate)
    spec = toy_audio_spec(thinker={"max_words": 40, "token_delay_s": 0.1})
    async with engine_factory(spec) as engine:
        server = ApiServer(engine).start()
        try:
            async with oai(server) as client, client.realtime.connect(model="omni-toy") as conn:
                await conn.recv()
                await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": {
                    "type": "server_vad"}}}})
                for chunk in first:
                    await conn.input_audio_buffer.append(audio=chunk)
                events: list[Any] = []
                while not events or events[-1].type != "response.output_audio.delta":
                    events.append(await conn.recv())
                for chunk in again:                  # the user talks over the answer
                    await conn.input_audio_buffer.append(audio=chunk)
                done: list[Any] = []
                while len(done) < 2:
                    events.append(await conn.recv())
                    if events[-1].type == "response.done":
                        done.append(events[-1])
        finally:
            server.stop()
    assert [d.response.status for d in done] == ["cancelled", "completed"]
    assert sum(e.type == "input_audio_buffer.speech_started" for e in events) == 2
