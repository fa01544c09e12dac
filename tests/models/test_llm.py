"""CausalLM on a tiny random Llama: batched decoding equals unbatched, resume continues exactly."""
from __future__ import annotations

from pathlib import Path

import pytest

from omniflow.workers.llm import CausalLM, LMSequence, Sampling

PROMPTS = ["Why is the sky blue?", "A cat", "Tell me about durable queues and workers, please.", "Hi"]


def run_alone(lm: CausalLM, prompt: str, sampling: Sampling) -> list[int]:
    seq = lm.start(lm.chat_ids(prompt), sampling)
    while not seq.finished and seq.pending not in lm.eos_ids:
        lm.step([seq])
    lm.release(seq)
    return seq.generated


def run_staggered(lm: CausalLM, prompts: list[str], sampling: Sampling, join_every: int) -> list[list[int]]:
    """Sessions join one by one between steps and leave as they finish (continuous batching)."""
    waiting = list(prompts)
    live: list[tuple[int, LMSequence]] = []
    results: dict[int, list[int]] = {}
    step = 0
    while waiting or live:
        if waiting and step % join_every == 0:
            index = len(prompts) - len(waiting)
            live.append((index, lm.start(lm.chat_ids(waiting.pop(0)), sampling)))
        lm.step([seq for _, seq in live])
        step += 1
        for index, seq in list(live):
            if seq.finished or seq.pending in lm.eos_ids:
                live.remove((index, seq))
                lm.release(seq)
                results[index] = seq.generated
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("sampling", [Sampling(max_tokens=24), Sampling(temperature=0.9, top_p=0.9, max_tokens=24,
                                                                        seed=7)])
def test_batched_equals_unbatched(tiny_lm: CausalLM, sampling: Sampling) -> None:
    alone = [run_alone(tiny_lm, p, sampling) for p in PROMPTS]
    assert all(len(tokens) > 3 for tokens in alone)
    assert run_staggered(tiny_lm, PROMPTS, sampling, join_every=3) == alone
    assert run_staggered(tiny_lm, PROMPTS, sampling, join_every=1) == alone


@pytest.mark.parametrize("sampling", [Sampling(max_tokens=20), Sampling(temperature=1.0, max_tokens=20, seed=3)])
def test_resume_from_emitted_tokens_continues_exactly(tiny_lm: CausalLM, sampling: Sampling) -> None:
    prompt = tiny_lm.chat_ids(PROMPTS[2])
    full = run_alone(tiny_lm, PROMPTS[2], sampling)
    for cut in (1, len(full) // 2, len(full) - 1):
        seq = tiny_lm.start(prompt, sampling, full[:cut])
        assert seq.prefill_hidden is not None and seq.prefill_hidden.shape == (cut, tiny_lm.hidden_size)
        while not seq.finished and seq.pending not in tiny_lm.eos_ids:
            tiny_lm.step([seq])
        tiny_lm.release(seq)
        assert seq.generated == full


def test_seeds_differ_and_hidden_states_are_per_token(tiny_lm: CausalLM) -> None:
    a = run_alone(tiny_lm, PROMPTS[0], Sampling(temperature=1.5, max_tokens=16, seed=1))
    b = run_alone(tiny_lm, PROMPTS[0], Sampling(temperature=1.5, max_tokens=16, seed=2))
    assert a != b
    seqs = [tiny_lm.start(tiny_lm.chat_ids(p), Sampling(max_tokens=4)) for p in PROMPTS[:3]]
    hidden = tiny_lm.step(seqs)
    assert tuple(hidden.shape) == (3, tiny_lm.hidden_size) and str(hidden.dtype) == "torch.float32"
    for seq in seqs:
        tiny_lm.release(seq)


def test_sampling_params_are_validated() -> None:
    assert Sampling.from_params({"temperature": "0.5", "max_tokens": 9}) == Sampling(temperature=0.5, max_tokens=9)
    for bad in ({"temperature": -1}, {"top_p": 0}, {"max_tokens": 0}, {"max_tokens": 10**6}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling.from_params(bad)


def test_load_refuses_what_is_not_a_model(tmp_path: Path) -> None:
    from omniflow.workers.weights import ModelUnavailable

    with pytest.raises(ModelUnavailable, match="neither a folder nor a .gguf"):
        CausalLM.load(tmp_path / "nothing.bin")


def test_chat_template_is_applied(tiny_lm: CausalLM) -> None:
    text = tiny_lm.tokenizer.decode(tiny_lm.chat_ids("Hi", system="Be brief."))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")


def test_bfloat16_weights_hand_out_float32_states_and_decode(tiny_lm_dir: Path) -> None:
    lm = CausalLM.load(tiny_lm_dir, dtype="bfloat16")
    assert next(lm.model.parameters()).dtype == lm.torch.bfloat16
    seq = lm.start(lm.chat_ids(PROMPTS[0]), Sampling(max_tokens=6), [5, 6])
    assert seq.prefill_hidden is not None and seq.prefill_hidden.dtype == lm.torch.float32
    hidden = lm.step([seq])
    assert hidden.dtype == lm.torch.float32 and tuple(hidden.shape) == (1, lm.hidden_size)
    assert len(seq.generated) == 3 and 0 <= seq.pending < lm.model.config.vocab_size
    lm.release(seq)
    sampled = run_alone(lm, PROMPTS[1], Sampling(temperature=0.9, max_tokens=8, seed=1))
    assert sampled == run_alone(lm, PROMPTS[1], Sampling(temperature=0.9, max_tokens=8, seed=1))


def test_dtype_auto_takes_bfloat16_only_on_a_cpu_with_bfloat16_units(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from omniflow.workers import llm

    zen4, old = tmp_path / "zen4", tmp_path / "old"
    zen4.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
    old.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\nbugs\t\t: avx512_bf16_not_a_flag\n")
    assert llm.cpu_has_bf16(str(zen4)) and not llm.cpu_has_bf16(str(old))
    assert not llm.cpu_has_bf16(str(tmp_path / "missing"))
    monkeypatch.setattr(llm, "cpu_has_bf16", lambda: False)
    assert llm.resolve_dtype("auto") == "float32" and llm.resolve_dtype("bfloat16") == "bfloat16"
    monkeypatch.setattr(llm, "cpu_has_bf16", lambda: True)
    assert llm.resolve_dtype("auto") == "bfloat16" and llm.resolve_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, auto, got 'float16'"):
        llm.resolve_dtype("float16")
