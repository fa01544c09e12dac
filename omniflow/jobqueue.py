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
from omniflow.keys import Keys

DELIVER_WEBHOOK = "deliver_webhook"
RUN_BATCH_CHUNK = "run_batch_chunk"


def job_serializer(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def job_deserializer(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


def queue_name(settings: Settings) -> str:
    return Keys(settings.prefix).jobs_queue


async def create_job_pool(redis_url: str, settings: Settings, *, conn_retries: int = 5) -> ArqRedis:
    """An arq pool on the omniflow queue with the msgpack codec; redis errors propagate after `conn_retries`."""
    return await create_pool(
        dataclasses.replace(RedisSettings.from_dsn(redis_url), conn_retries=conn_retries),
        job_serializer=job_serializer,
        job_deserializer=job_deserializer,
        default_queue_name=queue_name(settings),
    )
