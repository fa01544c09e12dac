"""The executor contract: what a stage's model code implements, and what it may use of a session.

    Executor          one stage's model code: `setup`, `run(session)`, `close`
    Session           (Protocol) what `run` may use of the session it is given
    Chunk             one input chunk from an upstream stage (`Session.inputs()`)
    StepOutput        what one step of a `BatchedExecutor` produced for one session

The engine's `omniflow.engine.session.Session` (Redis behind it) and the test double
`omniflow.testing.FakeSession` both implement `Session`: mypy checks each where it is
defined, and `tests/test_executor_contract.py` compares their members with the Protocol's
at run time, so the fake cannot drift from the real one unseen.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import numpy as np

#: where an executor's sessions run (`Executor.runs_on`; `omniflow.engine.placement`)
RunsOn = Literal["auto", "thread", "loop"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One input chunk from an upstream stage."""

    src: str
    seq: int
    attempt: int
    data: Any


@dataclass(slots=True)
class StepOutput:
    """What one step produced for one session (an all-empty output emits nothing)."""

    text: str | None = None                  # a text delta (stored when the stage is a final text stage)
    data: Any = None                         # a chunk for the downstream stages
    checkpoint: str | None = None            # durable resume info, appended atomically with this step
    done: bool = False                       # this was the session's last step
    usage: Mapping[str, Any] | None = None   # with done: the session's usage

    @property
    def empty(self) -> bool:
        return self.text is None and self.data is None and self.checkpoint is None


class Session(Protocol):
    """What an executor may use of the session it runs: one stage's work on one workflow.

    Everything else on the engine's session (its write queue, fencing flags, data-plane
    state) belongs to the worker. Data members are read-only here: an executor reads them.
    `docs/executors.md` ("What a session gives you") documents each member.
    """

    # ------------------------------------------------------------ who and where
    @property
    def wf_id(self) -> str:
        """The workflow's id."""

    @property
    def stage(self) -> str:
        """The stage this session runs."""

    @property
    def attempt(self) -> int:
        """This attempt's number (1, then one more per retry)."""

    @property
    def finals(self) -> tuple[str, ...]:
        """The workflow's final stages (those whose output the client receives)."""

    @property
    def is_final(self) -> bool:
        """True when this stage is one of the workflow's final stages (its text and audio are kept)."""

    @property
    def upstream(self) -> tuple[str, ...]:
        """The stages whose chunks `inputs()` yields."""

    @property
    def downstream(self) -> tuple[str, ...]:
        """The stages `emit(data=...)` sends chunks to."""

    # ------------------------------------------------------------ what to do
    @property
    def input(self) -> dict[str, Any]:
        """The workflow's input (`{"text": ...}` plus any extra fields)."""

    @property
    def text(self) -> str:
        """`input["text"]` (empty when there is none)."""

    @property
    def params(self) -> dict[str, Any]:
        """The stage's params: the pipeline's, overlaid by the request's `stage_params[stage]`."""

    def inputs(self) -> AsyncIterator[Chunk]:
        """Chunks from every upstream edge, in order, de-duplicated on `(src, seq)`, until all have ended."""

    # ------------------------------------------------------------ what it produced
    async def emit(self, *, text: str | None = None, audio: np.ndarray | None = None,
                   sample_rate: int | None = None, data: Any = None,
                   to: Mapping[str, Any] | None = None, checkpoint: str | None = None) -> None:
        """Write one output step: a text delta, an audio chunk and/or a chunk for downstream stages.

        `data` goes to every downstream stage, `to` maps a stage to its own payload; `checkpoint`
        is appended to the stage's durable resume state in the same atomic write as the step.
        Raises `Fenced` once this attempt no longer owns the session."""

    async def flush(self) -> None:
        """Wait until every emit so far is written; raise `Fenced` if this attempt was fenced off."""

    # ------------------------------------------------------------ resume
    @property
    def seq(self) -> int:
        """How many steps this attempt has emitted, those suppressed on resume included."""

    @property
    def resume_seq(self) -> int:
        """How many steps earlier attempts wrote: emits up to it are suppressed."""

    @property
    def checkpoint(self) -> str:
        """Everything earlier attempts checkpointed with the steps up to `resume_seq`."""

    def fast_forward(self) -> int:
        """Skip the steps earlier attempts already wrote; returns how many."""


class Executor(ABC):
    """Base class of stage executors."""

    #: True when `run` continues from `session.resume_seq` (or is deterministic, so that
    #: re-emitted steps are suppressed). Non-resumable stages restart their output.
    resumable: ClassVar[bool] = True

    #: "auto" (the default): setup/close on the stage's compute thread, and `run` there too until
    #: its steps (what it does between two awaits) have shown they are short; then on the worker's
    #: event loop, and back at the first long one (`omniflow.engine.placement`);
    #: "thread": always on the compute thread (blocking code is fine);
    #: "loop": always on the worker's event loop (only for executors that never block).
    runs_on: ClassVar[RunsOn] = "auto"

    def __init__(self, *, stage: str, params: Mapping[str, Any]) -> None:
        self.stage = stage
        self.params = dict(params)

    async def setup(self) -> None:
        """Load weights, warm up. Called once before the worker takes sessions."""

    @abstractmethod
    async def run(self, session: Session) -> Mapping[str, Any] | None:
        """Do one session's work; return usage (token counts, audio seconds...)."""

    async def close(self) -> None:
        """Release what `setup` took. Called once at shutdown."""
