"""The arq side of omniflow: one queue per prefix, msgpack payloads (never pickle).

Both job kinds (`deliver_webhook`, `run_batch_chunk`) go through the queue
`<prefix>:jobs`; job ids carry the prefix because arq keeps its job, result
and retry keys under its own global `arq:` names.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
from arq.connections import ArqRedis, RedisSettings, create_pool

from omniflow.config import Settings
from omniflow.errors import ConfigError
from omniflow.storage.keys import Keys
from omniflow.storage.topology import ServerKind, parse_sentinel_url, server_kind

DELIVER_WEBHOOK = "deliver_webhook"
RUN_BATCH_CHUNK = "run_batch_chunk"


def job_serializer(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def job_deserializer(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def queue_name(settings: Settings) -> str:
    return Keys(settings.prefix).jobs_queue


def arq_settings(redis_url: str) -> RedisSettings:
    """arq's connection settings for a URL: a single server, or a `redis+sentinel://` service. arq
    cannot use a Redis Cluster (its job keys span slots): give it a single server of its own."""
    kind = server_kind(redis_url)
    if kind is ServerKind.CLUSTER:
        raise ConfigError("the job runner's queue (arq: webhooks and batch jobs) cannot live on a Redis Cluster: "
                          "set OMNIFLOW_JOBS_REDIS_URL to a single Redis (or a redis+sentinel:// service)")
    if kind is ServerKind.SENTINEL:
        spec = parse_sentinel_url(redis_url)
        return RedisSettings(host=list(spec.sentinels), sentinel=True, sentinel_master=spec.service,
                             database=spec.db, username=spec.username, password=spec.password, ssl=spec.ssl)
    return RedisSettings.from_dsn(redis_url)


async def create_job_pool(redis_url: str, settings: Settings, *, conn_retries: int = 5) -> ArqRedis:
    """An arq pool on the omniflow queue with the msgpack codec; redis errors propagate after `conn_retries`."""
    return await create_pool(
        dataclasses.replace(arq_settings(redis_url), conn_retries=conn_retries),
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        default_queue_name=queue_name(settings),
    )
