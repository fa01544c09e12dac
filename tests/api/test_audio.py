"""omniflow.api.audio and audio_stream: uploads decoded (every format round trip, clear errors),
and responses encoded as they stream (the bytes come before the end and decode to the audio)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from omniflow.api.audio import AudioFormat, BadAudio, decode, encode, speech_format
from omniflow.api.audio_stream import open_stream, wav_header
from omniflow.resample import resample

RATE = 22050
LOSSLESS = [AudioFormat.WAV, AudioFormat.FLAC]
LOSSY = [AudioFormat.OGG, AudioFormat.OPUS, AudioFormat.MP3]


def voice_like(seconds: float = 2.0, rate: int = RATE) -> np.ndarray:
    """Int16 tones with a syllable-rate envelope: something codecs treat like speech."""
    t = np.arange(int(seconds * rate)) / rate
    tones = sum(np.sin(2 * np.pi * f * t) / (k + 1) for k, f in enumerate((220, 440, 660, 1320, 2500)))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t)
    return (0.3 * tones * envelope / 2.3 * 32767).astype(np.int16)


def similarity(got: np.ndarray, want: np.ndarray, max_lag: int = 4000) -> float:
    """Peak normalised cross-correlation over lags up to `max_lag` (codec delay)."""
    a, b = got.astype(np.float64), want.astype(np.float64)
    n = min(a.size - max_lag, b.size)
    size = 1 << int(np.ceil(np.log2(n + max_lag)))
    corr = np.fft.irfft(np.fft.rfft(a[:n + max_lag], size) * np.conj(np.fft.rfft(b[:n], size)), size)[:max_lag]
    energy = np.concatenate([[0.0], np.cumsum(a[:n + max_lag] ** 2)])
    window = np.sqrt(energy[n:n + max_lag] - energy[:max_lag])          # |a[lag:lag + n]| for every lag
    return float(np.max(corr / (window * np.linalg.norm(b[:n]) + 1e-9)))


# ------------------------------------------------------------------ decoding uploads
@pytest.mark.parametrize("fmt", LOSSLESS + LOSSY, ids=lambda f: f.value)
def test_every_format_round_trips_through_encode_and_decode(fmt: AudioFormat) -> None:
    pcm = voice_like()
    out = decode(encode(pcm, RATE, fmt))
    want = resample(pcm, RATE, out.sample_rate)
    assert out.pcm.dtype == np.int16 and out.channels == 1
    if fmt in LOSSLESS:
        assert out.sample_rate == RATE and np.array_equal(out.pcm, pcm)
    else:
        assert out.sample_rate == (48000 if fmt is AudioFormat.OPUS else RATE)
        assert abs(out.duration_s - 2.0) < 0.15
        assert similarity(out.pcm, want, max_lag=3000 * out.sample_rate // RATE) > 0.9
    assert out.source_format == {"wav": "WAV", "flac": "FLAC", "mp3": "MP3"}.get(fmt.value, "OGG")


def test_a_stereo_upload_at_44k_comes_out_mono_at_the_rate_asked() -> None:
    left = voice_like(1.0, 44100)
    buf = io.BytesIO()
    sf.write(buf, np.stack([left, left // 2], axis=1), 44100, format="FLAC")
    out = decode(buf.getvalue(), sample_rate=16000)
    assert (out.sample_rate, out.source_rate, out.channels, out.pcm.size) == (16000, 44100, 2, 16000)
    want = resample((left.astype(np.float32) * 0.75) / 32767, 44100, 16000)
    assert np.max(np.abs(out.pcm / 32767 - want)) < 2e-3


@pytest.mark.parametrize(("data", "kwargs", "message"), [
    (b"", {}, "the audio is empty (0 bytes)"),
    (b"hello, this is not audio at all" * 10, {}, "not audio that can be decoded"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt garbage garbage garbage", {}, "not audio that can be decoded"),
    (wav_header(16000, data_bytes=0), {}, "holds no samples"),
    (b"\x00" * 2048, {"max_bytes": 1024}, "2048 bytes, over the limit of 1024 bytes"),
    (encode(voice_like(2.0), RATE, AudioFormat.WAV), {"max_seconds": 1.5}, "2.0 s long, over the limit of 1.5 s"),
    (encode(voice_like(2.0), RATE, AudioFormat.MP3), {"max_seconds": 1.5}, "over the limit of 1.5 s"),
], ids=["empty", "text", "bad-wav", "no-samples", "too-big", "too-long-wav", "too-long-mp3"])
def test_bad_uploads_get_one_clear_error(data: bytes, kwargs: dict, message: str) -> None:
    with pytest.raises(BadAudio) as info:
        decode(data, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_truncated_file_decodes_what_is_there_or_says_it_is_corrupt() -> None:
    whole = encode(voice_like(2.0), RATE, AudioFormat.FLAC)
    try:
        out = decode(whole[:len(whole) // 2])
    except BadAudio as exc:
        assert "corrupt" in str(exc) or "no samples" in str(exc)
    else:
        assert 0 < out.duration_s < 2.0


def test_openai_speech_formats_map_to_ours_and_aac_is_refused() -> None:
    assert speech_format("pcm") is AudioFormat.PCM16 and speech_format("opus") is AudioFormat.OPUS
    with pytest.raises(BadAudio, match="aac.*libsndfile has no AAC encoder"):
        speech_format("aac")


# ------------------------------------------------------------------ streaming encoders
def stream_out(fmt: AudioFormat, pcm: np.ndarray, *, out_rate: int | None = None) -> tuple[list[bytes], bytes]:
    """(bytes handed out after each 100 ms push, the finishing bytes)."""
    stream = open_stream(fmt, RATE, out_rate=out_rate)
    step = RATE // 10
    pieces = [stream.push(pcm[i:i + step]) for i in range(0, pcm.size, step)]
    return pieces, stream.finish()


def read_back(fmt: AudioFormat, data: bytes) -> tuple[np.ndarray, int]:
    if fmt is AudioFormat.FLAC:       # length unknown in STREAMINFO: libsndfile refuses, ffmpeg reads it
        av = pytest.importorskip("av", reason="decoding a streamed FLAC needs ffmpeg (PyAV, the models extra)")
        with av.open(io.BytesIO(data)) as container:
            frames = [f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]
            return np.concatenate(frames).astype(np.int16), container.streams.audio[0].rate
    pcm, rate = sf.read(io.BytesIO(data), dtype="int16")
    return pcm, rate


@pytest.mark.parametrize("fmt", [AudioFormat.WAV, AudioFormat.FLAC, *LOSSY], ids=lambda f: f.value)
def test_streamed_audio_comes_out_while_it_is_produced_and_decodes_to_it(fmt: AudioFormat) -> None:
    pcm = voice_like(3.0)
    pieces, tail = stream_out(fmt, pcm)
    data = b"".join(pieces) + tail
    early = sum(len(p) for p in pieces[:len(pieces) // 2])
    assert early > 0.2 * len(data), (early, len(data))           # not held back until the end
    got, rate = read_back(fmt, data)
    want = resample(pcm, RATE, rate)
    if fmt in LOSSLESS:
        assert rate == RATE and np.array_equal(got, pcm)
    else:
        assert abs(got.size / rate - 3.0) < 0.15
        assert similarity(got, want, max_lag=3000 * rate // RATE) > 0.9


def test_pcm_streams_at_24k_for_the_realtime_protocol_without_clicks() -> None:
    pcm = voice_like(2.0)
    pieces, tail = stream_out(AudioFormat.PCM16, pcm, out_rate=24000)
    got = np.frombuffer(b"".join(pieces) + tail, dtype="<i2")
    assert np.array_equal(got, resample(pcm, RATE, 24000))        # chunked = converted whole
    assert got.size == -(-pcm.size * 24000 // RATE)


def test_a_finished_stream_takes_no_more_and_an_empty_one_is_still_a_file() -> None:
    stream = open_stream(AudioFormat.WAV, RATE)
    head = stream.finish()
    assert head == wav_header(RATE) and stream.finish() == b""
    with pytest.raises(ValueError, match="finished"):
        stream.push(np.zeros(10, dtype=np.int16))
    assert sf.read(io.BytesIO(head + np.zeros(100, dtype="<i2").tobytes()))[1] == RATE
