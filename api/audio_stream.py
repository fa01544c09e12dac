"""Audio encoded as it is produced, for responses that stream (`/v1/audio/speech`).

`open_stream(fmt, sample_rate)` gives an `AudioStream`: `push(pcm)` returns the bytes that are
ready, `finish()` the rest; the concatenation is one playable file. Per format:

- `pcm16`: raw little-endian int16 samples (OpenAI's `pcm`: pass `out_rate=24000`).
- `wav`: a header whose sizes say "unknown" (0xFFFFFFFF, as OpenAI streams wav), then the
  samples; libsndfile, ffmpeg and browsers read it to its end.
- `ogg` (vorbis), `opus`: libsndfile's encoder, page by page; it never seeks back. Opus at
  48 kHz (resampled) unless the rate is one opus has.
- `mp3`: libsndfile's LAME encoder at a constant bit rate, frame by frame. LAME keeps its
  first frame as a placeholder for a Xing/Info tag that it fills in at the end by seeking back;
  streamed, that frame stays silent (24-72 ms; the encoder delay is not trimmed either), and the
  constant rate keeps decoders' length estimate right without the tag (libsndfile's own reader
  stops early on a variable-rate mp3 without one).
- `flac`: libsndfile's encoder, frame by frame. At the end it would seek back to write the
  length and MD5 into STREAMINFO; streamed, those stay 0, which FLAC defines as "unknown":
  ffmpeg, browsers and the `flac` tool decode it, libsndfile itself refuses a FLAC of unknown
  length (read such a file with another decoder, or ask for wav).

The input rate may be converted on the way (`out_rate`), with a `StreamResampler`: no clicks
at chunk boundaries.
"""
from __future__ import annotations

import io
import struct
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import soundfile as sf

from omniflow.api.audio import ENCODINGS, OPUS_RATE, OPUS_RATES, AudioFormat, media_type, to_int16
from omniflow.resample import StreamResampler

UNKNOWN_SIZE = 0xFFFFFFFF
HEAD_KEPT = 1 << 12                   # bytes kept for an encoder that reads its header back (FLAC)
MP3_COMPRESSION = 0.5                 # LAME at a constant rate: ~80 kbit/s at 22.05 kHz, ~160 at 44.1


class AudioStream(ABC):
    """One stream's encoder: int16 (or float in [-1, 1]) mono in, bytes out as they are ready."""

    def __init__(self, fmt: AudioFormat, sample_rate: int, out_rate: int) -> None:
        self.format, self.sample_rate, self.out_rate = fmt, sample_rate, out_rate
        self.media_type = media_type(fmt)
        self._resampler = StreamResampler(sample_rate, out_rate) if out_rate != sample_rate else None
        self._finished = False

    def push(self, pcm: np.ndarray) -> bytes:
        """The bytes the stream has ready after these samples."""
        if self._finished:
            raise ValueError("the audio stream is finished")
        samples = to_int16(np.asarray(pcm))
        if self._resampler is not None:
            samples = self._resampler.push(samples)
        return self._encode(samples)

    def finish(self) -> bytes:
        """The stream's last bytes; later calls return nothing."""
        if self._finished:
            return b""
        self._finished = True
        tail = self._encode(self._resampler.flush()) if self._resampler is not None else b""
        return tail + self._close()

    @abstractmethod
    def _encode(self, samples: np.ndarray) -> bytes:
        """int16 samples at `out_rate` -> the bytes ready now."""

    def _close(self) -> bytes:
        return b""


class PcmStream(AudioStream):
    def _encode(self, samples: np.ndarray) -> bytes:
        return samples.astype("<i2").tobytes()


class WavStream(AudioStream):
    """A RIFF header with unknown sizes, then raw samples."""

    def __init__(self, fmt: AudioFormat, sample_rate: int, out_rate: int) -> None:
        super().__init__(fmt, sample_rate, out_rate)
        self._header: bytes | None = wav_header(out_rate)

    def _encode(self, samples: np.ndarray) -> bytes:
        head, self._header = self._header or b"", None
        return head + samples.astype("<i2").tobytes()

    def _close(self) -> bytes:
        head, self._header = self._header or b"", None        # an empty stream is still a wav
        return head


class _Sink(io.RawIOBase):
    """Where libsndfile writes: bytes appended at the end are handed out by `take()`; writes behind
    the end (an encoder patching its header at close) are dropped, reads see only the kept head."""

    def __init__(self) -> None:
        super().__init__()
        self._pos = self._end = 0
        self._ready = bytearray()
        self._head = bytearray()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        new = data[max(0, self._end - self._pos):] if self._pos + len(data) > self._end else b""
        self._ready += new                  # (what lands behind the end was sent already: dropped)
        self._end += len(new)
        if len(self._head) < HEAD_KEPT:
            self._head += new[:HEAD_KEPT - len(self._head)]
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: self._end + offset}[whence]
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        data = self._head[self._pos:self._pos + len(buffer)] if self._pos < len(self._head) else b""
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def take(self) -> bytes:
        out, self._ready = bytes(self._ready), bytearray()
        return out


class SndfileStream(AudioStream):
    """libsndfile's encoder writing into a `_Sink` (ogg vorbis, opus, mp3, flac)."""

    def __init__(self, fmt: AudioFormat, sample_rate: int, out_rate: int) -> None:
        super().__init__(fmt, sample_rate, out_rate)
        container, subtype, _ = ENCODINGS[fmt]
        self._sink = _Sink()
        extra: dict[str, Any] = {}
        if fmt is AudioFormat.MP3:
            extra = {"compression_level": MP3_COMPRESSION, "bitrate_mode": "CONSTANT"}
        self._file = sf.SoundFile(self._sink, "w", samplerate=out_rate, channels=1, format=container,
                                  subtype=subtype, **extra)

    def _encode(self, samples: np.ndarray) -> bytes:
        if samples.size:
            self._file.write(samples)
        return self._sink.take()

    def _close(self) -> bytes:
        self._file.close()
        return self._sink.take()


def open_stream(fmt: AudioFormat, sample_rate: int, *, out_rate: int | None = None) -> AudioStream:
    """A streaming encoder for `fmt`, fed at `sample_rate`, writing at `out_rate` (default: the same;
    opus at 48 kHz unless the rate is one opus has)."""
    rate = out_rate or sample_rate
    if fmt is AudioFormat.OPUS and rate not in OPUS_RATES:
        rate = OPUS_RATE
    if fmt is AudioFormat.PCM16:
        return PcmStream(fmt, sample_rate, rate)
    if fmt is AudioFormat.WAV:
        return WavStream(fmt, sample_rate, rate)
    return SndfileStream(fmt, sample_rate, rate)


def wav_header(sample_rate: int, *, data_bytes: int = UNKNOWN_SIZE) -> bytes:
    """A 44-byte RIFF/WAVE header for int16 mono (sizes 0xFFFFFFFF: unknown, the stream runs to its end)."""
    riff = UNKNOWN_SIZE if data_bytes == UNKNOWN_SIZE else 36 + data_bytes
    fmt = struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", riff) + b"WAVE" + b"fmt " + fmt + b"data" + struct.pack("<I", data_bytes)
