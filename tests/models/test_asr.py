"""WhisperASR on the real Whisper base: it hears what the Piper voice (the TTS pipeline's
executors, in process) says, streamed audio gives the text of one chunk and is recognised
before it ends, and bad audio fails the session with a clear error."""
from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import numpy as np
import pytest

from helpers import eventually
from omniflow.engine.session import Chunk
from omniflow.errors import NonRetryableError
from omniflow.testing import FakeSession, run_executor

pytest.importorskip("faster_whisper", reason="the models extra is not installed: run `make models`")

QUESTION = "What is the capital of France? Tell me in one sentence, please."
TWO_SENTENCES = ("The quick brown fox jumps over the lazy dog.", "Nothing is lost when a worker dies.")
UPLOAD_PIECE = 32768            # samples: a 64 KiB upload piece


def words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def recall(said: str, heard: str) -> float:
    want, got = words(said), set(words(heard))
    return sum(w in got for w in want) / len(want)


def audio_chunks(pcm: np.ndarray, rate: int, size: int) -> list[tuple[str, dict[str, Any]]]:
    return [("@input", {"pcm": pcm[i:i + size], "sample_rate": rate}) for i in range(0, pcm.size, size)]


def asr_session(chunks: Any = (), *, live: bool = False, **params: Any) -> FakeSession:
    return FakeSession(stage="asr", upstream=("@input",), downstream=("thinker",), chunks=chunks, live=live,
                       params=params)


@pytest.fixture(scope="module")
async def question(speaker: Any) -> np.ndarray:
    return await speaker.speak(QUESTION)


@pytest.fixture(scope="module")
async def two_sentences(speaker: Any) -> np.ndarray:
    """The two sentences with the pause a speaker takes between them (0.5 s)."""
    first, second = [await speaker.speak(s) for s in TWO_SENTENCES]
    return np.concatenate([first, np.zeros(speaker.sample_rate // 2, dtype=np.int16), second])


CUT_EARLY = {"min_utterance_s": 2.0}         # a cut at the pause after the first sentence


@pytest.fixture(scope="module")
async def two_sentences_heard(whisper: Any, speaker: Any, two_sentences: np.ndarray) -> FakeSession:
    """The two sentences recognised from one chunk (shared: Whisper runs are the slow part)."""
    session = asr_session(audio_chunks(two_sentences, speaker.sample_rate, two_sentences.size), **CUT_EARLY)
    usage = await run_executor(whisper, session)
    assert usage is not None and usage["utterances"] >= 2
    return session


async def test_whisper_hears_what_the_piper_voice_says(whisper: Any, speaker: Any, question: np.ndarray) -> None:
    session = asr_session(audio_chunks(question, speaker.sample_rate, UPLOAD_PIECE))
    usage = await run_executor(whisper, session)
    assert recall(QUESTION, session.text_out) >= 0.8, session.text_out     # measured: every word
    assert "".join(d["text"] for d in session.data_to("thinker")) == session.text_out
    assert usage is not None
    assert usage["audio_seconds"] == pytest.approx(question.size / speaker.sample_rate, abs=1e-3)
    assert usage["words"] == len(session.text_out.split()) and usage["segments"] >= 1
    assert usage["language"] == "en" and usage["rtf"] > 0
    assert " ".join(t["text"] for t in usage["timeline"]) == session.text_out
    assert 0 <= usage["timeline"][0]["start"] < usage["timeline"][-1]["end"] <= usage["audio_seconds"]


@pytest.mark.timeout(360)       # Whisper on a loaded 2-core machine: over the suite's 120 s
async def test_a_stream_in_20ms_chunks_gives_the_text_of_one_chunk_and_is_heard_before_it_ends(
        whisper: Any, speaker: Any, two_sentences: np.ndarray, two_sentences_heard: FakeSession) -> None:
    rate, whole = speaker.sample_rate, two_sentences_heard
    assert recall(" ".join(TWO_SENTENCES), whole.text_out) >= 0.8, whole.text_out

    live = asr_session(live=True, **CUT_EARLY)
    running = asyncio.ensure_future(run_executor(whisper, live))
    pieces = audio_chunks(two_sentences, rate, rate // 50)
    held_back = len(pieces) // 4          # the last quarter arrives only once text has come out
    for seq, (src, data) in enumerate(pieces[:-held_back], start=1):
        live.feed(Chunk(src, seq, 1, data))

    async def heard_something() -> bool:
        assert not running.done() or running.exception() is None
        return bool(live.text_out)

    await eventually(heard_something, timeout_s=60)
    early = live.text_out
    for seq, (src, data) in enumerate(pieces[-held_back:], start=len(pieces) - held_back + 1):
        live.feed(Chunk(src, seq, 1, data))
    live.feed(None)
    await asyncio.wait_for(running, timeout=60)
    assert live.text_out == whole.text_out
    assert early and whole.text_out.startswith(early) and len(early) < len(whole.text_out)


async def test_a_retry_emits_only_what_the_lost_attempt_had_not_written(whisper: Any,
                                                                        two_sentences_heard: FakeSession) -> None:
    whole = two_sentences_heard
    assert len(whole.emitted) >= 2
    crashed = asr_session(whole.chunks, **CUT_EARLY)
    crashed.emitted, crashed.seq = whole.emitted[:1], 1             # the attempt died after its first segment
    retry = crashed.retried()
    await run_executor(whisper, retry)
    assert crashed.text_out + retry.text_out == whole.text_out and retry.text_out


def encoder_positions(whisper: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The encoder output length of each pass the model makes from now on (1,500 for a 30 s window)."""
    seen: list[int] = []
    encode = whisper.model.encode

    def spy(features: Any) -> Any:
        output = encode(features)
        seen.append(output.shape[1])
        return output

    monkeypatch.setattr(whisper.model, "encode", spy)
    return seen


async def test_a_short_utterance_is_encoded_in_a_short_window_and_heard_the_same(
        whisper: Any, speaker: Any, question: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    positions = encoder_positions(whisper, monkeypatch)
    heard: dict[float, str] = {}
    for window_s in (10, 30):
        session = asr_session(audio_chunks(question, speaker.sample_rate, UPLOAD_PIECE), window_s=window_s)
        usage = await run_executor(whisper, session)
        assert usage is not None and usage["window_fallbacks"] == 0
        heard[window_s] = session.text_out
    assert positions == [500, 1500]             # one pass each: 10 s and 30 s of frames, halved by the encoder
    assert recall(QUESTION, heard[10]) >= 0.8 and words(heard[10]) == words(heard[30]), heard


async def test_a_degenerate_transcript_in_the_short_window_is_recognised_again_in_the_full_one(
        whisper: Any, speaker: Any, question: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    from omniflow.workers import asr

    positions = encoder_positions(whisper, monkeypatch)
    monkeypatch.setattr(asr, "degenerate", lambda text, seconds: True)
    session = asr_session(audio_chunks(question, speaker.sample_rate, UPLOAD_PIECE))
    usage = await run_executor(whisper, session)
    assert usage is not None and usage["window_fallbacks"] == 1 and usage["utterances"] == 1
    assert positions == [500, 1500]
    assert recall(QUESTION, session.text_out) >= 0.8, session.text_out
    assert len(session.emitted) == usage["segments"]        # the short window's segments were not emitted


async def test_the_sessions_loop_stays_free_while_whisper_runs(whisper: Any, speaker: Any, question: np.ndarray) -> None:
    """Whisper runs on its own thread: the loop the sessions share goes on (another session's input,
    the end of one whose text is out) while a pass runs. Measured as the longest stall of a ticker
    on that loop against the time the pass took, in one run."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticking = asyncio.ensure_future(ticker())
    session = asr_session(audio_chunks(question, speaker.sample_rate, question.size), window_s=30)
    usage = await run_executor(whisper, session)
    stop.set()
    await ticking
    assert usage is not None and usage["compute_s"] > 0 and recall(QUESTION, session.text_out) >= 0.8
    assert max(gaps) < 0.5 * usage["compute_s"], (max(gaps), usage["compute_s"])     # blocked: >= 1x


async def test_audio_over_one_window_is_recognised_window_by_window(
        whisper: Any, speaker: Any, two_sentences: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    """With `vad: false`, audio over 30 s is one utterance of several of Whisper's windows: its segments
    are taken from the model's thread one at a time, each window as it is decoded."""
    positions = encoder_positions(whisper, monkeypatch)
    long = np.concatenate([two_sentences] * (int(31 * speaker.sample_rate / two_sentences.size) + 1))
    session = asr_session(audio_chunks(long, speaker.sample_rate, UPLOAD_PIECE), vad=False)
    usage = await run_executor(whisper, session)
    assert usage is not None and usage["utterances"] == 1 and usage["audio_seconds"] > 30
    assert len(positions) >= 2 and set(positions) == {1500}         # full windows, more than one
    assert usage["segments"] >= 2 and recall(" ".join(TWO_SENTENCES), session.text_out) >= 0.8, session.text_out


async def test_a_session_cancelled_during_its_pass_leaves_the_model_to_the_next(
        whisper: Any, speaker: Any, question: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    """A barge-in cancels a session while Whisper's pass for it runs on the model's thread: the pass
    ends there unread, and the next session gets the model and its own words."""
    loop = asyncio.get_running_loop()
    passing = asyncio.Event()
    encode = whisper.model.encode

    def spy(features: Any) -> Any:
        loop.call_soon_threadsafe(passing.set)
        return encode(features)

    monkeypatch.setattr(whisper.model, "encode", spy)
    chunks = audio_chunks(question, speaker.sample_rate, question.size)
    cancelled = asyncio.ensure_future(run_executor(whisper, asr_session(chunks, window_s=30)))
    await asyncio.wait_for(passing.wait(), timeout=60)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    after = asr_session(chunks)
    usage = await asyncio.wait_for(run_executor(whisper, after), timeout=120)
    assert usage is not None and usage["utterances"] == 1
    assert recall(QUESTION, after.text_out) >= 0.8, after.text_out


def test_a_transcript_that_repeats_itself_or_outruns_the_speech_is_degenerate() -> None:
    from omniflow.workers.asr import degenerate

    assert degenerate("Stop " * 40, 0.6)                                   # seen at a window cut to 1.6 s
    assert degenerate("set a timer for 12 minutes. " * 5, 1.7)
    assert degenerate("one two three four five six seven", 0.5)           # 7 words in half a second
    assert not degenerate("Set a timer for 12 minutes.", 1.7)
    assert not degenerate(QUESTION, 3.8) and not degenerate("", 1.0)
    assert not degenerate("Could you summarize the main arguments of the article I sent you yesterday "
                          "about renewable energy policy in Europe?", 5.6)


async def test_silence_is_not_sent_to_whisper(whisper: Any) -> None:
    rng = np.random.default_rng(0)
    hiss = (rng.standard_normal(16000 * 3) * 30).astype(np.int16)         # 3 s at -60 dBFS
    session = asr_session(audio_chunks(hiss, 16000, 1600))
    usage = await run_executor(whisper, session)
    assert usage is not None and usage["utterances"] == 0 and session.text_out == ""
    assert usage["audio_seconds"] == 3.0


async def test_silero_probabilities_do_not_depend_on_the_chunking(speaker: Any, question: np.ndarray) -> None:
    from omniflow.resample import resample
    from omniflow.workers.vad import BATCH, SileroVAD

    samples = resample(question.astype(np.float32) / 32768, speaker.sample_rate, 16000)
    vad = SileroVAD()
    whole = vad.stream().push(samples)
    stream, parts, i = vad.stream(), [], 0
    for size in np.random.default_rng(1).integers(1, 3000, 10_000):
        parts.append(stream.push(samples[i:i + size]))
        i += size
        if i >= samples.size:
            break
    streamed = np.concatenate(parts)                 # (up to BATCH - 1 windows still wait for more)
    assert whole.size - BATCH < streamed.size <= whole.size and np.array_equal(streamed, whole[:streamed.size])
    assert whole.size == samples.size // 512 and whole.max() > 0.9 and whole.min() < 0.1


TONE = (np.sin(np.arange(8000) / 5) * 3000).astype(np.int16)


@pytest.mark.parametrize(("chunks", "params", "message"), [
    ([("@input", b"RIFF....")], {}, "is not {'pcm'"),
    ([("@input", {"pcm": TONE})], {}, "is not {'pcm'"),
    ([("@input", {"pcm": TONE.astype(np.float32), "sample_rate": 16000})], {}, "got float32"),
    ([("@input", {"pcm": np.stack([TONE, TONE], axis=1), "sample_rate": 16000})], {}, "one dimension"),
    ([("@input", {"pcm": TONE.tobytes(), "sample_rate": 16000})], {}, "got bytes"),
    ([("@input", {"pcm": TONE, "sample_rate": 0})], {}, "sample_rate must be an integer in 8000..192000"),
    ([("@input", {"pcm": TONE, "sample_rate": 10 ** 6})], {}, "8000..192000 Hz, got 1000000"),
    ([("@input", {"pcm": TONE, "sample_rate": "16k"})], {}, "got '16k'"),
    ([("@input", {"pcm": TONE, "sample_rate": 16000}), ("@input", {"pcm": TONE, "sample_rate": 24000})], {},
     "changed from 16000 to 24000"),
    ([("@input", {"pcm": TONE, "sample_rate": 8000})] * 3, {"max_audio_s": 2}, "longer than this stage's limit of 2 s"),
    ([("@input", {"pcm": TONE[:0], "sample_rate": 16000})], {}, "no audio"),
    ([], {}, "no audio"),
    ([("thinker", {"text": "hi"})], {}, "reads the client's audio"),
    ([("@input", {"pcm": TONE, "sample_rate": 16000})], {"beam_size": 0}, "beam_size"),
    ([("@input", {"pcm": TONE, "sample_rate": 16000})], {"temperature": 2}, "temperature"),
    ([("@input", {"pcm": TONE, "sample_rate": 16000})], {"language": "klingon"}, "unknown language"),
    ([("@input", {"pcm": TONE, "sample_rate": 16000})], {"vad": "maybe"}, "vad must be true or false"),
    ([("@input", {"pcm": TONE, "sample_rate": 16000})], {"min_utterance_s": 40}, "max_utterance_s <= 30"),
    ([("@input", {"pcm": TONE, "sample_rate": 16000})], {"window_s": 40}, "window_s must be in 3..30 seconds, got 40"),
], ids=["bytes", "no-rate", "float", "stereo", "pcm-bytes", "rate-0", "rate-absurd", "rate-str", "rate-changes",
        "too-long", "empty-chunk", "no-chunks", "not-input", "beam", "temperature", "language", "vad", "utterance", "window"])
async def test_bad_audio_fails_the_session_with_one_clear_error(whisper: Any, chunks: Any, params: dict[str, Any],
                                                                 message: str) -> None:
    session = asr_session(chunks, **params)
    with pytest.raises(NonRetryableError, match=re.escape(message)):
        await run_executor(whisper, session)
    assert session.text_out == ""
