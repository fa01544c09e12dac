"""Cutting streamed speech into utterances as it arrives, so recognition starts before the end.

Two parts:

- `SileroVAD` / `SpeechProbability`: Silero VAD v6 (the ONNX model faster-whisper bundles, MIT) run on
  fixed 512-sample windows (32 ms at 16 kHz) counted from the stream's first sample, its LSTM
  state carried from window to window. The model is sequential, so the probabilities are the
  same, bit for bit, whether the audio came in one piece or in 20 ms chunks (checked: feeding
  1..20 windows per call equals one call over the whole).
- `Endpointer`: pure logic over those probabilities. It cuts the stream at a pause (`pause_s`
  of windows below `neg_threshold`, after speech) once the utterance holds `min_utterance_s`,
  at the quietest window of its second half when it reaches `max_utterance_s` (Whisper hears
  30 s at a time), and drops silence before speech begins (keeping `lead_s` of it).

A cut depends only on the audio before it, never on how the audio was chunked, so a stream
gives the same utterances (and the same text) however it arrives. Each utterance is
recognised once and its text is final: nothing is emitted twice or taken back.

Why the defaults cut so rarely (20 s at the least): Whisper's encoder costs the same for 1 s
as for 30 s of audio (it always hears a 30 s window; ~1.5-2.5 CPU-s per pass for Whisper base
at one thread here), and short pieces lose context. Measured on 41.6 s of speech at one
thread: the whole at once 12.0 CPU-s, cut at >= 20 s 12.3 CPU-s (the same words), at >= 8 s
20.1 CPU-s, at >= 4 s 29.4 CPU-s (and more words wrong). On this CPU a cut only pays when the
speaker goes on for longer after it than the piece takes to recognise, so a short turn is
recognised in one pass once it is committed, and a long one (a monologue, an uploaded file)
gets its first text after its first ~20 s instead of at its end. On a faster device, lower
`min_utterance_s` (per request too) to hear short turns while they are spoken.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omniflow.workers.weights import ModelUnavailable

SAMPLE_RATE = 16000
WINDOW = 512                     # samples per Silero window at 16 kHz (32 ms)
CONTEXT = 64                     # samples of the previous window Silero v6 sees before each one
SILERO_ASSET = "silero_vad_v6.onnx"
BATCH = 8                        # windows per model call at the least (256 ms: the cut decisions lag by that)


class SileroVAD:
    """Silero VAD v6 loaded once (ONNX Runtime); `stream()` gives each audio stream its own state."""

    def __init__(self, *, threads: int = 1, path: str | Path | None = None) -> None:
        try:
            import onnxruntime
            from faster_whisper.utils import get_assets_path
        except ImportError as exc:
            raise ModelUnavailable("faster-whisper and onnxruntime are needed for voice activity detection: "
                                   "run `make models`") from exc
        opts = onnxruntime.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = threads
        opts.log_severity_level = 3
        model = Path(path) if path else Path(get_assets_path()) / SILERO_ASSET
        self.session = onnxruntime.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])

    def stream(self) -> SpeechProbability:
        return SpeechProbability(self)


class SpeechProbability:
    """One 16 kHz float stream through Silero: a speech probability per complete 512-sample window."""

    def __init__(self, vad: SileroVAD) -> None:
        self._session = vad.session
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._tail = np.zeros(0, dtype=np.float32)          # samples past the last whole window
        self._context = np.zeros(CONTEXT, dtype=np.float32)

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Probabilities (float32) of the windows that `samples` completes, once there are `BATCH`
        of them (one model call per window of a 20 ms chunk would cost more than the model)."""
        pending = np.concatenate([self._tail, np.asarray(samples, dtype=np.float32)])
        n = pending.size // WINDOW
        if n < BATCH:
            self._tail = pending
            return np.zeros(0, dtype=np.float32)
        self._tail = pending[n * WINDOW:]
        windows = pending[:n * WINDOW].reshape(n, WINDOW)
        context = np.concatenate([self._context[None, :], windows[:-1, -CONTEXT:]])
        self._context = windows[-1, -CONTEXT:].copy()
        probs, self._h, self._c = self._session.run(
            None, {"input": np.concatenate([context, windows], axis=1), "h": self._h, "c": self._c})
        return np.asarray(probs, dtype=np.float32).reshape(n)


@dataclass(frozen=True)
class EndpointConfig:
    """When the stream is cut into utterances (the ASR stage's params: `vad_threshold`,
    `vad_neg_threshold`, and the others under their own names)."""

    threshold: float = 0.5            # a window at or above it is speech
    neg_threshold: float = 0.35       # a window below it is silence (in between: whatever came before)
    pause_s: float = 0.2              # a pause this long after speech ends an utterance ...
    min_utterance_s: float = 20.0     # ... once it is this long (shorter pieces cost more: module doc)
    max_utterance_s: float = 28.0     # an utterance is cut here at the latest (Whisper hears 30 s)
    lead_s: float = 0.3               # silence kept before speech begins

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> EndpointConfig:
        """The config from stage params; ValueError (or TypeError) on a bad value."""
        values = {}
        for name in cls.__dataclass_fields__:
            key = f"vad_{name}" if name.endswith("threshold") else name
            if params.get(key) is not None:
                values[name] = float(params[key])
        config = cls(**values)
        if not 0 < config.neg_threshold <= config.threshold < 1:
            raise ValueError("vad thresholds need 0 < vad_neg_threshold <= vad_threshold < 1")
        if not (config.pause_s > 0 and 0 <= config.min_utterance_s < config.max_utterance_s <= 30):
            raise ValueError("vad needs pause_s > 0 and 0 <= min_utterance_s < max_utterance_s <= 30")
        if config.lead_s < 0:
            raise ValueError("vad lead_s must not be negative")
        return config


@dataclass
class Endpointer:
    """Where to cut: fed one probability per window in stream order, it returns the utterances
    (`(start, end)` sample offsets from the stream's start) that are complete. `start` is the
    first sample still needed (audio before it is recognised or dropped)."""

    config: EndpointConfig = field(default_factory=EndpointConfig)
    start: int = 0
    _windows: list[tuple[int, float]] = field(default_factory=list)   # (window index, prob) since `start`
    _judged: int = 0                 # how many of `_windows` the current utterance has judged
    _next: int = 0                   # index of the next window to be fed
    _speech: bool = False            # a speech window since `start`
    _silence_from: int | None = None  # first silent window of the pause in progress

    @property
    def has_speech(self) -> bool:
        """Whether speech was heard since `start` (else the rest of the stream is not worth recognising)."""
        return self._speech

    def feed(self, probs: np.ndarray) -> list[tuple[int, int]]:
        values = np.asarray(probs, dtype=np.float64).tolist()
        self._windows.extend(zip(range(self._next, self._next + len(values)), values))
        self._next += len(values)
        cuts: list[tuple[int, int]] = []
        while self._judged < len(self._windows):
            w, p = self._windows[self._judged]
            self._judged += 1
            cut = self._judge(w, p)
            if cut is not None:     # a new utterance from `cut`: the windows after it are judged again
                cuts.append((self.start, cut))
                self.start, self._speech, self._silence_from, self._judged = cut, False, None, 0
                self._windows = [(i, q) for i, q in self._windows if (i + 1) * WINDOW > cut]
        return cuts

    def _judge(self, w: int, p: float) -> int | None:
        """Take window `w` into the utterance; the sample to cut at, if the utterance ends here."""
        cfg = self.config
        end = (w + 1) * WINDOW
        if p >= cfg.threshold:
            self._speech, self._silence_from = True, None
        elif p < cfg.neg_threshold and self._silence_from is None:
            self._silence_from = w
        if not self._speech:        # nothing said yet: keep only `lead_s` of the silence
            self.start = max(self.start, end - int(cfg.lead_s * SAMPLE_RATE))
            gone = sum(1 for i, _ in self._windows[:self._judged] if (i + 1) * WINDOW <= self.start)
            del self._windows[:gone]
            self._judged -= gone
            return None
        length = end - self.start
        if self._silence_from is not None and length >= cfg.min_utterance_s * SAMPLE_RATE:
            pause = end - self._silence_from * WINDOW
            if pause >= cfg.pause_s * SAMPLE_RATE:
                return self._silence_from * WINDOW + pause // 2          # the middle of the pause
        if length >= cfg.max_utterance_s * SAMPLE_RATE:
            half = self.start + length // 2
            quiet = min((q, i) for i, q in self._windows[:self._judged] if i * WINDOW >= half)   # earliest on ties
            return quiet[1] * WINDOW + WINDOW // 2
        return None
