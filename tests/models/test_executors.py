"""The CPU omni executors: HFThinker on a tiny random Llama (FakeSession and through the engine),
PiperTalker + PiperCode2Wav on the shipped voice."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omniflow.testing import FakeSession, run_executor, run_many
from omniflow.workers.thinker import HFThinker, checkpointed_ids, clause_ends

PROMPT = "Tell me about durable queues and workers, please."


def thinker(model_dir: Path, **params: Any) -> HFThinker:
    return HFThinker(stage="thinker", params={"model": str(model_dir), "clause_min_words": 2,
                                              "clause_max_words": 6, **params})


def session(text: str = PROMPT, **params: Any) -> FakeSession:
    return FakeSession(input={"text": text}, stage="thinker", finals=("thinker",), downstream=("talker",),
                       params={"max_tokens": 40, "temperature": 1.0, "seed": 1, **params})


@pytest.fixture(scope="module")
async def hf_thinker(tiny_lm_dir: Path) -> HFThinker:
    executor = thinker(tiny_lm_dir)
    await executor.setup()
    return executor


def test_clause_ends_at_punctuation_before_a_space_or_when_too_long() -> None:
    kw = {"min_words": 3, "max_words": 8}
    assert clause_ends("The sky is blue,", " because", **kw)
    assert not clause_ends("It costs 3.", "50", **kw)              # not inside a number
    assert not clause_ends("Hi,", " you", **kw)                    # too short to speak alone
    assert clause_ends("one two three four five six seven eight", " nine", **kw)
    assert clause_ends("anything", None, **kw)                     # the end of the answer


def test_the_first_chunk_ends_after_its_first_words_punctuation_or_not() -> None:
    kw = {"min_words": 3, "max_words": 8, "first_words": 3}
    assert not clause_ends("The sky", " is", **kw)
    assert clause_ends("The sky is", " blue", **kw)                # at a word boundary, no punctuation
    assert not clause_ends("The sky is", "n't", **kw)              # never inside a word
    assert not clause_ends("The sky is", " blue", min_words=3, max_words=8)   # the others: whole clauses


async def test_a_small_first_chunk_then_clauses_and_resume_cuts_them_the_same(tiny_lm_dir: Path) -> None:
    """`first_chunk_words`: the first chunk to the Talker holds the first words; a retry that resumes
    after it (or inside it) cuts every chunk where the uninterrupted run did."""
    executor = thinker(tiny_lm_dir, first_chunk_words=2)
    await executor.setup()
    full = session()
    await run_executor(executor, full)
    chunks = [c["text"] for c in full.data_to("talker")]
    assert len(chunks) >= 2 and len(chunks[0].split()) == 2
    assert "".join(chunks) == full.text_out
    for written in (1, len(full.emitted) // 2):
        crashed = session()
        crashed.emitted = full.emitted[:written]
        crashed.seq = written
        retry = crashed.retried()
        await run_executor(executor, retry)
        assert [c["text"] for c in crashed.data_to("talker") + retry.data_to("talker")] == chunks


async def test_thinker_streams_text_and_clauses_with_their_hidden_states(hf_thinker: HFThinker) -> None:
    s = session()
    usage = await run_executor(hf_thinker, s)
    assert usage is not None and usage["completion_tokens"] > 5
    clauses = s.data_to("talker")
    assert len(clauses) >= 2
    assert "".join(c["text"] for c in clauses) == s.text_out            # every word goes to the talker once
    assert sum(len(c["token_ids"]) for c in clauses) == usage["completion_tokens"]
    for clause in clauses:
        assert str(clause["hidden"].dtype) == "torch.float32"
        assert tuple(clause["hidden"].shape) == (len(clause["token_ids"]), hf_thinker.lm.hidden_size)
    assert checkpointed_ids(s.checkpoint_out) == [t for c in clauses for t in c["token_ids"].tolist()]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95, "seed": 11}])
async def test_resume_from_a_checkpoint_gives_the_uninterrupted_output(hf_thinker: HFThinker,
                                                                       sampling: dict[str, Any]) -> None:
    full = session(**sampling)
    await run_executor(hf_thinker, full)
    steps = len(full.emitted)
    for written in (1, steps // 2, steps - 1):
        crashed = session(**sampling)
        crashed.emitted = full.emitted[:written]      # what the lost attempt wrote
        crashed.seq = written
        retry = crashed.retried()
        usage = await run_executor(hf_thinker, retry)
        assert usage is not None and usage["resumed_at"] > 0
        assert full.text_out[:len(crashed.text_out)] == crashed.text_out
        assert crashed.text_out + retry.text_out == full.text_out
        clauses = crashed.data_to("talker") + retry.data_to("talker")
        want = full.data_to("talker")
        assert [c["text"] for c in clauses] == [c["text"] for c in want]
        for got, ref in zip(clauses, want):
            np.testing.assert_allclose(got["hidden"].numpy(), ref["hidden"].numpy(), atol=1e-4)


async def test_concurrent_sessions_are_batched_and_match_single_runs(hf_thinker: HFThinker) -> None:
    prompts = ["Why is the sky blue?", "A cat", PROMPT, "Hello, world."]
    alone = []
    for p in prompts:
        s = session(p)
        await run_executor(hf_thinker, s)
        alone.append(s.text_out)
    together = [session(p) for p in prompts]
    await run_many(hf_thinker, together)
    assert [s.text_out for s in together] == alone
    assert hf_thinker.step_loop is not None and hf_thinker.step_loop.stats.max_batch_seen > 1


async def test_bad_requests_fail_with_one_clear_error(hf_thinker: HFThinker) -> None:
    from omniflow.errors import NonRetryableError

    with pytest.raises(NonRetryableError, match="empty prompt"):
        await run_executor(hf_thinker, session("  "))
    with pytest.raises(NonRetryableError, match="top_p"):
        await run_executor(hf_thinker, session(top_p=2))


@pytest.fixture(scope="module")
async def greedy_lm(tiny_lm_dir: Path) -> Any:
    """The continuous-batching example of docs/executors.md, as written there."""
    from docs_examples import docs_example

    executor = docs_example("executors.md", "GreedyLM")["GreedyLM"](stage="thinker", params={"model": str(tiny_lm_dir)})
    await executor.setup()
    return executor


async def test_the_docs_batched_example_batches_and_resumes(greedy_lm: Any) -> None:
    def lm_session(text: str) -> FakeSession:
        return FakeSession(input={"text": text}, stage="thinker", params={"max_tokens": 12})

    prompts = ["Why is the sky blue?", "A cat", PROMPT]
    alone = [lm_session(p) for p in prompts]
    for s in alone:
        await run_executor(greedy_lm, s)
    together = [lm_session(p) for p in prompts]
    await run_many(greedy_lm, together)
    assert [s.text_out for s in together] == [s.text_out for s in alone]
    assert greedy_lm.step_loop.stats.max_batch_seen > 1
    full = alone[2]
    assert len(full.emitted) > 5
    crashed = lm_session(PROMPT)
    crashed.emitted, crashed.seq = full.emitted[:5], 5       # what the lost attempt wrote
    retry = crashed.retried()
    await run_executor(greedy_lm, retry)
    assert retry.resume_seq == 5 and crashed.text_out + retry.text_out == full.text_out


def heard_session(*pieces: str, input_text: str = "", **params: Any) -> FakeSession:
    """A Thinker session fed by an ASR stage: its chunks carry what was heard."""
    return FakeSession(input={"text": input_text}, stage="thinker", finals=("thinker",), downstream=("talker",),
                       upstream=("asr",), chunks=[("asr", {"text": p, "start_s": 0.0}) for p in pieces],
                       params={"max_tokens": 40, "temperature": 1.0, "seed": 1, **params})


async def test_with_an_upstream_the_prompt_is_the_text_it_sent(hf_thinker: HFThinker) -> None:
    """What the upstream heard is the prompt, after the input's own text if it has one (a chat
    message's text parts beside its audio)."""
    from omniflow.errors import NonRetryableError

    prompts = ["Listen: Why is the sky blue?", PROMPT]
    typed = [session(p) for p in prompts]
    typed_usage = [await run_executor(hf_thinker, s) for s in typed]
    heard = [heard_session("Why is", " the sky blue?", input_text="Listen:"),
             heard_session("Tell me about durable queues", " and workers, please.")]
    heard_usage = await run_many(hf_thinker, heard)    # batched together, each with its own prompt
    assert [s.text_out for s in heard] == [s.text_out for s in typed]
    assert [u["prompt_tokens"] for u in heard_usage] == [u["prompt_tokens"] for u in typed_usage]
    assert typed_usage[0]["prompt_tokens"] != typed_usage[1]["prompt_tokens"]
    with pytest.raises(NonRetryableError, match=r"empty prompt \(nothing came from asr\)"):
        await run_executor(hf_thinker, heard_session())
    with pytest.raises(NonRetryableError, match="chunk 1 from asr has no text"):
        await run_executor(hf_thinker, FakeSession(stage="thinker", upstream=("asr",), chunks=[("asr", {"pcm": b""})]))
    assert not hf_thinker._heard                       # nothing kept once the sessions are done


def tiny_spec(model_dir: Path, **thinker_params: Any) -> dict[str, Any]:
    return {"name": "tiny-omni", "stages": {
        "thinker": {"executor": "models.executor_fixtures:FailingThinker", "final_output": "text",
                    "params": {"model": str(model_dir), "clause_min_words": 2, "clause_max_words": 6,
                               "max_tokens": 40, "temperature": 1.0, "seed": 1, **thinker_params},
                    "retry": {"max_attempts": 3, "backoff_s": 0.01, "backoff_max_s": 0.05}},
        "talker": {"executor": "models.executor_fixtures:ClauseChecker", "final_output": "text",
                   "retry": {"max_attempts": 3, "backoff_s": 0.01, "backoff_max_s": 0.05}}},
        "edges": [{"from": "thinker", "to": "talker", "mode": "chunk"}]}


async def test_through_the_engine_a_failed_stream_resumes_to_the_same_text(engine_factory, tiny_lm_dir: Path,
                                                                          hf_thinker: HFThinker) -> None:
    reference = session(max_tokens=40)
    await run_executor(hf_thinker, reference)
    async with engine_factory(tiny_spec(tiny_lm_dir, fail_at_token=9, fail_attempts=1)) as eng:
        sub = await eng.store.submit(_request(PROMPT))
        doc = await eng.store.wait(sub.id, timeout_s=60)
    assert doc["state"] == "completed", doc
    assert doc["stages"]["thinker"]["attempt"] == 2                       # the first attempt failed mid-stream
    assert doc["outputs"]["thinker"]["text"] == reference.text_out        # nothing repeated, nothing missing
    assert doc["outputs"]["talker"]["text"] == reference.text_out         # every clause's tensors arrived intact


def _request(text: str) -> Any:
    from omniflow.models import SubmitRequest

    return SubmitRequest(input={"text": text})


# ------------------------------------------------------------------ the voice stages


def _voice_session(stage: str, chunks: list[Any], **kw: Any) -> FakeSession:
    downstream = ("code2wav",) if stage == "talker" else ()
    finals = ("code2wav",) if stage == "code2wav" else ("thinker",)
    return FakeSession(input={"text": "q"}, stage=stage, finals=finals, downstream=downstream,
                       chunks=[("thinker" if stage == "talker" else "talker", c) for c in chunks], **kw)


CLAUSES = ["Hello! Durable queues keep every request,", " so a crash loses nothing.", " **Really.**"]


@pytest.fixture(scope="module")
async def voice_stages(speaker: Any) -> tuple[Any, Any]:
    return speaker.talker, speaker.code2wav


async def test_talker_and_code2wav_speak_each_clause_and_resume_without_repeats(voice_stages: Any) -> None:
    from omniflow.workers.piper import VocoderStream

    talker, code2wav = voice_stages
    t = _voice_session("talker", [{"text": c} for c in CLAUSES])
    usage = await run_executor(talker, t)
    latents = [d["z"] for d in t.data_to("code2wav")]
    assert usage["clauses"] == 3 and len(latents) == 3 and all(z.shape[0] == 192 for z in latents)
    again = _voice_session("talker", [{"text": c} for c in CLAUSES])
    await run_executor(talker, again)                                     # seeded noise: a replay is identical
    for a, b in zip(latents, (d["z"] for d in again.data_to("code2wav"))):
        np.testing.assert_array_equal(a, b)

    c = _voice_session("code2wav", [{"z": z} for z in latents])
    await run_executor(code2wav, c)
    whole = code2wav.voice.vocode(np.concatenate(latents, axis=1))
    streamed = c.audio_out.astype(np.float32) / 32767
    assert streamed.size == whole.size and len(c.emitted) > 3
    assert np.abs(streamed - np.clip(whole, -1, 1)).max() < 0.01         # int16 rounding + 60 dB join error
    assert VocoderStream is not None

    crashed = _voice_session("code2wav", [{"z": z} for z in latents])
    crashed.emitted, crashed.seq = c.emitted[:3], 3
    retry = crashed.retried()
    await run_executor(code2wav, retry)
    np.testing.assert_array_equal(np.concatenate([crashed.audio_out, retry.audio_out]), c.audio_out)


async def test_talker_refuses_a_chunk_without_text(voice_stages: Any) -> None:
    from omniflow.errors import NonRetryableError

    with pytest.raises(NonRetryableError, match="no clause text"):
        await run_executor(voice_stages[0], _voice_session("talker", [{"hidden": [1.0]}]))


async def test_without_an_upstream_the_talker_speaks_the_input_text(voice_stages: Any) -> None:
    from omniflow.errors import NonRetryableError
    from omniflow.workers.voice import clauses

    talker = voice_stages[0]
    text = "Hello! Durable queues keep every request, so a crash loses nothing.\nReally, truly: nothing."
    alone = FakeSession(input={"text": text}, stage="talker", finals=("code2wav",), downstream=("code2wav",))
    usage = await run_executor(talker, alone)
    said = alone.data_to("code2wav")
    assert [d["text"] for d in said] == clauses(text) and usage["clauses"] == len(said) >= 2
    fed = _voice_session("talker", [{"text": c} for c in clauses(text)])     # the same clauses from a Thinker
    await run_executor(talker, fed)
    for a, b in zip(said, fed.data_to("code2wav"), strict=True):
        np.testing.assert_array_equal(a["z"], b["z"])
    with pytest.raises(NonRetryableError, match="no text to speak"):
        await run_executor(talker, FakeSession(input={"text": " "}, stage="talker", downstream=("code2wav",)))


async def test_the_talker_speaks_faster_at_a_higher_speed(voice_stages: Any) -> None:
    from omniflow.errors import NonRetryableError

    talker = voice_stages[0]

    async def frames(speed: Any) -> int:
        s = FakeSession(input={"text": "Durable queues keep every request."}, stage="talker",
                        downstream=("code2wav",), params={"speed": speed})
        usage = await run_executor(talker, s)
        return int(usage["latent_frames"])

    normal, fast = await frames(1.0), await frames(2.0)
    assert 0.45 < fast / normal < 0.7            # durations are whole frames, rounded up: not exactly half
    for bad in (0, 5, "quick"):
        with pytest.raises(NonRetryableError, match="speed must be a number in 0.25..4"):
            await frames(bad)


def test_text_is_cut_into_clauses_where_a_reader_pauses() -> None:
    from omniflow.workers.voice import clauses

    assert clauses("Hello! How are you today? I am fine: thanks.") == ["Hello! How are you today?", "I am fine: thanks."]
    assert clauses("It costs 3.50 today.\n\nNew paragraph here, friend.") == ["It costs 3.50 today.",
                                                                            "New paragraph here, friend."]
    long = ", ".join(["one two three four"] * 8) + "."
    assert clauses(long) == ["one two three four,"] * 7 + ["one two three four."]
    assert clauses("Hi.") == ["Hi."] and clauses("  ") == []


# ------------------------------------------------------------------ the GPU executors on a CPU


@pytest.mark.parametrize("name", ["VllmThinker", "VllmTalker", "VllmCode2Wav"])
async def test_vllm_executors_refuse_at_start_without_cuda_or_vllm(name: str) -> None:
    import sys

    from omniflow.errors import ConfigError
    from omniflow.workers import vllm_omni

    executor = getattr(vllm_omni, name)(stage="thinker", params={"devices": "0"})
    with pytest.raises(ConfigError) as info:
        await executor.setup()
    message = str(info.value)
    assert "\n" not in message and ("vllm" in message or "CUDA" in message)
    assert "deploy/pipelines/omni-cpu.yaml" in message
    assert "vllm" not in sys.modules                      # imported lazily, never on a CPU path


def test_a_worker_for_the_gpu_pipeline_exits_with_one_line_here(tmp_path: Path, valkey_url: str) -> None:
    import os
    import subprocess
    import sys
    import uuid

    pipeline = Path(__file__).resolve().parents[2] / "deploy" / "pipelines" / "qwen3-omni.yaml"
    env = {**os.environ, "OMNIFLOW_PIPELINE": str(pipeline), "OMNIFLOW_REDIS_URL": valkey_url,
           "OMNIFLOW_PREFIX": f"t{uuid.uuid4().hex[:10]}",
           "OMNIFLOW_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "-m", "omniflow.cli", "worker", "--stage", "talker"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    assert "the vLLM executors need vllm and vllm_omni (install omniflow's gpu extra" in res.stderr, res.stderr
