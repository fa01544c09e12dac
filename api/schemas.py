"""Response models: what the API returns, and so what `/openapi.json` promises."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omniflow.models import WorkflowState


class ErrorDetail(BaseModel):
    code: str = Field(..., description="stable machine-readable code, e.g. not_found, retired, over_capacity")
    message: str = Field(..., description="what went wrong, for humans")
    fields: list[dict[str, str]] | None = Field(None, description="per-field problems (422 only)")


class ErrorResponse(BaseModel):
    error: ErrorDetail


AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse, "description": "missing or unknown API key"}}


class Links(BaseModel):
    self: str
    events: str
    audio: str
    abort: str


class SubmitResponse(BaseModel):
    id: str
    state: WorkflowState
    existing: bool = Field(False, description="true when request_id matched an earlier workflow")
    links: Links


class StageView(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: str
    attempt: int
    replica: str | None = None
    submitted: bool = False
    submitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None


class OutputView(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "audio"]
    partial: bool
    text: str | None = None
    sample_rate: int | None = None
    duration_s: float | None = None
    chunks: int | None = None


class WorkflowDocument(BaseModel):
    """DESIGN §5: the workflow document (the same shape the CLI prints with --json)."""

    model_config = ConfigDict(extra="allow")

    id: str
    request_id: str | None = None
    state: WorkflowState
    tenant: str | None = None
    pipeline: str | None = None
    final_stages: list[str]
    required_stages: list[str]
    created_at: float
    finished_at: float | None = None
    deadline_at: float
    stages: dict[str, StageView]
    outputs: dict[str, OutputView]
    error: str | None = None
    error_stage: str | None = None


class WorkflowSummary(BaseModel):
    id: str
    state: WorkflowState
    tenant: str | None = None
    created_at: float
    final_stages: list[str]
    error: str | None = None
    request_id: str | None = None


class WorkflowList(BaseModel):
    items: list[WorkflowSummary]
    offset: int
    limit: int
    next_offset: int | None = Field(None, description="pass as `offset` for the next page; null on the last")


class AbortResponse(BaseModel):
    id: str
    state: WorkflowState


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "unready"]
    redis: bool
    stages: dict[str, int] = Field(..., description="live workers per stage")
    missing: list[str] = Field(default_factory=list, description="stages with no live worker")
    message: str | None = None
