"""Typed settings: one pydantic-settings object, env prefix ``OMNIFLOW_``."""
from __future__ import annotations

import os
from enum import Enum
from functools import lru_cache
from pathlib import Path

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from omniflow.errors import ConfigError, RedisNotFound

DEFAULT_PIPELINE = Path(__file__).resolve().parent.parent / "deploy" / "pipelines" / "omni-toy.yaml"
DEFAULT_HOME = Path(".omniflow")
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")
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

    redis_url: str | None = None
    home: Path = DEFAULT_HOME
    prefix: str = "of"
    pipeline: Path | None = None

    # admission and lifetimes
    max_in_flight: int = Field(10_000, ge=1)
    default_deadline_s: float = Field(300.0, gt=0)
    max_deadline_s: float = Field(3600.0, gt=0)
    result_ttl_s: int = Field(24 * 3600, ge=1)
    tombstone_ttl_s: int = Field(24 * 3600, ge=1)
    idempotency_ttl_s: int = Field(24 * 3600, ge=1)
    max_prompt_chars: int = Field(32_000, ge=1)

    # liveness
    heartbeat_interval_s: float = Field(0.5, gt=0)
    lease_timeout_s: float = Field(2.0, gt=0)
    sweep_interval_s: float = Field(0.5, gt=0)
    event_claim_idle_ms: int = Field(5_000, ge=100)

    # worker runtime
    read_batch: int = Field(64, ge=1)
    # a worker's writes go out over this many connections, each group-committing on its own;
    # one workflow's writes always take the same one (their order is kept). More than one lets
    # the worker prepare the next batch while Redis runs the last (see docs/benchmarks.md).
    write_connections: int = Field(1, ge=1, le=16)
    block_ms: int = Field(2_000, ge=1)
    inline_chunk_max_bytes: int = Field(1 << 20, ge=1)

    # data plane (omniflow.dataplane): where a chunk's payload travels, chosen per chunk.
    # <= inline max: inside the edge-log entry; larger: shared memory when the consuming replica is
    # on this host (and the payload is at least shm_min), else a Redis key referenced by the entry.
    dataplane_mode: DataPlaneMode = DataPlaneMode.AUTO
    dataplane_inline_max_bytes: int = Field(64 << 10, ge=0)
    dataplane_shm_min_bytes: int = Field(64 << 10, ge=0)
    dataplane_shm_dir: Path = Path("/dev/shm")
    # segments a producer keeps mapped to recycle once their consumers are done (0: no recycling)
    dataplane_shm_pool_bytes: int = Field(256 << 20, ge=0)
    # what a reference points at outlives any retry that could need it: at least the longest
    # workflow deadline (max_deadline_s) plus this margin; released earlier at the consumer's
    # finish and at the workflow's terminal, swept if its owner died
    dataplane_ttl_margin_s: float = Field(300.0, ge=0)
    # "header": the reference carries a CRC32 of the payload's header (sizes, dtypes, shapes, owner,
    # a nonce), which catches a stale or foreign segment/key; "full" also checksums every byte of
    # the payload (both sides pay ~0.25 ms per MiB here)
    dataplane_checksum: ChecksumMode = ChecksumMode.HEADER
    # backpressure: what a producer may have unread by its consumer on one `chunk` edge (0: no bound)
    dataplane_edge_max_chunks: int = Field(1024, ge=0)
    dataplane_edge_max_bytes: int = Field(256 << 20, ge=0)
    # how often workers and the reconciler sweep their host's segments (ended workflows, dead producers)
    dataplane_sweep_interval_s: float = Field(30.0, gt=0)

    def dataplane_ttl_s(self) -> float:
        """How long a payload key or segment lives at most (a retry may replay it until then)."""
        return self.max_deadline_s + self.dataplane_ttl_margin_s

    # durability
    wait_aof: bool = False
    dlq_max_len: int = Field(10_000, ge=1)     # each dead-letter stream keeps about this many entries

    # API
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    api_keys: str = ""          # "key:tenant,key2:tenant2"
    admin_keys: str = ""        # "key,key2"
    max_body_bytes: int = 1 << 20
    submit_rate_per_s: float = 0.0   # per tenant; 0 = unlimited
    webhook_allow_private: bool = False

    # webhooks (delivered by `omniflow jobs`, see docs/webhooks-and-batch.md)
    webhook_secret: str = ""          # "whsec_<base64>"; empty: one is generated and kept in Redis
    webhook_allow_hosts: str = ""     # comma list of hosts, IPs or CIDRs exempt from the private-address rule
    webhook_max_attempts: int = Field(8, ge=1)
    webhook_timeout_s: float = Field(10.0, gt=0)
    webhook_backoff_s: float = Field(5.0, gt=0)        # first retry; each next one x4
    webhook_backoff_max_s: float = Field(3600.0, gt=0)

    # arq job runner (`omniflow jobs`) and batch jobs
    jobs_poll_delay_s: float = Field(0.5, gt=0)
    jobs_max_concurrency: int = Field(32, ge=1)
    jobs_grace_s: float = Field(5.0, ge=0)
    batch_chunk_lines: int = Field(100, ge=1)
    batch_concurrency: int = Field(16, ge=1)
    batch_slice_s: float = Field(60.0, gt=0)
    batch_max_lines: int = Field(100_000, ge=1)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value and not value.startswith(REDIS_URL_SCHEMES):
            raise ValueError(f"{value!r} is not a Redis URL: use redis://host:port/db (or rediss://, unix://)")
        return value or None

    def pipeline_path(self) -> Path:
        return self.pipeline or DEFAULT_PIPELINE

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
