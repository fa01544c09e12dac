"""The pipeline registry: which pipelines (and versions) a deployment serves, in Redis.

Every process started with `--pipeline` registers each of its pipelines (`register`): the
canonical definition under its version (the content hash, `Pipeline.digest`; never overwritten)
and, when that version is new, the name pointing at it. So a worker started with a new pipeline
adds it to a running deployment: the API's `/v1/models` and `model` lookups see it without a
restart, and every reconciler can find the definition of any version a workflow records.

    <prefix>:{pipelines}        hash  name    -> version new workflows of that name get
    <prefix>:{pipelines}:defs   hash  version -> {"definition": …, "registered_ms": …} (JSON)

Which workers serve a version is not stored here: each worker's heartbeat lists its task queues
(`queues`: `<stage>@<version>`), and `served` reads them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from omniflow.errors import PipelineError
from omniflow.pipeline import Pipeline, build_pipeline, parse_queue
from omniflow.storage.client import RedisClient
from omniflow.storage.keys import Keys
from omniflow.storage.schema import csv, now_ms, s, text_fields


@dataclass
class Registered:
    """One registered version."""

    name: str
    version: str
    registered_ms: int
    current: bool                           # the version its name picks for new workflows
    pipeline: Pipeline | None               # None: the stored definition no longer loads here
    workers: dict[str, list[str]] = field(default_factory=dict)   # stage -> live worker ids serving it


async def register(redis: RedisClient, keys: Keys, pipe: Pipeline) -> bool:
    """Register `pipe` (idempotent). A version seen for the first time becomes the one its name
    picks; a known one (a worker of it restarting) changes nothing. True when it was new."""
    doc = json.dumps({"definition": pipe.canonical(), "registered_ms": now_ms()}, sort_keys=True)
    created = bool(await redis.hsetnx(keys.pipeline_defs, pipe.digest, doc))
    if created or not await redis.hexists(keys.pipelines, pipe.name):
        await redis.hset(keys.pipelines, pipe.name, pipe.digest)
    return created


def _load(raw: bytes | str, version: str) -> tuple[Pipeline | None, int]:
    try:
        doc = json.loads(raw)
        pipe = build_pipeline(doc["definition"], source=f"registered pipeline {version}")
        return pipe, int(doc.get("registered_ms", 0))
    except (ValueError, KeyError, TypeError, PipelineError):
        return None, 0


async def fetch(redis: RedisClient, keys: Keys, version: str) -> Pipeline | None:
    """The registered pipeline of one version (None: not registered, or it no longer loads)."""
    raw = await redis.hget(keys.pipeline_defs, version)
    return None if raw is None else _load(raw, version)[0]


async def current(redis: RedisClient, keys: Keys, name: str) -> Pipeline | None:
    """The version a name picks for new workflows (None: no such name registered)."""
    version = await redis.hget(keys.pipelines, name)
    return None if version is None else await fetch(redis, keys, s(version))


async def names(redis: RedisClient, keys: Keys) -> dict[str, str]:
    """name -> current version of every registered pipeline."""
    return text_fields(await redis.hgetall(keys.pipelines))


async def served(redis: RedisClient, keys: Keys, *, claiming: bool = False) -> dict[str, list[str]]:
    """queue (`<stage>@<version>`) -> the live workers that claim from it (`claiming`: drained ones left out)."""
    ids = [s(w) for w in await redis.zrangebyscore(keys.workers, f"({now_ms()}", "+inf")]
    out: dict[str, list[str]] = {}
    if not ids:
        return out
    pipe = redis.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hmget(keys.worker_info(worker_id), "queues", "drain")
    for worker_id, (queues, drain) in zip(ids, await pipe.execute()):
        if claiming and drain:
            continue
        for queue in csv(queues):
            out.setdefault(queue, []).append(worker_id)
    return out


async def listing(redis: RedisClient, keys: Keys) -> list[Registered]:
    """Every registered version with the live workers serving each of its stages, newest first per name."""
    pipe = redis.pipeline(transaction=False)
    pipe.hgetall(keys.pipelines)
    pipe.hgetall(keys.pipeline_defs)
    raw_names, raw_defs = await pipe.execute()
    currents = {s(v) for v in raw_names.values()}
    live_queues = await served(redis, keys)
    by_version: dict[str, dict[str, list[str]]] = {}
    for queue, serving in live_queues.items():
        try:
            stage, version = parse_queue(queue)
        except PipelineError:
            continue
        by_version.setdefault(version, {})[stage] = serving
    out: list[Registered] = []
    for raw_version, raw in raw_defs.items():
        version = s(raw_version)
        loaded, at = _load(raw, version)
        name = loaded.name if loaded is not None else _name_of(raw)
        workers = {st: by_version.get(version, {}).get(st, []) for st in (loaded.order if loaded else ())}
        out.append(Registered(name=name, version=version, registered_ms=at, current=version in currents,
                              pipeline=loaded, workers=workers))
    out.sort(key=lambda r: (r.name, -r.registered_ms))
    return out


async def snapshot(redis: RedisClient, keys: Keys) -> list[dict[str, Any]]:
    """The registry as JSON-ready rows (`omniflow pipelines`, `stats`, `GET /v1/admin/pools`)."""
    return [{"name": r.name, "version": r.version, "current": r.current, "registered_at": r.registered_ms / 1000,
             "input_modalities": r.pipeline.input_modalities if r.pipeline else [],
             "output_modalities": r.pipeline.output_modalities if r.pipeline else [],
             "workers": r.workers} for r in await listing(redis, keys)]


def _name_of(raw: bytes | str) -> str:
    try:
        return str(json.loads(raw)["definition"]["name"])
    except (ValueError, KeyError, TypeError):
        return "?"


def describe(pipe: Pipeline) -> dict[str, Any]:
    """What `/v1/models` and `omniflow pipelines` say about one pipeline."""
    return {"name": pipe.name, "version": pipe.digest, "input_modalities": pipe.input_modalities,
            "output_modalities": pipe.output_modalities, "stages": list(pipe.order)}
