"""omniflow.resample: band-limited, and the same samples however the stream is cut."""
from __future__ import annotations

import numpy as np
import pytest

from omniflow.resample import StreamResampler, resample

PAIRS = [(22050, 24000), (48000, 16000), (44100, 16000), (24000, 16000), (8000, 16000), (16000, 16000),
         (44099, 16000)]        # the last: more sub-sample phases than the weight table holds


def tone(rate: int, seconds: float, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return amplitude * np.sin(2 * np.pi * hz * t)


def streamed(x: np.ndarray, src: int, dst: int, sizes: list[int]) -> np.ndarray:
    """`x` pushed in pieces of the given sizes (the last size repeated to the end)."""
    stream = StreamResampler(src, dst)
    out, i, k = [], 0, 0
    while i < x.size:
        size = sizes[min(k, len(sizes) - 1)]
        out.append(stream.push(x[i:i + size]))
        i, k = i + size, k + 1
    out.append(stream.flush())
    return np.concatenate(out)


def snr_db(got: np.ndarray, want: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(want ** 2) / np.sum((got - want) ** 2)))


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_a_stream_cut_anywhere_gives_the_whole_conversion_bit_for_bit(src: int, dst: int) -> None:
    pcm = (tone(src, 1.5) * 32767).astype(np.int16)
    whole = resample(pcm, src, dst)
    rng = np.random.default_rng(src + dst)
    for sizes in ([1] * 300 + [4096], [441, 1, 7, 0, 2] * 20 + [1000], rng.integers(0, 4000, 60).tolist()):
        assert np.array_equal(streamed(pcm, src, dst, sizes), whole)
    assert whole.dtype == np.int16 and whole.size == -(-pcm.size * dst // src)


@pytest.mark.parametrize(("src", "dst"), PAIRS)
def test_a_tone_comes_out_clean_at_the_new_rate(src: int, dst: int) -> None:
    got = resample(tone(src, 1.0).astype(np.float32), src, dst)
    assert got.dtype == np.float32
    want = tone(dst, 1.0)[:got.size]
    inner = slice(dst // 50, -dst // 50)          # the kernel's ramp-in at the ends of the stream
    assert snr_db(got[inner], want[inner]) > 70


def test_per_chunk_conversion_clicks_and_the_stream_does_not() -> None:
    """Why the state matters: the voice's chunks (8192 samples) resampled each on its own start
    from silence and end in it, and drift (8916.3 output samples a chunk, rounded up)."""
    src, dst, chunk = 22050, 24000, 8192
    x = tone(src, 2.0, hz=1000).astype(np.float32)
    naive = np.concatenate([resample(x[i:i + chunk], src, dst) for i in range(0, x.size, chunk)])
    stream = streamed(x, src, dst, [chunk])
    want = tone(dst, 3.0, hz=1000)
    inner = slice(dst // 50, -dst // 50)
    assert np.max(np.abs(stream - want[:stream.size])[inner]) < 1e-3
    assert np.max(np.abs(naive - want[:naive.size])[inner]) > 0.1


def test_downsampling_removes_what_the_new_rate_cannot_carry() -> None:
    x = tone(48000, 1.0, hz=12000).astype(np.float32)       # above 16 kHz's Nyquist: would alias to 4 kHz
    got = resample(x, 48000, 16000)[800:-800]
    assert 20 * np.log10(np.sqrt(np.mean(got ** 2)) / np.sqrt(np.mean(x ** 2))) < -60


def test_bad_rates_and_use_after_flush_are_refused() -> None:
    for bad in (0, -16000, 16000.0, True, 10 ** 7):
        with pytest.raises(ValueError, match="src_rate"):
            StreamResampler(bad, 16000)  # type: ignore[arg-type]
    stream = StreamResampler(24000, 16000)
    with pytest.raises(ValueError, match="mono"):
        stream.push(np.zeros((10, 2), dtype=np.int16))
    stream.push(np.zeros(100, dtype=np.int16))
    stream.flush()
    with pytest.raises(ValueError, match="flushed"):
        stream.push(np.zeros(10, dtype=np.int16))
