"""The audio routes end to end on the real text-to-speech pipeline (deploy/pipelines/tts-cpu.yaml: the
Piper voice as Talker and streamed Code2Wav), through the API over real HTTP and WebSocket with the
official `openai` client, the words checked by the real Whisper base. One engine serves both routes
(the voice is loaded once by each of its two workers), Whisper is the session's fixture."""
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

from .test_e2e import words

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS / "api") not in sys.path:        # the API test server (tests/api is not a package)
    sys.path.insert(0, str(TESTS / "api"))
from apiserver import ApiServer  # noqa: E402

PIPELINE = TESTS.parent / "deploy" / "pipelines" / "tts-cpu.yaml"
SAID = "Durable workflows keep every request. Nothing is lost when a worker dies."


async def heard(whisper: Any, pcm: np.ndarray, rate: int) -> str:
    from omniflow.testing import FakeSession, run_executor

    session = FakeSession(stage="asr", chunks=[("@input", {"pcm": pcm[i:i + 32768], "sample_rate": rate})
                                               for i in range(0, pcm.size, 32768)])
    await run_executor(whisper, session)
    return session.text_out


def recall(text: str) -> float:
    got = set(words(text))
    return sum(w in got for w in words(SAID)) / len(words(SAID))


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_tts_cpu_speaks_through_speech_and_realtime_and_whisper_hears_it(engine_factory, whisper: Any) -> None:
    spec: dict[str, Any] = yaml.safe_load(PIPELINE.read_text())
    async with engine_factory(spec, lease_timeout_s=5.0) as engine:
        server = ApiServer(engine).start()
        try:
            async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as oai:
                chunks: list[bytes] = []
                async with oai.audio.speech.with_streaming_response.create(
                        model="tts-cpu", voice="alloy", input=SAID, response_format="wav") as response:
                    async for piece in response.iter_bytes():
                        chunks.append(piece)
                async with oai.realtime.connect(model="tts-cpu") as conn:
                    created = await conn.recv()
                    assert created.type == "session.created" and created.session.output_modalities == ["audio"]
                    await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                        {"type": "input_text", "text": SAID}]})
                    await conn.response.create()
                    events = []
                    while not events or events[-1].type != "response.done":
                        events.append(await conn.recv())
        finally:
            server.stop()
    pcm, rate = sf.read(io.BytesIO(b"".join(chunks)), dtype="int16")
    assert rate == 22050 and len(chunks) > 1 and 0.15 * len(words(SAID)) < pcm.size / rate < 1.0 * len(words(SAID))
    speech_heard = await heard(whisper, pcm, rate)
    assert recall(speech_heard) >= 0.8, speech_heard
    # realtime: pcm16 at 24 kHz in base64 deltas, the transcript is what it spoke (the input text)
    assert events[-1].response.status == "completed", events[-1]
    audio = np.concatenate([np.frombuffer(base64.b64decode(e.delta), dtype="<i2")
                            for e in events if e.type == "response.output_audio.delta"])
    assert abs(audio.size / 24000 - pcm.size / rate) < 0.05            # the same speech, at 24 kHz
    done = [e for e in events if e.type == "response.output_audio_transcript.done"]
    assert done and done[0].transcript == SAID
    realtime_heard = await heard(whisper, audio, 24000)
    assert recall(realtime_heard) >= 0.8, realtime_heard
