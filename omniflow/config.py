"""Typed settings: one pydantic-settings object, env prefix ``OMNIFLOW_``."""
from __future__ import annotations

import os
import socket
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from omniflow.errors import ConfigError, RedisNotFound
from omniflow.fairness import DEFAULT_PRIORITY_WEIGHTS, parse_allowances, parse_priority_weights, parse_weights
from omniflow.models import Priority

DEFAULT_PIPELINE = Path(__file__).resolve().parent.parent / "deploy" / "pipelines" / "omni-toy.yaml"
DEFAULT_HOME = Path(".omniflow")
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")
ENV_PREFIX = "OMNIFLOW_"


class DataPlaneMode(str, Enum):
    """How chunk payloads travel: chosen per chunk (`auto`), or one transport for every chunk."""

    AUTO = "auto"
    INLINE = "inline"
    REDIS = "redis"
    SHM = "shm"


class ChecksumMode(str, Enum):
    """What the checksum in a payload reference covers."""

    HEADER = "header"
    FULL = "full"


class Settings(BaseSettings):
    """Every knob of omniflow. Defaults run on a laptop CPU."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    redis_url: str | None = Field(
        default=None,
        description="`redis://host:port/db` (or `rediss://`) of a server or of any node of a Redis Cluster "
                    "(detected), or `redis+sentinel://host:port,host:port/service/db`; unset: the embedded server "
                    "`omniflow up` started, found through `$OMNIFLOW_HOME/redis.url`")
    home: Path = Field(
        default=DEFAULT_HOME, description="where `omniflow up` keeps the embedded Valkey's data and URL file")
    embedded_start_timeout_s: float = Field(
        default=10.0, gt=0,
        description="the longest the embedded Valkey of `omniflow up` may go without answering while it starts; "
                    "one loading a large AOF answers all along and is waited for as long as it loads (its "
                    "progress shown)")
    embedded_valkey_args: list[str] = Field(
        default_factory=list,
        description="extra command-line arguments for the embedded Valkey of `omniflow up`, a JSON list "
                    "(`[\"--maxmemory\", \"2gb\"]`)")
    prefix: str = Field(
        default="of", description="prefix of every Redis key: several deployments can share one Redis")
    pipeline: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="the pipeline YAML, or several separated by commas (`omni-cpu.yaml,tts-cpu.yaml`: one "
                    "deployment serves them all; the first is the default); what `--pipeline` (repeatable) "
                    "overrides; unset: the toy omni pipeline in `deploy/pipelines/omni-toy.yaml`")
    host_id: str = Field(
        default="", validate_default=True,
        description="the identity of the host this process runs on (empty: the machine's hostname). Workers "
                    "with the same host id may pass chunks through shared memory: give every machine (or pod "
                    "with its own /dev/shm) its own")

    cells: int = Field(
        default=0, ge=0, le=1024,
        description="workflows are spread over this many cells, each in one Redis Cluster slot "
                    "(docs/architecture.md); 0: one on a single server, 16 on a cluster. Every process of a "
                    "deployment must agree: it is recorded in Redis at first start and checked after")

    # admission and lifetimes
    max_in_flight: int = Field(
        default=10_000, ge=1,
        description="admission limit: at most this many non-terminal workflows; over it submit answers 429 "
                    "and creates nothing")

    # priorities and fair share (docs/operations.md, "Priorities and fair share")
    priority_weights: str = Field(
        default=DEFAULT_PRIORITY_WEIGHTS,
        description="`interactive=W,api=W,batch=W`: the share of session starts each priority class gets while "
                    "several wait (smooth weighted round robin; a higher class may not weigh less than a lower "
                    "one); a lower class is never starved")
    admission_share_api: float = Field(
        default=1.0, gt=0, le=1,
        description="the fraction of `max_in_flight` that `api` requests may fill (below 1: headroom kept for "
                    "`interactive`)")
    admission_share_batch: float = Field(
        default=0.8, gt=0, le=1,
        description="the fraction of `max_in_flight` that `batch` requests may fill (the rest is headroom for "
                    "live traffic)")
    tenant_priorities: str = Field(
        default="",
        description="`tenant=class,...`: the highest priority class each tenant may ask for (a request above it "
                    "is 403 `priority_not_allowed`; a default class above it is lowered to it)")
    default_max_priority: str = Field(
        default="interactive", description="the highest priority class of a tenant not in `tenant_priorities`")
    tenant_weights: str = Field(
        default="",
        description="`tenant=W,...` (W from 0.01 to 1000): fair-share weights; others weigh 1. Changed live with "
                    "`omniflow tenants weight` (held in Redis, over these)")
    fair_share: bool = Field(
        default=True,
        description="per-tenant fair share at admission: once the deployment is busy, a tenant over its "
                    "weighted share of `max_in_flight` gets 429")
    fair_share_from: float = Field(
        default=0.5, ge=0, le=1,
        description="fair share is enforced once this fraction of `max_in_flight` is in flight (under it every "
                    "tenant is admitted)")
    fair_share_reserve: float = Field(
        default=0.1, ge=0, lt=1,
        description="the fraction of `max_in_flight` no single tenant may take, kept for the next tenant that "
                    "arrives while one fills the deployment (it is admitted at once, and the shares follow)")
    fair_waiting_s: float = Field(
        default=10.0, gt=0,
        description="a tenant whose last live workflow ended, or that was refused as busy, counts among the "
                    "tenants sharing `max_in_flight` for this long (one between two requests, or holding nothing "
                    "yet, still gets its share)")
    live_window_s: float = Field(
        default=2.0, gt=0, le=3600,
        description="a stage keeps its `reserved_slots` free while a higher priority class, or a tenant holding "
                    "fewer of its slots, asked it for one within this many seconds; quiet that long, the others "
                    "borrow them")
    fair_hold_ms: int = Field(
        default=10, ge=0, le=10_000,
        description="a tenant refused as over its fair share has its next submits to the same process refused "
                    "there, without a Redis round trip, for this long (a flood's retries cost the server "
                    "nothing; 0: ask Redis every time)")
    fair_refresh_ms: int = Field(
        default=200, ge=10,
        description="how often a process re-reads the tenant weights and (on a cluster) every cell's live "
                    "count per tenant")

    default_deadline_s: float = Field(
        default=300.0, gt=0, description="a workflow's deadline when the request gives none")
    max_deadline_s: float = Field(
        default=3600.0, gt=0, description="the longest deadline a request may ask for")
    result_ttl_s: int = Field(
        default=24 * 3600, ge=1, description="how long a finished workflow's record, log and outputs are kept")
    finish_completes: bool = Field(
        default=True,
        description="the finish of a workflow's last final stage completes the workflow in the same script call "
                    "(the transition the reconciler would apply to its report, one hop sooner); off: every "
                    "completion goes through the reconciler")
    tombstone_ttl_s: int = Field(
        default=24 * 3600, ge=1, description="how long a retired (aborted or failed) id is refused")
    idempotency_ttl_s: int = Field(
        default=24 * 3600, ge=1, description="how long a `request_id` maps to its workflow")
    max_prompt_chars: int = Field(
        default=32_000, ge=1, description="the longest accepted `input.text`")

    # liveness
    heartbeat_interval_s: float = Field(
        default=0.5, gt=0, description="how often a worker renews its lease")
    lease_timeout_s: float = Field(
        default=2.0, gt=0, description="a worker silent this long loses its sessions to a retry")
    sweep_interval_s: float = Field(
        default=0.5, gt=0, description="period of the reconciler's sweeps: dead workers, due retries, deadlines")
    event_claim_idle_ms: int = Field(
        default=5_000, ge=100,
        description="a stage report (or webhook notice) pending this long on one consumer is claimed by another")

    # worker runtime
    read_batch: int = Field(
        default=64, ge=1, description="the most tasks one intake read takes")
    # More than one lets the worker prepare the next batch while Redis runs the last (docs/benchmarks.md).
    write_connections: int = Field(
        default=1, ge=1, le=16,
        description="a worker's group-commit write connections; one workflow's writes always take the same one")
    block_ms: int = Field(
        default=2_000, ge=1, description="how long blocking stream reads wait before they loop")

    # data plane (omniflow.dataplane): where a chunk's payload travels, chosen per chunk.
    # <= inline max: inside the edge-log entry; larger: shared memory when the consuming replica is
    # on this host (and the payload is at least shm_min), else a Redis key referenced by the entry.
    dataplane_mode: DataPlaneMode = Field(
        default=DataPlaneMode.AUTO,
        description="how chunk payloads travel: chosen per chunk (`auto`), or one transport for all")
    dataplane_inline_max_bytes: int = Field(
        default=64 << 10, ge=0, description="payloads up to this size travel inside the edge-log entry")
    dataplane_shm_min_bytes: int = Field(
        default=64 << 10, ge=0,
        description="larger payloads use shared memory from this size on, when the consuming replica shares "
                    "this host's /dev/shm (same host id); else a Redis key referenced by the entry")
    dataplane_shm_dir: Path = Field(default=Path("/dev/shm"), description="where shared-memory segments live")
    # segments a producer keeps mapped to recycle once their consumers are done (0: no recycling)
    dataplane_shm_pool_bytes: int = Field(
        default=256 << 20, ge=0,
        description="segments a producer keeps mapped to recycle once their consumers are done (0: none)")
    # what a reference points at outlives any retry that could need it: at least the longest
    # workflow deadline (max_deadline_s) plus this margin; released earlier at the consumer's
    # finish and at the workflow's terminal, swept if its owner died
    dataplane_ttl_margin_s: float = Field(
        default=300.0, ge=0,
        description="a payload key or segment lives max_deadline_s plus this (a retry may replay it); released "
                    "earlier at the consumer's finish and the workflow's terminal")
    # "header": the reference carries a CRC32 of the payload's header (sizes, dtypes, shapes, owner,
    # a nonce), which catches a stale or foreign segment/key; "full" also checksums every byte of
    # the payload (both sides pay ~0.25 ms per MiB here)
    dataplane_checksum: ChecksumMode = Field(
        default=ChecksumMode.HEADER,
        description="what a reference's CRC32 covers: the payload's header (catches a stale or foreign "
                    "payload), or every byte (`full`, ~0.25 ms per MiB on each side)")
    dataplane_edge_max_chunks: int = Field(
        default=1024, ge=0,
        description="backpressure: chunks a producer may have unread by its consumer on one `chunk` edge (0: no bound)")
    dataplane_edge_max_bytes: int = Field(
        default=256 << 20, ge=0,
        description="backpressure: payload bytes a producer may have unread by its consumer on one edge (0: no bound)")
    dataplane_sweep_interval_s: float = Field(
        default=30.0, gt=0,
        description="how often workers and reconcilers sweep their host's segments (ended workflows, dead producers)")

    def dataplane_ttl_s(self) -> float:
        """How long a payload key or segment lives at most (a retry may replay it until then)."""
        return self.max_deadline_s + self.dataplane_ttl_margin_s

    # durability
    wait_aof: bool = Field(
        default=False,
        description="`WAITAOF` before acknowledging a submit: the submit is on disk before the client hears `ok`")
    wait_replicas: int = Field(
        default=0, ge=0,
        description="every round trip that changes state waits (`WAIT`) until this many replicas have it, "
                    "so a failover loses nothing acknowledged; 0: asynchronous replication (see "
                    "docs/operations.md for what that loses and what the wait costs)")
    wait_timeout_ms: int = Field(
        default=1000, ge=1,
        description="how long that wait may take; a round trip not replicated in time counts as lost and "
                    "is retried")
    usage_retention_days: int = Field(
        default=90, ge=1, le=3660,
        description="how long the per-tenant usage counters (`omniflow usage`, `GET /v1/usage`) are kept, in "
                    "days: each hour's counters expire this long after the hour ends")
    dlq_max_len: int = Field(
        default=10_000, ge=1, description="each dead-letter stream keeps about this many entries")

    # process health (workers, reconcilers, job runner; the API has its own routes)
    health_port: int = Field(
        default=0, ge=0, le=65535,
        description="serve `GET /healthz` (the event loop answers) and `GET /readyz` (started, Redis reached "
                    "recently) on this port, for orchestrator probes; 0: off")
    shutdown_grace_s: float = Field(
        default=10.0, ge=0,
        description="on SIGTERM a worker stops taking sessions and lets running ones finish for this long, then "
                    "hands the rest back for a retry elsewhere; keep it below the orchestrator's kill timeout")

    # API
    api_host: str = Field(default="127.0.0.1", description="`omniflow api` listen address")
    api_port: int = Field(default=8000, description="`omniflow api` listen port")
    api_keys: str = Field(
        default="",
        description="`key:tenant,key2:tenant2`: bearer keys and their tenants; with none (and no admin keys) "
                    "the API binds to loopback only")
    admin_keys: str = Field(default="", description="`key,key2`: bearer keys that see every tenant")
    max_body_bytes: int = Field(default=1 << 20, description="the largest accepted HTTP request body")
    max_upload_bytes: int = Field(
        default=25 << 20, ge=1,
        description="the largest request body of the routes that take audio (`/v1/audio/transcriptions`, "
                    "`/v1/chat/completions` with `input_audio`): OpenAI's 25 MiB")
    max_upload_s: float = Field(
        default=600.0, gt=0, description="the longest audio an upload (or a realtime turn) may hold, in seconds")
    submit_rate_per_s: float = Field(
        default=0.0, description="submits per second per tenant (token bucket); 0: unlimited")
    webhook_allow_private: bool = Field(
        default=False, description="allow webhook URLs on private and loopback addresses")
    realtime_session_ttl_s: int = Field(
        default=3600, ge=1,
        description="how long a `/v1/realtime` session's state is kept after its last change: a client may "
                    "reconnect to it (`?session_id=`) until then")
    realtime_max_buffer_s: float = Field(
        default=120.0, gt=0,
        description="the most input audio a realtime session's buffer holds before a commit (pcm16 at 24 kHz); "
                    "an append past it is refused with an `error` event")

    # webhooks (delivered by `omniflow jobs`, see docs/webhooks-and-batch.md)
    webhook_secret: str = Field(
        default="", description="`whsec_<base64>` signing secret; empty: one is generated and kept in Redis")
    webhook_allow_hosts: str = Field(
        default="", description="comma list of hosts, IPs or CIDRs exempt from the private-address rule")
    webhook_max_attempts: int = Field(
        default=8, ge=1, description="deliveries tried before a webhook is given up")
    webhook_timeout_s: float = Field(default=10.0, gt=0, description="one delivery's HTTP timeout")
    webhook_backoff_s: float = Field(
        default=5.0, gt=0, description="delay before the first retry; each next one is 4x longer")
    webhook_backoff_max_s: float = Field(
        default=3600.0, gt=0, description="the longest delay between two retries")

    # arq job runner (`omniflow jobs`) and batch jobs
    jobs_redis_url: str | None = Field(
        default=None,
        description="the Redis of the job queue (arq: webhook deliveries, batch jobs); unset: the same as "
                    "`OMNIFLOW_REDIS_URL`. arq cannot use a Redis Cluster: with one, point this at a single "
                    "server (or a `redis+sentinel://` service)")
    jobs_poll_delay_s: float = Field(
        default=0.5, gt=0, description="how often the job runner polls its queue")
    jobs_max_concurrency: int = Field(
        default=32, ge=1, description="jobs one runner process runs at once")
    jobs_grace_s: float = Field(
        default=5.0, ge=0, description="how long a stopping job runner lets running jobs finish")
    batch_chunk_lines: int = Field(default=100, ge=1, description="lines per batch chunk (one job each)")
    batch_concurrency: int = Field(default=16, ge=1, description="lines of one chunk in flight at once")
    batch_slice_s: float = Field(
        default=60.0, gt=0, description="how long one chunk job runs before it re-queues the rest")
    batch_max_lines: int = Field(
        default=100_000, ge=1, description="the most lines one batch file may have")

    @field_validator("host_id")
    @classmethod
    def _default_host_id(cls, value: str) -> str:
        return value or socket.gethostname()

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value and not value.startswith(REDIS_URL_SCHEMES):
            raise ValueError(f"{value!r} is not a Redis URL: use redis://host:port/db (or rediss://, unix://, "
                             "redis+sentinel://host:port,…/service/db)")
        return value or None

    @field_validator("pipeline", mode="before")
    @classmethod
    def _pipelines(cls, value: object) -> object:
        if value is None:
            return []
        if isinstance(value, (str, Path)):
            return [p.strip() for p in str(value).split(",") if p.strip()]
        return value

    @field_validator("priority_weights")
    @classmethod
    def _priority_weights(cls, value: str) -> str:
        parse_priority_weights(value)
        return value

    @field_validator("tenant_weights")
    @classmethod
    def _tenant_weights(cls, value: str) -> str:
        parse_weights(value)
        return value

    @field_validator("tenant_priorities")
    @classmethod
    def _tenant_priorities(cls, value: str) -> str:
        parse_allowances(value)
        return value

    @field_validator("default_max_priority")
    @classmethod
    def _default_max_priority(cls, value: str) -> str:
        return Priority.parse(value).value

    def admission_limit(self, priority: Priority) -> int:
        """How much of `max_in_flight` requests of `priority` may fill (at least 1)."""
        share = {Priority.INTERACTIVE: 1.0, Priority.API: self.admission_share_api,
                 Priority.BATCH: self.admission_share_batch}[priority]
        return max(1, int(self.max_in_flight * share))

    def pipeline_path(self) -> Path:
        """The default pipeline's YAML (the first one given)."""
        return self.pipeline[0] if self.pipeline else DEFAULT_PIPELINE

    def pipeline_paths(self) -> list[Path]:
        """Every pipeline YAML this deployment serves (the first is the default)."""
        return list(self.pipeline) or [DEFAULT_PIPELINE]

    def resolve_redis_url(self) -> str:
        """`OMNIFLOW_REDIS_URL`, else the embedded server `omniflow up` started, else a clear error."""
        if self.redis_url:
            return self.redis_url
        url_file = self.home / "redis.url"
        if url_file.exists():
            return url_file.read_text().strip()
        raise RedisNotFound(
            "no Redis: set OMNIFLOW_REDIS_URL=redis://host:port/0, or run `omniflow up` "
            f"(it starts an embedded Valkey and writes {url_file})"
        )


def settings_error(exc: ValidationError) -> ConfigError:
    """One line naming the environment variable(s) that hold a bad value."""
    problems = []
    for err in exc.errors():
        name = ENV_PREFIX + "_".join(str(p) for p in err.get("loc", ())).upper()
        value = err.get("input")
        shown = f" (got {value!r})" if isinstance(value, (str, int, float)) else ""
        problems.append(f"{name}: {err.get('msg', 'invalid')}{shown}")
    return ConfigError("bad setting: " + "; ".join(problems))


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings (from the environment), or a `ConfigError` naming the bad setting."""
    try:
        return Settings()
    except ValidationError as exc:
        raise settings_error(exc) from None


def reset_settings_cache() -> None:
    get_settings.cache_clear()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in {"1", "true", "yes", "on"}
