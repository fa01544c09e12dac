"""The real CPU omni pipeline (deploy/pipelines/omni-cpu.yaml) end to end through omniflow:
embedded Valkey, reconciler and one in-process worker per stage. Slow: it loads SmolLM2 and
the Piper voice (built into the model cache on the first run)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from omniflow.models import SubmitRequest, WorkflowInput

PIPELINE = Path(__file__).resolve().parents[2] / "deploy" / "pipelines" / "omni-cpu.yaml"
QUESTION = "Why is the sky blue?"


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def recognised(audio: np.ndarray, sample_rate: int) -> str:
    """What an offline recogniser (PocketSphinx, its bundled US English model) hears."""
    from pocketsphinx import Decoder

    pcm = audio.astype(np.float32) / 32768
    n = int(pcm.size * 16000 / sample_rate)
    pcm16 = np.interp(np.arange(n) * sample_rate / 16000, np.arange(pcm.size), pcm)
    decoder = Decoder(samprate=16000, logfn="/dev/null")
    decoder.start_utt()
    decoder.process_raw((np.clip(pcm16, -1, 1) * 32767).astype(np.int16).tobytes(), full_utt=True)
    decoder.end_utt()
    return decoder.hyp().hypstr if decoder.hyp() else ""


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_cpu_omni_pipeline_speaks_its_answer(engine_factory) -> None:
    spec: dict[str, Any] = yaml.safe_load(PIPELINE.read_text())
    spec["stages"]["thinker"]["params"]["max_tokens"] = 48
    async with engine_factory(spec, lease_timeout_s=5.0) as eng:
        sub = await eng.store.submit(SubmitRequest(input=WorkflowInput(text=QUESTION)))
        doc = await eng.store.wait(sub.id, timeout_s=300)
        assert doc["state"] == "completed", doc
        rate, audio = await eng.store.audio(sub.id)
    text = doc["outputs"]["thinker"]["text"]
    said = words(text)
    assert len(said) >= 8, text
    seconds = audio.size / rate
    assert rate == 22050
    assert 0.15 * len(said) < seconds < 1.0 * len(said), (seconds, text)       # ~0.3 s a word when spoken
    assert float(np.sqrt(np.mean((audio.astype(np.float32) / 32768) ** 2))) > 0.02     # not silent
    heard = set(words(recognised(audio, rate)))
    recall = sum(w in heard for w in said) / len(said)
    assert recall >= 0.5, (recall, text, heard)     # measured ~0.8: the spoken words are the printed answer


TTS_PIPELINE = PIPELINE.with_name("tts-cpu.yaml")
SAID = "Durable workflows keep every request. Nothing is lost when a worker dies."


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_tts_pipeline_says_its_input_text_and_whisper_hears_it(engine_factory, whisper: Any) -> None:
    """tts-cpu through omniflow (Talker with no upstream, Code2Wav streaming), then the words checked by
    the real Whisper base in process."""
    from omniflow.testing import FakeSession, run_executor

    spec: dict[str, Any] = yaml.safe_load(TTS_PIPELINE.read_text())
    async with engine_factory(spec, lease_timeout_s=5.0) as eng:
        sub = await eng.store.submit(SubmitRequest(input=WorkflowInput(text=SAID)))
        doc = await eng.store.wait(sub.id, timeout_s=120)
        assert doc["state"] == "completed", doc
        rate, audio = await eng.store.audio(sub.id)
    assert rate == 22050 and doc["stages"]["talker"]["status"] == "done"
    assert 0.15 * len(words(SAID)) < audio.size / rate < 1.0 * len(words(SAID))
    session = FakeSession(stage="asr", chunks=[("@input", {"pcm": audio[i:i + 32768], "sample_rate": rate})
                                               for i in range(0, audio.size, 32768)])
    await run_executor(whisper, session)
    heard = set(words(session.text_out))
    assert sum(w in heard for w in words(SAID)) / len(words(SAID)) >= 0.8, session.text_out
