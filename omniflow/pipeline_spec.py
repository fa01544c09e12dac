"""The pipeline YAML schema (DESIGN §1.1): the pydantic models a pipeline file is parsed into --
stages (executor, replicas, sessions, params, retry policy), edges, input kinds and deadline
shedding. Checked field by field here; the checks across the whole graph (`_validate`) and what
is built from it (`Pipeline`) are in `omniflow.pipeline`, which re-exports these names."""
from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["EdgeMode", "EdgeSpec", "InputKind", "Modality", "PipelineSpec", "RetryPolicy", "ShedMode", "SheddingSpec",
           "StageSpec"]

InputKind = Literal["text", "audio"]


class EdgeMode(str, Enum):
    CHUNK = "chunk"
    FULL = "full"


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(3, ge=1, le=100)
    backoff_s: float = Field(0.1, ge=0)
    backoff_max_s: float = Field(5.0, ge=0)
    jitter: float = Field(0.2, ge=0, le=1)
    attempt_timeout_s: float = Field(600.0, gt=0)
    input_timeout_s: float = Field(120.0, gt=0)


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    executor: str = Field(..., description="import path 'module:Class' of the stage executor")
    final_output: Literal["text", "audio"] | None = None
    replicas: int = Field(1, ge=1, le=256)
    max_sessions: int = Field(8, ge=1, le=4096)
    prefetch: int | None = Field(
        None, ge=0, le=4096,
        description="sessions claimed ahead of a free slot, so a freed slot starts the next one with no "
                    "round trip (default: adapts: max_sessions / 4, at least 1, while the queue runs dry; "
                    "max_sessions while it holds a backlog)")
    reserved_slots: int | None = Field(
        None, ge=0, le=4095,
        description="session slots kept free for live traffic while it is about: a lower priority class, or a "
                    "tenant holding more than its share, takes them only when no one ahead of it asked for a "
                    "slot in the last `live_window_s` (default: max_sessions / 8; 0: none)")
    params: dict[str, Any] = Field(default_factory=dict)
    retry: RetryPolicy = Field(default_factory=RetryPolicy)

    @model_validator(mode="after")
    def _reserve_below_sessions(self) -> StageSpec:
        if self.reserved_slots is not None and self.reserved_slots >= self.max_sessions:
            raise ValueError(f"reserved_slots ({self.reserved_slots}) must be below max_sessions "
                             f"({self.max_sessions}): the kept slots are a part of them")
        return self

    @field_validator("executor")
    @classmethod
    def _executor_path(cls, value: str) -> str:
        module, sep, attr = value.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"must look like 'package.module:ClassName', got {value!r}")
        return value


class EdgeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    src: str = Field(..., alias="from")
    dst: str = Field(..., alias="to")
    mode: EdgeMode = EdgeMode.CHUNK


class ShedMode(str, Enum):
    """What a submit does when the stage queues predict its request would miss its deadline."""

    OFF = "off"             # accept it (it may time out)
    DEGRADE = "degrade"     # run it with fewer outputs (`degrade_to`, e.g. text only), flagged; refuse if even that is late
    REFUSE = "refuse"       # refuse it at submit (503 `deadline_unmeetable`, Retry-After)


Modality = Literal["text", "audio"]


def _text_only() -> list[Modality]:
    return ["text"]


class SheddingSpec(BaseModel):
    """Deadline-aware shedding (docs/operations.md, "Deadline-aware shedding")."""

    model_config = ConfigDict(extra="forbid")

    on_late: ShedMode = ShedMode.OFF
    degrade_to: list[Modality] = Field(
        default_factory=_text_only, min_length=1,
        description="the output modalities a degraded request keeps (a subset of the pipeline's)")
    margin: float = Field(
        1.0, gt=0, le=10, description="late: the predicted time to the outputs is over deadline_s x margin")

    @field_validator("degrade_to")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("degrade_to has duplicates")
        return value


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    input: list[Literal["text", "audio"]] = Field(
        default_factory=lambda: list[Literal["text", "audio"]](["text"]), min_length=1,
        description="the input modalities the pipeline accepts (what `/v1/models` lists)")
    entry: str | None = Field(None, description="the entry stage (default: the first listed stage without inputs)")
    inputs: dict[InputKind, str] | None = Field(
        None, description="the stage that takes each input kind (default: text, at the entry stage)")
    stages: dict[str, StageSpec]
    edges: list[EdgeSpec] = Field(default_factory=list)
    shedding: SheddingSpec = Field(default_factory=SheddingSpec)
