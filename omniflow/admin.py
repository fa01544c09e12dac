"""Operator actions behind the CLI (and the API's admin routes)."""
from __future__ import annotations

import json
from typing import Any

from redis.exceptions import ResponseError

from omniflow.errors import InvalidRequest, WorkflowNotFound
from omniflow.keys import TASK_GROUP
from omniflow.models import SubmitRequest, WorkflowInput
from omniflow.store import Store, csv, decode_fields, now_ms, s, translate_errors


@translate_errors
async def retry_workflow(store: Store, wf_id: str) -> str:
    """Resubmit a failed/aborted workflow's input as a new workflow; returns the new id."""
    rec = {s(k): s(v) for k, v in (await store.redis.hgetall(store.keys.wf(wf_id))).items()}
    if not rec:
        raise WorkflowNotFound(f"no workflow {wf_id} (it may have expired)")
    if rec["state"] not in ("failed", "aborted"):
        raise InvalidRequest(f"workflow {wf_id} is {rec['state']}; only failed or aborted ones are retried")
    kinds = sorted({k.split("=", 1)[1] for k in csv(rec.get("kinds"))})
    params = json.loads(rec.get("params") or "{}")
    req = SubmitRequest(input=WorkflowInput.model_validate_json(rec["input"]), output_modalities=kinds,
                        stage_params=params, webhook_url=rec.get("webhook") or None)
    return (await store.submit(req, tenant=rec.get("tenant") or "default")).id


@translate_errors
async def collect_stats(store: Store) -> dict[str, Any]:
    now = now_ms()
    workers = await store.redis.zrangebyscore(store.keys.workers, now, "+inf")
    pipe = store.redis.pipeline(transaction=False)
    for wid in workers:
        pipe.hmget(store.keys.worker_info(s(wid)), "stage", "active", "capacity")
    infos = await pipe.execute() if workers else []
    stages: dict[str, Any] = {}
    for name in store.pipeline.order:
        groups: list[dict[Any, Any]] = []
        try:
            groups = await store.redis.xinfo_groups(store.keys.tasks(name))
        except ResponseError:
            groups = []
        group = next((g for g in groups if s(g.get("name")) == TASK_GROUP), {})
        # a worker serving several stages lists them (and its per-stage figures) comma-separated
        mine = [(int(a or 0), int(c or 0)) for st, act, cap in infos
                for x, a, c in zip(csv(s(st)), csv(s(act)), csv(s(cap))) if x == name]
        stages[name] = {
            "queued": await store.redis.xlen(store.keys.tasks(name)),
            "lag": int(group.get("lag") or 0),
            "pending": int(group.get("pending") or 0),
            "live_workers": len(mine),
            "active_sessions": sum(a for a, _ in mine),
            "capacity": sum(c for _, c in mine),
            "dlq": await store.redis.xlen(store.keys.dlq(name)),
        }
    return {
        "in_flight": await store.redis.zcard(store.keys.inflight),
        "max_in_flight": store.settings.max_in_flight,
        "scheduled_retries": await store.redis.zcard(store.keys.retries),
        "events_backlog": await store.redis.xlen(store.keys.events),
        "stages": stages,
    }


@translate_errors
async def purge_all(store: Store) -> int:
    n = 0
    async for key in store.redis.scan_iter(match=f"{store.keys.prefix}:*", count=1000):
        n += await store.redis.unlink(key)
    return n


@translate_errors
async def dlq_entries(store: Store, stage: str | None, limit: int) -> list[dict[str, Any]]:
    names = [stage] if stage else [*store.pipeline.order, "events"]
    rows = []
    for name in names:
        key = store.keys.dlq(name)
        for eid, fields in await store.redis.xrevrange(key, count=limit):
            rows.append({"stream": key, "entry": s(eid), **decode_fields(fields)})
    return rows[:limit] if stage is None else rows


@translate_errors
async def dlq_replay(store: Store, stage: str, entry: str | None) -> list[dict[str, str]]:
    key = store.keys.dlq(stage)
    entries = await store.redis.xrange(key, entry, entry) if entry else await store.redis.xrange(key, count=1000)
    out = []
    for eid, fields in entries:
        row = {"entry": s(eid), "wf": s(fields.get(b"wf"))}
        if not row["wf"]:
            row["skipped"] = "malformed entry: nothing to replay"
        else:
            try:
                row["new_id"] = await retry_workflow(store, row["wf"])
            except (WorkflowNotFound, InvalidRequest) as exc:
                row["skipped"] = str(exc)
        if "new_id" in row:
            await store.redis.xdel(key, eid)
        out.append(row)
    return out
