"""Response models: what the API returns, and so what `/openapi.json` promises."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omniflow.models import WorkerState, WorkflowState


class ErrorDetail(BaseModel):
    message: str = Field(..., description="what went wrong, for humans")
    type: str = Field("invalid_request_error", description="OpenAI's class of the error, from the status: "
                      "invalid_request_error, authentication_error, permission_error, rate_limit_error, server_error")
    code: str = Field(..., description="stable machine-readable code, e.g. not_found, retired, over_capacity")
    param: str | None = Field(None, description="the request field at fault, when one is")
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


class WebhookAttempt(BaseModel):
    attempt: int
    at: float = Field(..., description="epoch seconds of the attempt's outcome")
    outcome: Literal["delivered", "retried", "failed", "refused"]
    status: int | None = Field(None, description="the receiver's HTTP status, when it answered")
    error: str | None = None


class WebhookView(BaseModel):
    url: str
    outcome: Literal["pending", "delivered", "retried", "failed", "refused"] = Field(
        ..., description="pending until the first attempt; retried while another attempt is scheduled")
    attempts: list[WebhookAttempt]
    next_attempt_at: float | None = None


class WorkflowDocument(BaseModel):
    """DESIGN §5: the workflow document (the same shape the CLI prints with --json)."""

    model_config = ConfigDict(extra="allow")

    id: str
    request_id: str | None = None
    state: WorkflowState
    tenant: str | None = None
    pipeline: str | None = Field(None, description="the pipeline it runs (`GET /v1/models`)")
    pipeline_version: str | None = Field(None, description="the version (content hash) of the pipeline it started "
                                                           "on and finishes on")
    final_stages: list[str]
    required_stages: list[str]
    created_at: float
    finished_at: float | None = None
    deadline_at: float
    stages: dict[str, StageView]
    outputs: dict[str, OutputView]
    error: str | None = None
    error_stage: str | None = None
    webhook: WebhookView | None = Field(None, description="delivery attempts, when the workflow has a webhook_url")
    trace_id: str | None = Field(None, description="the OpenTelemetry trace id of the request that made it "
                                 "(32 hex digits), when tracing is on (docs/operations.md, Traces)")


class WorkflowSummary(BaseModel):
    id: str
    state: WorkflowState
    tenant: str | None = None
    created_at: float
    finished_at: float | None = None
    final_stages: list[str]
    stages: list[str] = Field(default_factory=list, description="every stage in the workflow's plan")
    error: str | None = None
    error_stage: str | None = None
    request_id: str | None = None
    pipeline: str | None = None
    pipeline_version: str | None = None


class WorkflowList(BaseModel):
    items: list[WorkflowSummary]
    offset: int
    limit: int
    next_offset: int | None = Field(None, description="pass as `offset` for the next page; null on the last")
    total: int | None = Field(None, description="how many match, when the listing index alone answers the filters")
    scanned: int = Field(0, description="records read to build this page")


class GanttAttempt(BaseModel):
    attempt: int
    replica: str | None = None
    start: int = Field(..., description="ms after creation: claimed by `replica`")
    running: int | None = Field(None, description="ms after creation: first input or output")
    end: int | None = None
    outcome: Literal["running", "done", "failed", "retried", "aborted"]


class GanttTick(BaseModel):
    """One output write: the text steps (or audio chunk) `first`..`seq`, logged at `t`."""

    t: int
    first: int
    seq: int
    kind: Literal["text", "audio"]


class GanttRetry(BaseModel):
    t: int
    attempt: int
    reason: str


class GanttLane(BaseModel):
    stage: str
    attempts: list[GanttAttempt]
    ticks: list[GanttTick]
    retries: list[GanttRetry]


class TimelineEvent(BaseModel):
    t: int
    event: str
    state: str | None = None
    stage: str | None = None
    error: str | None = None


class Timeline(BaseModel):
    """A workflow's event log as Gantt lanes (times in ms after its creation)."""

    id: str
    state: WorkflowState
    created_at: float
    duration_ms: int
    lanes: list[GanttLane]
    events: list[TimelineEvent]


class WorkerView(BaseModel):
    id: str
    stages: list[str]
    host: str | None = None
    pid: int | None = None
    state: WorkerState = Field(..., description="loading (its models: not live yet), ready, draining, stopping, "
                                                "or lapsed (its lease or loading announcement ran out)")
    state_age_s: float | None = Field(None, description="seconds since it started loading, or since it took its lease")
    alive: bool = Field(..., description="its lease is current (a dead one is reaped by the reconciler)")
    lease_left_s: float
    heartbeat_age_s: float | None = None
    draining: bool
    sessions: dict[str, int] = Field(..., description="sessions held per stage served")
    capacity: dict[str, int] = Field(..., description="max_sessions per stage served")
    runs_on: dict[str, str] = Field(default_factory=dict, description="per stage served, where its sessions run now: "
                                    "'thread' (its compute thread) or 'loop' (the worker's event loop)")
    sessions_held: int
    window: dict[str, Any] = Field(default_factory=dict, description="its last minute of work, per stage")


class LastMinute(BaseModel):
    done: int
    failed: int
    retries: int = Field(..., description="attempts after the first claimed in the last minute")
    throughput_per_s: float
    p50_s: float | None = Field(None, description="session time (claim -> finish), from the workers' histograms")
    p99_s: float | None = None


class StagePool(BaseModel):
    queued: int = Field(..., description="entries in the stage's task stream")
    lag: int = Field(..., description="tasks no worker has read yet")
    pending: int = Field(..., description="tasks read by a worker and not finished (sessions held)")
    oldest_pending_age_s: float | None = None
    oldest_queued_age_s: float | None = None
    live_workers: int
    draining_workers: int
    loading_workers: int = Field(0, description="workers of the stage still loading their models (not live yet)")
    active_sessions: int
    capacity: int
    dlq: int
    last_minute: LastMinute


class PipelineVersion(BaseModel):
    """One registered pipeline version (`omniflow pipelines`)."""

    name: str
    version: str = Field(..., description="content hash of its canonical definition")
    current: bool = Field(..., description="the version its name gives new workflows")
    registered_at: float
    input_modalities: list[str]
    output_modalities: list[str]
    workers: dict[str, list[str]] = Field(..., description="stage -> the live workers serving it in this version")


class Pools(BaseModel):
    """Every stage pool at a glance (the dashboard's top panel, `omniflow stats --json`)."""

    at: float
    in_flight: int
    max_in_flight: int
    scheduled_retries: int
    events_backlog: int
    dlq_events: int
    workflows: dict[str, int] = Field(..., description="workflows per state (listing indexes)")
    stages: dict[str, StagePool]
    workers: list[WorkerView]
    pipelines: list[PipelineVersion] = Field(default_factory=list, description="the pipeline registry")


class AbortResponse(BaseModel):
    id: str
    state: WorkflowState


class InputAppended(BaseModel):
    id: str
    seq: int = Field(..., description="the input's last sequence number")
    final: bool


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "unready"]
    redis: bool
    stages: dict[str, int] = Field(..., description="live workers per stage")
    missing: list[str] = Field(default_factory=list, description="stages with no live worker")
    message: str | None = None


class UsageCounters(BaseModel):
    sessions: int = Field(..., description="stage sessions that finished (done)")
    compute_s: float = Field(..., description="their compute: session time less its waits for upstream chunks "
                                              "and for room downstream")
    failed_compute_s: float = Field(..., description="the compute of attempts that failed (retried, or failing "
                                                     "the workflow)")
    audio_s: float = Field(..., description="audio produced (final audio stages)")
    prompt_tokens: int
    completion_tokens: int


class UsageRow(UsageCounters):
    tenant: str
    pipeline: str
    stage: str


class UsageTotal(UsageCounters):
    tenant: str
    pipeline: str


class UsageReport(BaseModel):
    """Usage per tenant over a window (hourly counters, `omniflow usage --json`)."""

    since: float = Field(..., description="start of the window (epoch s): rounded down to the hour, no earlier "
                                          "than the retention")
    until: float
    bucket_s: int
    retention_days: int
    tenant: str | None = Field(None, description="the tenant filter")
    pipeline: str | None = Field(None, description="the pipeline filter")
    rows: list[UsageRow] = Field(..., description="per tenant, pipeline and stage")
    tenants: list[UsageTotal] = Field(..., description="per tenant and pipeline, summed over stages")
