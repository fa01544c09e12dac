"""Whisper's encoder window: the words heard and the time taken, 30 s against shorter windows.

Whisper's encoder reads 30 s of log-mel frames, padded with silence; on a CPU that pass is most
of a short utterance's time. `workers/asr.py` encodes an utterance that ends 3 s before
`window_s` in a `window_s` window (the padding cut, never the speech). This measures what that
costs in words: the Piper voice (the TTS pipeline's executors, in process) says 24 sentences
(0.6-5.9 s: one word to a long request), each also with white noise at 15 dB SNR and sped up
and slowed down by 15 % (resampled), 96 utterances and 808 words; Whisper base (int8, greedy,
language en) recognises each one in each window, and a word error rate is counted against the
sentence said (numbers as Whisper writes them count as errors: "7.30" for "seven thirty").

    .venv/bin/python bench/asr_window.py [--threads 2] [--windows 30,10,15,+3] [--clean] [--guard]

A window `W` is W seconds for utterances up to W - 3 s (the rest get 30); `+M` is the utterance
itself plus M seconds, the cut the literature warns about (the decoder repeats itself or stops
early). `--guard` adds `workers/asr.py`'s fallback: a degenerate transcript is recognised again
in the full window (counted). It prints one row per window; bench/notes.md has the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

SENTENCES = [
    "Why is the sky blue?",
    "What is the capital of France? Tell me in one sentence, please.",
    "The quick brown fox jumps over the lazy dog.",
    "Nothing is lost when a worker dies.",
    "How many legs does a spider have?",
    "Please turn off the lights in the kitchen.",
    "Can you recommend a good book about the history of Rome?",
    "My flight to Berlin leaves at seven thirty tomorrow morning.",
    "What's the difference between a violin and a viola?",
    "Set a timer for twelve minutes.",
    "Explain how photosynthesis works in simple terms.",
    "Who wrote the novel Pride and Prejudice?",
    "I would like to order two large pizzas with extra cheese.",
    "Is it going to rain in London this weekend?",
    "Translate good morning into Spanish.",
    "The meeting has been moved to Thursday afternoon at three.",
    "Tell me a short joke about computers.",
    "How far is the moon from the earth?",
    "Remind me to call my mother on Sunday.",
    "What are the three primary colors?",
    "Yes.",
    "Stop.",
    "Play some relaxing jazz music in the living room, and lower the volume a little bit after ten minutes.",
    "Could you summarise the main arguments of the article I sent you yesterday about renewable energy "
    "policy in Europe?",
]
RATE = 16000


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def errors(said: str, heard: str) -> tuple[int, int]:
    """(word edit distance, words said)."""
    ref, hyp = words(said), words(heard)
    row = list(range(len(hyp) + 1))
    for i in range(1, len(ref) + 1):
        prev, row[0] = row[0], i
        for j in range(1, len(hyp) + 1):
            cur = row[j]
            row[j] = min(row[j] + 1, row[j - 1] + 1, prev + (ref[i - 1] != hyp[j - 1]))
            prev = cur
    return row[len(hyp)], len(ref)


async def speak(texts: list[str]) -> list[np.ndarray]:
    """The Piper voice saying each text, as float32 at 16 kHz."""
    from omniflow.resample import resample
    from omniflow.testing import FakeSession, run_executor
    from omniflow.workers.voice import PiperCode2Wav, PiperTalker

    talker, code2wav = PiperTalker(stage="talker", params={}), PiperCode2Wav(stage="code2wav", params={})
    await talker.setup()
    await code2wav.setup()
    out = []
    for text in texts:
        said = FakeSession(input={"text": text}, stage="talker", finals=("code2wav",), downstream=("code2wav",))
        await run_executor(talker, said)
        heard = FakeSession(stage="code2wav", chunks=[("talker", z) for z in said.data_to("code2wav")])
        await run_executor(code2wav, heard)
        out.append(resample(heard.audio_out.astype(np.float32) / 32768, code2wav.voice.sample_rate, RATE))
    return out


def variants(clean: list[np.ndarray]) -> list[np.ndarray]:
    """Each utterance clean, with white noise at 15 dB SNR, 15 % faster and 15 % slower."""
    rng = np.random.default_rng(0)
    noisy = [a + rng.normal(0, np.sqrt(np.mean(a ** 2) / 10 ** 1.5), a.size).astype(np.float32) for a in clean]
    faster = [np.interp(np.arange(0, a.size - 1, 1.15), np.arange(a.size), a).astype(np.float32) for a in clean]
    slower = [np.interp(np.arange(0, a.size - 1, 0.85), np.arange(a.size), a).astype(np.float32) for a in clean]
    return clean + noisy + faster + slower


def frames_for(window: str, seconds: float) -> int | None:
    """The encoder frames for an utterance (None: the full 30 s)."""
    from omniflow.workers.asr import FRAMES_PER_S, FULL_WINDOW_S, window_frames

    if window.startswith("+"):
        return min(FULL_WINDOW_S * FRAMES_PER_S, int(np.ceil((seconds + float(window)) * FRAMES_PER_S)))
    return window_frames(seconds, float(window))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--windows", default="30,10,15,+3")
    parser.add_argument("--clean", action="store_true", help="the clean utterances only (24)")
    parser.add_argument("--guard", action="store_true", help="recognise a degenerate transcript again in 30 s")
    args = parser.parse_args()

    from faster_whisper import WhisperModel

    from omniflow.workers import asr, weights

    clean = asyncio.run(speak(SENTENCES))
    audios = clean if args.clean else variants(clean)
    said = SENTENCES * (len(audios) // len(SENTENCES))
    model = asr.windowed(WhisperModel)(str(weights.whisper_base()), device="cpu", compute_type="int8",
                                        cpu_threads=args.threads, num_workers=1, local_files_only=True)

    def recognise(samples: np.ndarray, frames: int | None) -> str:
        model.window_frames = frames
        segments, _ = model.transcribe(samples, language="en", beam_size=1, temperature=[0.0],
                                       vad_filter=False, condition_on_previous_text=True)
        return " ".join(segment.text.strip() for segment in segments)

    recognise(audios[0], None)          # warm-up
    print(f"{len(audios)} utterances, {sum(len(words(s)) for s in said)} words; Whisper base int8, "
          f"{args.threads} thread(s), greedy")
    print("| window | word errors | WER | median ms | total s | fallbacks |")
    print("|---|---:|---:|---:|---:|---:|")
    for window in args.windows.split(","):
        wrong = total = fallbacks = 0
        times: list[float] = []
        for text, samples in zip(said, audios, strict=True):
            seconds = samples.size / RATE
            frames = frames_for(window, seconds)
            started = time.perf_counter()
            heard = recognise(samples, frames)
            if args.guard and frames is not None and asr.degenerate(heard, seconds):
                fallbacks += 1
                heard = recognise(samples, None)
            times.append(time.perf_counter() - started)
            e, n = errors(text, heard)
            wrong, total = wrong + e, total + n
            if e > 2:
                print(f"  window {window}, {seconds:.1f} s, {e} errors: {heard[:100]!r}", file=sys.stderr)
        label = f"utterance {window} s" if window.startswith("+") else f"{window} s"
        print(f"| {label} | {wrong} / {total} | {wrong / total:.1%} | {statistics.median(times) * 1000:.0f} "
              f"| {sum(times):.1f} | {fallbacks if args.guard else '–'} |")


if __name__ == "__main__":
    main()
