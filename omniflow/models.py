"""Request and state types shared by the client, the API and the CLI."""
from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator


class WorkflowState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({WorkflowState.COMPLETED, WorkflowState.FAILED, WorkflowState.ABORTED})


class StageStatus(str, Enum):
    PENDING = "pending"
    WAITING_INPUT = "waiting_input"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class SessionState(str, Enum):
    """A session's lifecycle on its worker (`omniflow.engine.session`)."""

    WAITING_INPUT = "waiting_input"     # claimed, no input yet
    RUNNING = "running"                 # producing
    CLOSED = "closed"                   # `close` called: its finish is written or on the way; emits refused
    FENCED = "fenced"                   # a write was refused: a newer attempt owns the stage, or the workflow ended
    ABORTED = "aborted"                 # the workflow was aborted; its task is cancelled


class WorkerState(str, Enum):
    """A worker as operators see it (`omniflow workers`, `/metrics`, the dashboard)."""

    LOADING = "loading"     # registered, its executors' `setup` (model loading) still running: holds no lease
    READY = "ready"         # leased and claiming
    DRAINING = "draining"   # leased, drained by an operator: finishes what it holds, claims nothing
    STOPPING = "stopping"   # leased, shutting down: lets its sessions finish (`shutdown_grace_s`)
    LAPSED = "lapsed"       # its lease (or its loading announcement) ran out: dead, until the reconciler reaps it


class AudioInput(BaseModel):
    """A workflow's audio input: int16 mono PCM at `sample_rate`, streamed into the workflow after
    it is submitted (`Store.append_input`, `Client.append_input`), not carried in the record."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["pcm16"] = "pcm16"
    sample_rate: int = Field(16000, ge=8000, le=192_000)


class Priority(str, Enum):
    """A request's priority class, highest first: stage intake serves a higher class first and gives
    the lower ones a bounded share (`OMNIFLOW_PRIORITY_WEIGHTS`), so none starves."""

    INTERACTIVE = "interactive"     # a live turn (realtime, a user waiting for first audio)
    API = "api"                     # an ordinary API request (the default)
    BATCH = "batch"                 # batch jobs: gives way to live traffic

    @property
    def rank(self) -> int:
        """0 for the highest class."""
        return PRIORITY_ORDER.index(self)

    @classmethod
    def parse(cls, value: str) -> Priority:
        """A priority by name (`realtime` is `interactive`); ValueError naming the classes otherwise."""
        name = value.strip().lower()
        if name == "realtime":
            return cls.INTERACTIVE
        try:
            return cls(name)
        except ValueError:
            raise ValueError(f"unknown priority {value!r}; classes are "
                             f"{[p.value for p in PRIORITY_ORDER]} (realtime = interactive)") from None


def _parse_priority(value: Any) -> Any:
    return Priority.parse(value) if isinstance(value, str) else value


#: a `priority` field: its name parsed with `Priority.parse` (its clear error for an unknown one)
PriorityName = Annotated[Priority, BeforeValidator(_parse_priority)]

PRIORITY_ORDER = (Priority.INTERACTIVE, Priority.API, Priority.BATCH)


class WorkflowInput(BaseModel):
    """What a workflow answers: a text prompt, or audio (then `text`, if given, is context only)."""

    model_config = ConfigDict(extra="allow")

    audio: AudioInput | None = Field(None, description="audio input, streamed in after the submit")
    text: str | None = Field(None, min_length=1, validate_default=True,
                             description="the user prompt (not empty, not only whitespace); required unless `audio` "
                                         "is given")

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            if info.data.get("audio") is None:
                raise ValueError("give the prompt (or audio)")
            return None
        if not value.strip():
            raise ValueError("the prompt is empty (only whitespace)")
        return value

    @property
    def kind(self) -> str:
        """The input kind that picks the pipeline's entry stage (`Pipeline.entry_for`)."""
        return "audio" if self.audio is not None else "text"


class SubmitRequest(BaseModel):
    """Body of `POST /v1/workflows` (and what `Client.submit` builds)."""

    model_config = ConfigDict(extra="forbid")

    input: WorkflowInput
    pipeline: str | None = Field(
        None, min_length=1, max_length=96, pattern=r"^[A-Za-z0-9_.-]{1,64}(@[0-9a-f]{16})?$",
        description="the pipeline to run, by name (`GET /v1/models`), or `name@version` for one version; "
                    "default: the deployment's first")
    output_modalities: list[str] | None = Field(
        None, description="subset of the pipeline's output kinds, e.g. ['text', 'audio']; default: all"
    )
    stage_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    request_id: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$",
        description="idempotency key: the same key returns the same workflow",
    )
    webhook_url: str | None = Field(None, max_length=2048)
    deadline_s: float | None = Field(None, gt=0)
    priority: PriorityName | None = Field(
        None, description="priority class (interactive, api, batch); default: the entry point's (the API: api, "
                          "realtime: interactive, batch jobs: batch), capped by the tenant's allowance")

    @field_validator("output_modalities")
    @classmethod
    def _distinct(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("output_modalities has duplicates")
        return value


class Submitted(BaseModel):
    id: str
    state: WorkflowState
    existing: bool = False
    degraded: str | None = None             # why the request runs with fewer outputs (deadline shedding)
    dropped: list[str] = Field(default_factory=list)     # the output modalities it runs without
