"""Audio files in memory, with soundfile (libsndfile 1.2): int16 mono PCM to wav/flac/ogg/opus/mp3
(`encode`), and an upload in any format libsndfile reads (wav, flac, ogg vorbis/opus, mp3, aiff,
...) back to int16 mono at the rate a stage wants (`decode`). Streaming encoders are in
`omniflow.api.audio_stream`.

Limits on uploads are module constants (the routes may pass their own): `MAX_UPLOAD_BYTES` (25 MiB,
OpenAI's limit for transcriptions) and `MAX_UPLOAD_S` (600 s, the ASR stage's `max_audio_s`).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from enum import Enum

import numpy as np
import soundfile as sf

from omniflow.errors import InvalidRequest
from omniflow.resample import MAX_RATE_HZ, resample


class AudioFormat(str, Enum):
    WAV = "wav"
    FLAC = "flac"
    OGG = "ogg"
    OPUS = "opus"
    MP3 = "mp3"
    PCM16 = "pcm16"


class BadAudio(InvalidRequest):
    """Raised when an upload is empty, not audio libsndfile can read, corrupt, or over a limit (HTTP 4xx)."""


# format -> (libsndfile container, subtype, media type)
ENCODINGS: dict[AudioFormat, tuple[str, str, str]] = {
    AudioFormat.WAV: ("WAV", "PCM_16", "audio/wav"),
    AudioFormat.FLAC: ("FLAC", "PCM_16", "audio/flac"),
    AudioFormat.OGG: ("OGG", "VORBIS", "audio/ogg"),
    AudioFormat.OPUS: ("OGG", "OPUS", "audio/ogg; codecs=opus"),
    AudioFormat.MP3: ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
OPUS_RATE = 48000                    # what other rates are resampled to for opus
MAX_UPLOAD_BYTES = 25 * 1024 * 1024
MAX_UPLOAD_S = 600.0
MIN_RATE_HZ = 1000
DECODE_BLOCK = 1 << 16               # frames read at a time (files may not say how long they are)
# OpenAI's `/v1/audio/speech` response_format -> ours ("pcm" is pcm16 at 24 kHz there)
SPEECH_FORMATS = {"wav": AudioFormat.WAV, "flac": AudioFormat.FLAC, "opus": AudioFormat.OPUS,
                  "mp3": AudioFormat.MP3, "pcm": AudioFormat.PCM16}
OPENAI_PCM_RATE = 24000


@dataclass(frozen=True)
class DecodedAudio:
    """An upload as int16 mono samples."""

    pcm: np.ndarray
    sample_rate: int
    source_rate: int          # the file's own rate
    source_format: str        # libsndfile's name for the container (WAV, MP3, FLAC, OGG, ...)
    channels: int             # the file's channels (mixed down to one)

    @property
    def duration_s(self) -> float:
        return self.pcm.size / self.sample_rate


def media_type(fmt: AudioFormat) -> str:
    return "audio/L16" if fmt is AudioFormat.PCM16 else ENCODINGS[fmt][2]


def speech_format(name: str) -> AudioFormat:
    """OpenAI's speech `response_format` as ours; BadAudio for the ones libsndfile cannot write (aac)."""
    try:
        return SPEECH_FORMATS[name]
    except KeyError:
        raise BadAudio(f"audio format {name!r} is not supported: use one of {', '.join(SPEECH_FORMATS)}"
                       + (" (libsndfile has no AAC encoder)" if name == "aac" else "")) from None


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] (clipped) or int16, as int16."""
    if samples.dtype == np.int16:
        return samples
    return np.clip(np.rint(np.asarray(samples, dtype=np.float64) * 32767), -32768, 32767).astype(np.int16)


def encode(pcm: np.ndarray, sample_rate: int, fmt: AudioFormat) -> bytes:
    """Encode int16 mono PCM; raw little-endian samples for `pcm16`."""
    samples = np.asarray(pcm, dtype="<i2")
    if fmt is AudioFormat.PCM16:
        return samples.tobytes()
    container, subtype, _ = ENCODINGS[fmt]
    if fmt is AudioFormat.OPUS and sample_rate not in OPUS_RATES:
        samples, sample_rate = resample(samples, sample_rate, OPUS_RATE), OPUS_RATE
    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def decode(data: bytes, *, sample_rate: int | None = None, max_bytes: int = MAX_UPLOAD_BYTES,
           max_seconds: float = MAX_UPLOAD_S) -> DecodedAudio:
    """An uploaded file as int16 mono at `sample_rate` (None: the file's own rate).

    Channels are mixed down (their mean); BadAudio names what is wrong: empty, over `max_bytes`,
    not a format libsndfile reads, corrupt, no samples, or longer than `max_seconds`.
    """
    if not data:
        raise BadAudio("the audio is empty (0 bytes)")
    if len(data) > max_bytes:
        raise BadAudio(f"the audio is {len(data)} bytes, over the limit of {max_bytes} bytes")
    if sample_rate is not None and not MIN_RATE_HZ <= sample_rate <= MAX_RATE_HZ:
        raise ValueError(f"sample_rate must be in {MIN_RATE_HZ}..{MAX_RATE_HZ} Hz, got {sample_rate}")
    try:
        file = sf.SoundFile(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise BadAudio(f"not audio that can be decoded (wav, flac, ogg, mp3, ...): {_reason(exc)}") from exc
    with file:
        rate, channels, container = file.samplerate, file.channels, file.format
        if not MIN_RATE_HZ <= rate <= MAX_RATE_HZ or channels < 1:
            raise BadAudio(f"the audio says it has {channels} channel(s) at {rate} Hz: not something to decode")
        limit = int(max_seconds * rate)
        if 0 < file.frames < (1 << 62) and file.frames > limit:      # huge: the length is not known
            raise BadAudio(f"the audio is {file.frames / rate:.1f} s long, over the limit of {max_seconds:g} s")
        blocks, total = [], 0
        try:
            while total <= limit:
                block = file.read(DECODE_BLOCK, dtype="float32", always_2d=True)
                if not len(block):
                    break
                blocks.append(block.mean(axis=1) if channels > 1 else block[:, 0])
                total += len(block)
        except (sf.LibsndfileError, RuntimeError) as exc:
            raise BadAudio(f"the audio is corrupt ({container}): {_reason(exc)}") from exc
    if total == 0:
        raise BadAudio(f"the audio holds no samples ({container})")
    if total > limit:
        raise BadAudio(f"the audio is longer than the limit of {max_seconds:g} s")
    samples = np.concatenate(blocks)
    if sample_rate is not None and sample_rate != rate:
        samples = resample(samples, rate, sample_rate)
    return DecodedAudio(pcm=to_int16(samples), sample_rate=sample_rate or rate, source_rate=rate,
                        source_format=container, channels=channels)


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
