"""Deterministic CPU executors shaped like an omni model, for demos, tests and benchmarks.

- `ToyThinker` streams the words of a reply as text deltas and sends each word's
  "hidden state" (a small float32 vector) downstream.
- `ToyTalker` turns each hidden-state chunk into a chunk of codec codes.
- `ToyCode2Wav` turns each code chunk into real PCM audio (tones), `speed` times faster.
- `ToyASR` "hears" streamed audio (`@input` chunks, checked as `WhisperASR` checks them): one
  word of `HEARD` per `word_s` of audio, sent as soon as that much has arrived, whatever the
  chunking; with an upstream ASR stage, `ToyThinker` answers what it heard.

Delays simulate GPU time. `fail_at_step` / `fail_attempts` / `fail_retryable`
inject failures so tests can exercise retries and fail-fast. The outputs depend
only on the prompt, so a run with faults can be compared with one without.
"""
from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from omniflow.errors import NonRetryableError, StageError
from omniflow.executor import Executor, Session

FILLER = (
    "omniflow keeps every request in Redis so a crashed worker never loses it and "
    "the answer still arrives in order with nothing repeated and nothing missing"
).split()
HIDDEN_DIM = 16
HEARD = "hello omniflow please tell me about durable workflows and why they never lose a request".split()


def reply_words(prompt: str, max_words: int) -> list[str]:
    """The deterministic reply to `prompt`."""
    words = ["You", "said:"] + prompt.split()[:16] + ["-"] + FILLER
    return words[:max_words] if max_words > 0 else words


def hidden_state(word: str, index: int) -> NDArray[np.float32]:
    seed = int.from_bytes(hashlib.blake2b(f"{index}:{word}".encode(), digest_size=4).digest(), "little")
    return np.random.default_rng(seed).standard_normal(HIDDEN_DIM).astype(np.float32)


def codes_for(hidden: NDArray[np.float32], n_codes: int = 4) -> NDArray[np.int32]:
    return (np.abs(hidden[:n_codes]) * 1000).astype(np.int32) % 1024


def tone(codes: NDArray[Any], sample_rate: int, seconds: float = 0.08) -> NDArray[np.int16]:
    """A short chord whose pitches come from the codes: audible, deterministic."""
    n = int(sample_rate * seconds)
    t = np.arange(n, dtype=np.float64) / sample_rate
    freqs = 220.0 + (np.asarray(codes[:3], dtype=np.float64) % 64) * 12.0
    wave = np.zeros_like(t)
    for f in freqs:                 # summed in order, as sum() did: the same samples
        wave = wave + np.sin(2 * np.pi * f * t)
    wave = wave / max(len(freqs), 1)
    envelope: NDArray[np.float64] = np.minimum(1.0, np.minimum(t, t[::-1]) * 200)
    return (wave * envelope * 0.4 * 32767).astype(np.int16)


class _ToyStage(Executor):
    """Shared failure injection and delays."""

    runs_on = "loop"          # pure asyncio, never blocks: no thread hop per call
    delay_param = "chunk_delay_s"

    def _param(self, session: Session, name: str, default: Any) -> Any:
        return session.params.get(name, self.params.get(name, default))

    async def _step(self, session: Session, step: int) -> None:
        fail_at = int(self._param(session, "fail_at_step", 0))
        if fail_at and step == fail_at and session.attempt <= int(self._param(session, "fail_attempts", 99)):
            message = f"{self.stage}: injected failure at step {step} (attempt {session.attempt})"
            if bool(self._param(session, "fail_retryable", True)):
                raise StageError(message)
            raise NonRetryableError(message)
        delay = float(self._param(session, self.delay_param, 0.0))
        if delay > 0 and session.seq >= session.resume_seq:    # replayed steps cost nothing
            await asyncio.sleep(delay)


class ToyThinker(_ToyStage):
    """Text + hidden states. Resumes from the words earlier attempts emitted."""

    delay_param = "token_delay_s"

    async def run(self, session: Session) -> Mapping[str, Any]:
        prompt = f"{session.text} {await _upstream_text(session)}".strip() if session.upstream else session.text
        words = reply_words(prompt, int(self._param(session, "max_words", 40)))
        if not prompt.strip():
            raise NonRetryableError("thinker: empty prompt" + (" (nothing was heard)" if session.upstream else ""))
        start = session.fast_forward()   # prefill prompt + emitted tokens, continue
        for i in range(start, len(words)):
            await self._step(session, i + 1)
            delta = words[i] if i == 0 else " " + words[i]
            await session.emit(text=delta, data={"hidden": hidden_state(words[i], i), "word": words[i]})
        return {"prompt_tokens": len(prompt.split()), "completion_tokens": len(words), "resumed_at": start}


async def _upstream_text(session: Session) -> str:
    """The text the upstream stage (an ASR) sent, joined in order."""
    pieces = []
    async for chunk in session.inputs():
        text = chunk.data.get("text") if isinstance(chunk.data, Mapping) else None
        if not isinstance(text, str):
            raise NonRetryableError(f"thinker: chunk {chunk.seq} from {chunk.src} has no text")
        pieces.append(text)
    return "".join(pieces).strip()


class ToyASR(_ToyStage):
    """Streamed audio -> one word of `HEARD` per `word_s` seconds of it, each sent once its audio is in."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        from omniflow.workers.asr import AudioIn

        word_s = float(self._param(session, "word_s", 0.5))
        audio = AudioIn(max_audio_s=float(self._param(session, "max_audio_s", 600.0)))
        words: list[str] = []
        timeline: list[dict[str, Any]] = []

        async def hear(upto: int) -> None:
            while len(words) < upto:
                word = HEARD[len(words) % len(HEARD)]
                await self._step(session, len(words) + 1)
                start = len(words) * word_s
                timeline.append({"start": round(start, 3), "end": round(start + word_s, 3), "text": word})
                words.append(word)
                delta = word if len(words) == 1 else " " + word
                await session.emit(text=delta, data={"text": delta, "start_s": start, "end_s": start + word_s})

        async for chunk in session.inputs():
            audio.push(chunk)
            await hear(int(audio.seconds / word_s))
        audio.finish()
        await hear(max(1, int(np.ceil(audio.seconds / word_s - 1e-9))))
        return {"audio_seconds": round(audio.seconds, 3), "words": len(words), "segments": len(words),
                "language": "en", "timeline": timeline}


class ToyTalker(_ToyStage):
    """Hidden states -> codec codes, one code chunk per input chunk. With no upstream stage (a
    text-to-speech pipeline) it speaks the input text: one code chunk per word."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        n = 0
        if not session.upstream:
            words = session.text.split()
            if not words:
                raise NonRetryableError("talker: no text to speak (the input's `text` is empty)")
            for i, word in enumerate(words):
                n += 1
                await self._step(session, n)
                await session.emit(data={"codes": codes_for(hidden_state(word, i)), "word": word})
            return {"code_chunks": n}
        async for chunk in session.inputs():
            n += 1
            await self._step(session, n)
            await session.emit(data={"codes": codes_for(np.asarray(chunk.data["hidden"])), "word": chunk.data["word"]})
        return {"code_chunks": n}


class ToyCode2Wav(_ToyStage):
    """Codes -> PCM audio chunks."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        sample_rate = int(self._param(session, "sample_rate", 22050))
        speed = float(self._param(session, "speed", 1.0))
        if not 0.25 <= speed <= 4.0:
            raise NonRetryableError(f"code2wav: speed must be in 0.25..4, got {speed!r}")
        seconds = float(self._param(session, "chunk_seconds", 0.08)) / speed
        n, samples = 0, 0
        async for chunk in session.inputs():
            n += 1
            await self._step(session, n)
            pcm = tone(np.asarray(chunk.data["codes"]), sample_rate, seconds)
            samples += pcm.size
            await session.emit(audio=pcm, sample_rate=sample_rate)
        return {"audio_chunks": n, "audio_seconds": round(samples / sample_rate, 3)}


class Echo(Executor):
    """The smallest executor: the prompt back as text (used in docs and tests)."""

    runs_on = "loop"

    async def run(self, session: Session) -> Mapping[str, Any]:
        await session.emit(text=session.text)
        return {"tokens": len(session.text.split())}
