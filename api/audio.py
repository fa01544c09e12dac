"""PCM (int16 mono) -> an audio file in memory, with soundfile (libsndfile)."""
from __future__ import annotations

import io
from enum import Enum

import numpy as np
import soundfile as sf


class AudioFormat(str, Enum):
    WAV = "wav"
    FLAC = "flac"
    OGG = "ogg"
    OPUS = "opus"
    MP3 = "mp3"
    PCM16 = "pcm16"


# format -> (libsndfile container, subtype, media type)
_ENCODINGS: dict[AudioFormat, tuple[str, str, str]] = {
    AudioFormat.WAV: ("WAV", "PCM_16", "audio/wav"),
    AudioFormat.FLAC: ("FLAC", "PCM_16", "audio/flac"),
    AudioFormat.OGG: ("OGG", "VORBIS", "audio/ogg"),
    AudioFormat.OPUS: ("OGG", "OPUS", "audio/ogg; codecs=opus"),
    AudioFormat.MP3: ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def media_type(fmt: AudioFormat) -> str:
    return "audio/L16" if fmt is AudioFormat.PCM16 else _ENCODINGS[fmt][2]


def _resample(pcm: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    if src_rate == dst_rate or pcm.size == 0:
        return pcm
    n = max(1, round(pcm.size * dst_rate / src_rate))
    x = np.linspace(0, pcm.size - 1, n)
    return np.interp(x, np.arange(pcm.size), pcm.astype(np.float64)).astype(np.int16)


def encode(pcm: np.ndarray, sample_rate: int, fmt: AudioFormat) -> bytes:
    """Encode int16 mono PCM; raw little-endian samples for `pcm16`."""
    samples = np.asarray(pcm, dtype="<i2")
    if fmt is AudioFormat.PCM16:
        return samples.tobytes()
    container, subtype, _ = _ENCODINGS[fmt]
    if fmt is AudioFormat.OPUS and sample_rate not in OPUS_RATES:
        samples, sample_rate = _resample(samples, sample_rate, 48000), 48000
    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()
