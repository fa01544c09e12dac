"""Server VAD for realtime sessions (`turn_detection: {type: server_vad}`): where speech starts and stops
in the client's input audio, as OpenAI's server reports it.

`TurnDetector` is pure: fed one speech probability per 32 ms window (Silero VAD, `workers/vad.py`),
it says when speech started (a window at or above `threshold`) and when it stopped (then
`silence_duration_ms` of windows below `threshold - 0.15`), in milliseconds of the session's audio.
`SpeechDetector` runs it over pcm16 at 24 kHz: resampled to Silero's 16 kHz chunk by chunk, the
model (loaded once per API process) run off the event loop, and the last `prefix_padding_ms` of
audio before speech kept, so the turn hears its first syllable.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniflow.resample import StreamResampler

PCM_RATE = 24000
WINDOW_MS = 32                       # Silero's window at 16 kHz (512 samples)
DEFAULT_THRESHOLD = 0.5
DEFAULT_PREFIX_MS = 300
DEFAULT_SILENCE_MS = 500

_model: Any = None
_model_lock = threading.Lock()


def silero() -> Any:
    """The process's Silero VAD (ModelUnavailable when faster-whisper / onnxruntime are missing)."""
    global _model
    with _model_lock:
        if _model is None:
            from omniflow.workers.vad import SileroVAD

            _model = SileroVAD(threads=1)
        return _model


@dataclass
class TurnDetector:
    """Speech start and stop from window probabilities (pure)."""

    threshold: float = DEFAULT_THRESHOLD
    silence_ms: int = DEFAULT_SILENCE_MS
    windows: int = 0                 # windows seen
    speaking: bool = False
    _quiet: int = 0                  # consecutive quiet windows while speaking

    @classmethod
    def from_config(cls, detection: Mapping[str, Any]) -> TurnDetector:
        return cls(threshold=float(detection.get("threshold") or DEFAULT_THRESHOLD),
                   silence_ms=int(detection.get("silence_duration_ms") or DEFAULT_SILENCE_MS))

    def feed(self, probs: np.ndarray) -> list[tuple[str, int]]:
        """`("started", ms)` / `("stopped", ms)` events of these windows, in order."""
        events: list[tuple[str, int]] = []
        quiet_below = max(0.01, self.threshold - 0.15)
        for p in np.asarray(probs, dtype=np.float64).tolist():
            at_ms = self.windows * WINDOW_MS
            self.windows += 1
            if not self.speaking and p >= self.threshold:
                self.speaking, self._quiet = True, 0
                events.append(("started", at_ms))
            elif self.speaking:
                self._quiet = self._quiet + 1 if p < quiet_below else 0
                if self._quiet * WINDOW_MS >= self.silence_ms:
                    self.speaking = False
                    events.append(("stopped", at_ms + WINDOW_MS))
        return events


@dataclass
class SpeechDetector:
    """One session's server VAD over its pcm16 24 kHz input."""

    detector: TurnDetector
    prefix_ms: int = DEFAULT_PREFIX_MS
    _prefix: deque[bytes] = field(default_factory=deque)
    _prefix_bytes: int = 0
    _stream: Any = None
    _resampler: StreamResampler = field(default_factory=lambda: StreamResampler(PCM_RATE, 16000))

    @classmethod
    def from_config(cls, detection: Mapping[str, Any]) -> SpeechDetector:
        prefix = detection.get("prefix_padding_ms")
        return cls(TurnDetector.from_config(detection), prefix_ms=int(prefix if prefix is not None else DEFAULT_PREFIX_MS))

    async def push(self, pcm: bytes) -> tuple[list[tuple[str, int]], bytes]:
        """The speech events this audio completes, and the audio held back before speech (returned,
        then forgotten, when speech starts)."""
        if self._stream is None:
            self._stream = (await asyncio.to_thread(silero)).stream()
        samples = np.frombuffer(pcm, dtype="<i2")
        floats = np.asarray(self._resampler.push(samples), dtype=np.float32) / 32768
        probs = await asyncio.to_thread(self._stream.push, floats)
        was_speaking = self.detector.speaking
        events = self.detector.feed(probs)
        if not was_speaking and not self.detector.speaking and not events:
            self._hold(pcm)
            return [], b""
        prefix = b""
        if not was_speaking:
            prefix = b"".join(self._prefix) + pcm       # this chunk holds the start: it goes with the prefix
            self._prefix.clear()
            self._prefix_bytes = 0
        return events, prefix

    def _hold(self, pcm: bytes) -> None:
        self._prefix.append(pcm)
        self._prefix_bytes += len(pcm)
        limit = self.prefix_ms * PCM_RATE * 2 // 1000
        while self._prefix and self._prefix_bytes - len(self._prefix[0]) >= limit:
            self._prefix_bytes -= len(self._prefix.popleft())
