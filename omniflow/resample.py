"""Sample-rate conversion of mono audio, in one go or streamed chunk by chunk.

Band-limited interpolation (a Kaiser-windowed sinc, the method of libsamplerate and
libsoxr): output sample `j` sits at input position `j * src / dst` and is the weighted sum of
the input samples within `ZERO_CROSSINGS` zero crossings of the kernel around it. Downsampling
lowers the kernel's cut-off to the new Nyquist frequency (no aliasing: 48 kHz speech into
Whisper's 16 kHz); upsampling (the 22.05 kHz voice to the 24 kHz of the OpenAI Realtime
protocol) keeps it at the old one (no imaging).

`StreamResampler` keeps the input tail it still needs between `push` calls, so cutting the
input into chunks anywhere gives the same samples, bit for bit, as converting it whole: no
click at chunk boundaries (which resampling each chunk on its own produces) and no drift (the
output position is exact integer arithmetic, never an accumulated float). It lags its input by
the kernel's half-width (about 1 ms); `flush` returns the rest at the end of the stream.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

ZERO_CROSSINGS = 16          # kernel half-width in zero crossings of the low-pass: ~-90 dB stop band
KAISER_BETA = 8.6
ROLLOFF = 0.945              # the pass band ends this fraction below the lower Nyquist frequency
MAX_TABLE_PHASES = 4096      # rate pairs with more sub-sample phases than this round theirs down
MAX_RATE_HZ = 384_000

Samples = npt.NDArray[Any]        # int16, or floating point on any scale


class StreamResampler:
    """Converts one mono stream from `src_rate` to `dst_rate` Hz as its chunks arrive.

    `push(x)` returns the output samples that `x` completes (int16 in, int16 out; float in,
    float32 out, on the same scale); `flush()` the remaining ones once the input has ended,
    after which the resampler refuses more input. The total output is
    `ceil(n_in * dst_rate / src_rate)` samples.
    """

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        for name, rate in (("src_rate", src_rate), ("dst_rate", dst_rate)):
            if isinstance(rate, bool) or not isinstance(rate, int) or not 0 < rate <= MAX_RATE_HZ:
                raise ValueError(f"{name} must be an integer in 1..{MAX_RATE_HZ} Hz, got {rate!r}")
        self.src_rate, self.dst_rate = src_rate, dst_rate
        g = math.gcd(src_rate, dst_rate)
        self._step, self._phases = src_rate // g, dst_rate // g     # output j sits at j * step / phases
        self._half = _half_width(src_rate, dst_rate)
        self._table = _table(src_rate, dst_rate)
        self._buf = np.zeros(self._half, dtype=np.float64)           # input from absolute index _base
        self._base = -self._half                                     # (zeros before the stream starts)
        self._n_in = 0
        self._j = 0
        self._int16 = False
        self._closed = False

    @property
    def samples_in(self) -> int:
        return self._n_in

    @property
    def samples_out(self) -> int:
        return self._j

    def push(self, x: Samples) -> Samples:
        """Feed input samples; returns the output samples now complete."""
        if self._closed:
            raise ValueError("the resampler was flushed: its stream has ended")
        x = np.asarray(x)
        if x.ndim != 1:
            raise ValueError(f"mono samples expected (one dimension), got shape {x.shape}")
        self._int16 = x.dtype == np.int16
        if self.src_rate == self.dst_rate:
            self._n_in += x.size
            self._j += x.size
            return x.copy() if self._int16 else x.astype(np.float32)
        self._buf = np.concatenate([self._buf, x.astype(np.float64)])
        self._n_in += x.size
        # output j needs input up to floor(j * step / phases) + half
        ready = -(-(self._n_in - self._half) * self._phases // self._step)
        return self._produce(ready)

    def flush(self) -> Samples:
        """The output samples still owed once the input has ended (the input treated as followed by silence)."""
        if self._closed:
            return np.zeros(0, dtype=np.int16 if self._int16 else np.float32)
        self._closed = True
        if self.src_rate == self.dst_rate:
            return np.zeros(0, dtype=np.int16 if self._int16 else np.float32)
        total = -(-self._n_in * self._phases // self._step)
        self._buf = np.concatenate([self._buf, np.zeros(2 * self._half + 1)])
        return self._produce(total)

    def _produce(self, end: int) -> Samples:
        start, self._j = self._j, max(self._j, end)
        if self._j == start:
            y = np.zeros(0)
        elif self._phases <= MAX_TABLE_PHASES and self._j - start >= 4 * self._phases:
            y = self._strided(start, self._j)
        else:
            y = self._gathered(start, self._j)
        keep_from = self._j * self._step // self._phases - self._half + 1   # what the next output needs first
        if keep_from > self._base:
            self._buf = self._buf[keep_from - self._base:]
            self._base = keep_from
        if self._int16:
            return np.clip(np.rint(y), -32768, 32767).astype(np.int16)
        return y.astype(np.float32)

    def _strided(self, start: int, end: int) -> npt.NDArray[np.float64]:
        """Outputs j, j + phases, j + 2 * phases, ... share one kernel phase and lie `step` input
        samples apart: each such run is one strided view of the tap windows times one table row."""
        y = np.zeros(end - start)
        windows = sliding_window_view(self._buf, 2 * self._half)    # windows[i]: the taps from _buf[i]
        for r in range(min(self._phases, y.size)):
            pos = (start + r) * self._step
            first = pos // self._phases - self._half + 1 - self._base
            count = len(range(r, y.size, self._phases))
            rows = windows[first:first + (count - 1) * self._step + 1:self._step]
            y[r::self._phases] = np.einsum("ij,j->i", rows, self._table[pos % self._phases])
        return y

    def _gathered(self, start: int, end: int) -> npt.NDArray[np.float64]:
        """Few outputs (a small chunk), or an unusual rate pair with more phases than the table holds
        (each output's phase rounded down): every output's taps and weights gathered row by row."""
        windows = sliding_window_view(self._buf, 2 * self._half)
        pos = np.arange(start, end, dtype=np.int64) * self._step
        first = pos // self._phases - self._half + 1 - self._base
        phase = pos % self._phases
        rows = self._table[phase if self._phases <= MAX_TABLE_PHASES else phase * MAX_TABLE_PHASES // self._phases]
        y: npt.NDArray[np.float64] = np.einsum("ij,ij->i", windows[first], rows)
        return y


def _cutoff(src_rate: int, dst_rate: int) -> float:
    """The low-pass cut-off relative to the input's Nyquist frequency."""
    return ROLLOFF * min(1.0, dst_rate / src_rate)


def _half_width(src_rate: int, dst_rate: int) -> int:
    """Kernel taps on each side of an output, in input samples."""
    return math.ceil(ZERO_CROSSINGS / _cutoff(src_rate, dst_rate))


def _kernel(phase: npt.NDArray[np.int64], phases: int, half: int, cutoff: float) -> npt.NDArray[np.float64]:
    """Kernel weights [len(phase), 2 * half] for outputs at fractional positions `phase / phases`."""
    frac = phase.astype(np.float64)[:, None] / phases
    dist = frac + (half - 1) - np.arange(2 * half)[None, :]    # output position - tap position
    inside = np.clip(1.0 - (dist / half) ** 2, 0.0, None)
    window = np.i0(KAISER_BETA * np.sqrt(inside)) / np.i0(KAISER_BETA)
    weights: npt.NDArray[np.float64] = cutoff * np.sinc(cutoff * dist) * window
    return weights


@functools.lru_cache(maxsize=16)
def _table(src_rate: int, dst_rate: int) -> npt.NDArray[np.float64]:
    """Every phase's weights for one rate pair (at most MAX_TABLE_PHASES of them: past that, outputs
    take the phase below theirs, a timing error under 1/4096 of an input sample, below -75 dB at
    4 kHz), shared by the streams that convert it (read only)."""
    phases = min(dst_rate // math.gcd(src_rate, dst_rate), MAX_TABLE_PHASES)
    table = _kernel(np.arange(phases), phases, _half_width(src_rate, dst_rate), _cutoff(src_rate, dst_rate))
    table.flags.writeable = False
    return table


def resample(x: Samples, src_rate: int, dst_rate: int) -> Samples:
    """A whole signal from `src_rate` to `dst_rate` Hz (int16 in, int16 out; float in, float32 out)."""
    stream = StreamResampler(src_rate, dst_rate)
    head = stream.push(x)
    return np.concatenate([head, stream.flush()]) if src_rate != dst_rate else head
