"""Operator actions and fleet reads behind the admin CLI and the API's admin routes (the dashboard).

- `collect_stats`: the pools snapshot (per stage: workers, sessions, queue lag/pending and the
  age of the oldest entry, the last minute of work from the workers' windows, dead letters;
  workflows per state and in flight against the admission limit); `list_workers`.
- `set_drain`: drain / undrain a worker (it reads the flag with its heartbeat).
- `retry_workflow`, `purge_finished`, `purge_all`, and the dead-letter streams
  (`dlq_entries`, `dlq_replay`, `dlq_drop`).
"""
from __future__ import annotations

import json
import time
from typing import Any

from omniflow import listing
from omniflow.errors import InvalidRequest, WorkflowNotFound
from omniflow.keys import TASK_GROUP
from omniflow.models import TERMINAL_STATES, SubmitRequest, WorkflowInput, WorkflowState
from omniflow.topology import is_cluster
from omniflow.store import Store, csv, decode_fields, now_ms, s, translate_errors
from omniflow.window import WINDOW_S, merge, percentile

DLQ_EVENTS = "events"           # the dead-letter stream of malformed events (not a stage)
PURGE_BATCH = 500
FINISHED_STATES = tuple(x.value for x in WorkflowState if x in TERMINAL_STATES)


def _ms_of(entry_id: Any) -> int | None:
    """The creation ms of a stream entry id ('1700000000000-3')."""
    text = s(entry_id)
    return int(text.split("-")[0]) if text and text[0].isdigit() else None


def _age_s(ms: int | None, now: int) -> float | None:
    return round(max(0, now - ms) / 1000, 3) if ms else None


def _worker_row(wid: str, expiry: float, info: dict[str, str], now: int) -> dict[str, Any]:
    stages = csv(info.get("stage"))
    active = [int(x) for x in csv(info.get("active"))]
    capacity = [int(x) for x in csv(info.get("capacity"))]
    seen = int(info.get("seen_ms") or 0)
    return {
        "id": wid, "stages": stages, "host": info.get("host") or None,
        "pid": int(info["pid"]) if info.get("pid", "").isdigit() else None,
        "alive": expiry > now, "lease_left_s": round(max(0.0, expiry - now) / 1000, 3),
        "heartbeat_age_s": _age_s(seen, now), "draining": bool(info.get("drain")),
        "sessions": dict(zip(stages, active)), "capacity": dict(zip(stages, capacity)),
        "sessions_held": sum(active),
        "window": json.loads(info["window"]) if info.get("window") else {},
    }


@translate_errors
async def list_workers(store: Store) -> list[dict[str, Any]]:
    """Every registered worker (live or not yet reaped), by id: stages, host, heartbeat age, sessions."""
    now = now_ms()
    members = await store.redis.zrange(store.keys.workers, 0, -1, withscores=True)
    pipe = store.redis.pipeline(transaction=False)
    for wid, _ in members:
        pipe.hgetall(store.keys.worker_info(s(wid)))
    infos = await pipe.execute() if members else []
    rows = [_worker_row(s(wid), float(score), {s(k): s(v) for k, v in info.items()}, now)
            for (wid, score), info in zip(members, infos)]
    return sorted(rows, key=lambda r: r["id"])


@translate_errors
async def collect_stats(store: Store) -> dict[str, Any]:
    """The pools snapshot (`omniflow stats`, `GET /v1/admin/pools`, the dashboard)."""
    redis, keys, order = store.redis, store.keys, store.pipeline.order
    workers = await list_workers(store)
    now = now_ms()
    cells = list(keys.all_cells)
    # every figure is over the cells: each has its own task streams, sets and dead letters
    pipe = redis.pipeline(transaction=False)
    for cell in cells:
        for name in order:
            pipe.xlen(keys.tasks(name, cell))
            pipe.xinfo_groups(keys.tasks(name, cell))
            pipe.xpending(keys.tasks(name, cell), TASK_GROUP)
            pipe.xlen(keys.dlq(name, cell))
        pipe.xlen(keys.dlq(DLQ_EVENTS, cell))
        pipe.zcard(keys.inflight(cell))
        pipe.zcard(keys.retries(cell))
        pipe.xlen(keys.events(cell))
    replies = await pipe.execute(raise_on_error=False)
    width = 4 * len(order) + 4
    per_cell = [replies[width * i: width * (i + 1)] for i in range(len(cells))]
    per_stage = {name: [r[4 * i: 4 * i + 4] for r in per_cell] for i, name in enumerate(order)}
    dlq_events, in_flight, retries, events = (sum(_int(r[4 * len(order) + j]) for r in per_cell) for j in range(4))
    groups: dict[str, list[dict[Any, Any]]] = {
        name: [next((g for g in (r[1] if isinstance(r[1], list) else []) if s(g.get("name")) == TASK_GROUP), {})
               for r in rows] for name, rows in per_stage.items()}
    pipe = redis.pipeline(transaction=False)       # the oldest task nobody has read yet, per stage and cell
    for name in order:
        for cell in cells:
            pipe.xrange(keys.tasks(name, cell), f"({s(groups[name][cell].get('last-delivered-id')) or '0-0'}", "+",
                        count=1)
    firsts = await pipe.execute(raise_on_error=False)
    stages: dict[str, Any] = {}
    for i, (name, rows) in enumerate(per_stage.items()):
        mine = [w for w in workers if w["alive"] and name in w["stages"]]
        window = merge(w["window"].get(name, {}) for w in mine)
        oldest_pending = [_ms_of(r[2].get("min")) for r in rows if isinstance(r[2], dict) and r[2].get("min")]
        oldest_queued = [_ms_of(f[0][0]) for f in firsts[i * len(cells):(i + 1) * len(cells)]
                         if isinstance(f, list) and f]
        stages[name] = {
            "queued": sum(_int(r[0]) for r in rows),
            "lag": sum(int(g.get("lag") or 0) for g in groups[name]),
            "pending": sum(int(g.get("pending") or 0) for g in groups[name]),
            "oldest_pending_age_s": _age_s(min((x for x in oldest_pending if x), default=None), now),
            "oldest_queued_age_s": _age_s(min((x for x in oldest_queued if x), default=None), now),
            "live_workers": len(mine),
            "draining_workers": sum(1 for w in mine if w["draining"]),
            "active_sessions": sum(w["sessions"].get(name, 0) for w in mine),
            "capacity": sum(w["capacity"].get(name, 0) for w in mine),
            "dlq": sum(_int(r[3]) for r in rows),
            "last_minute": {
                "done": window["done"], "failed": window["failed"], "retries": window["retries"],
                "throughput_per_s": round(window["done"] / WINDOW_S, 3),
                "p50_s": percentile(window["hist"], 50), "p99_s": percentile(window["hist"], 99),
            },
        }
    return {
        "at": now / 1000,
        "in_flight": in_flight,
        "max_in_flight": store.settings.max_in_flight,
        "cells": keys.cells,
        "scheduled_retries": int(retries),
        "events_backlog": events,
        "dlq_events": dlq_events,
        "workflows": await store.state_counts(),
        "stages": stages,
        "workers": workers,
    }


@translate_errors
async def set_drain(store: Store, worker_id: str, *, drain: bool) -> dict[str, Any]:
    """Drain (or undrain) a live worker: it stops claiming within a heartbeat; what it holds runs to the end."""
    score = await store.redis.zscore(store.keys.workers, worker_id)
    if score is None or float(score) <= now_ms():
        raise InvalidRequest(f"no live worker {worker_id!r} (see `omniflow workers`)")
    info = store.keys.worker_info(worker_id)
    if drain:
        await store.redis.hset(info, "drain", str(now_ms()))
    else:
        await store.redis.hdel(info, "drain")
    return next(w for w in await list_workers(store) if w["id"] == worker_id)


@translate_errors
async def retry_workflow(store: Store, wf_id: str, *, tenant: str | None = None) -> str:
    """Resubmit a failed/aborted workflow's input as a new workflow; returns the new id."""
    rec = {s(k): s(v) for k, v in (await store.redis.hgetall(store.keys.wf(wf_id))).items()}
    if not rec or (tenant is not None and rec.get("tenant") != tenant):
        raise WorkflowNotFound(f"no workflow {wf_id} (it may have expired)")
    if rec["state"] not in ("failed", "aborted"):
        raise InvalidRequest(f"workflow {wf_id} is {rec['state']}; only failed or aborted ones are retried")
    kinds = sorted({k.split("=", 1)[1] for k in csv(rec.get("kinds"))})
    params = json.loads(rec.get("params") or "{}")
    req = SubmitRequest(input=WorkflowInput.model_validate_json(rec["input"]), output_modalities=kinds,
                        stage_params=params, webhook_url=rec.get("webhook") or None)
    return (await store.submit(req, tenant=rec.get("tenant") or "default")).id


def finished_states(state: str | None) -> tuple[str, ...]:
    """The states `purge --older-than` may delete: the finished ones, or the one asked for."""
    if state is None:
        return FINISHED_STATES
    if state not in FINISHED_STATES:
        raise InvalidRequest(f"--state: {state!r} is not a finished state; one of {list(FINISHED_STATES)}")
    return (state,)


@translate_errors
async def count_finished(store: Store, states: tuple[str, ...], older_than_s: float) -> int:
    """How many finished workflows in `states` were created more than `older_than_s` ago."""
    cutoff = now_ms() - int(older_than_s * 1000)
    pipe = store.redis.pipeline(transaction=False)
    for cell in store.keys.all_cells:
        for state in states:
            pipe.zcount(store.keys.state_index(state, cell), "-inf", f"({cutoff}")
    return sum(int(n) for n in await pipe.execute())


@translate_errors
async def purge_finished(store: Store, states: tuple[str, ...], older_than_s: float) -> int:
    """Delete finished workflows (records, logs, outputs, webhook records, idempotency keys, index
    entries) created more than `older_than_s` ago; live workflows are never touched. Returns how many."""
    redis, keys = store.redis, store.keys
    cutoff = now_ms() - int(older_than_s * 1000)
    deleted = 0
    while True:
        ids = await listing.finished_before(redis, keys, states, cutoff, count=PURGE_BATCH)
        if not ids:
            return deleted
        pipe = redis.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hmget(keys.wf(wf_id), ["state", "tenant", "request_id", "finals"])
        records = await pipe.execute()
        pipe = redis.pipeline(transaction=not is_cluster(redis))    # (a cluster deletes workflow by workflow)
        for wf_id, (state, tenant, rid, finals) in zip(ids, records):
            if s(state) and s(state) not in FINISHED_STATES:
                continue            # the index said finished: never delete a live record on a stale entry
            pipe.unlink(keys.wf(wf_id), keys.stages(wf_id), keys.log(wf_id), keys.done(wf_id),
                        keys.webhook(wf_id), keys.webhook_attempts(wf_id),
                        *(keys.out(wf_id, stage) for stage in csv(finals)))
            if s(rid):
                pipe.unlink(keys.idem(s(tenant), s(rid), keys.cell_of(wf_id)))
            listing.unindex(pipe, keys, wf_id, s(tenant))
            deleted += 1
        await pipe.execute()


@translate_errors
async def purge_all(store: Store) -> int:
    """Delete every key under the prefix (the whole deployment's state). Returns how many."""
    n = 0
    async for key in store.redis.scan_iter(match=f"{store.keys.prefix}:*", count=1000):
        n += await store.redis.unlink(key)
    return n


def dlq_names(store: Store, stage: str | None) -> list[str]:
    """The dead-letter streams meant by `stage` (None: all of them); unknown names are refused."""
    known = [*store.pipeline.order, DLQ_EVENTS]
    if stage is None:
        return known
    if stage not in known:
        raise InvalidRequest(f"unknown stage {stage!r}; dead-letter streams: {known}")
    return [stage]


@translate_errors
async def dlq_entries(store: Store, stage: str | None, limit: int) -> list[dict[str, Any]]:
    """Dead letters, newest first per stream (of one stage, or of all, up to `limit` in total)."""
    rows: list[dict[str, Any]] = []
    for name in dlq_names(store, stage):
        for key in _dlq_keys(store, name):
            for eid, fields in await store.redis.xrevrange(key, count=limit):
                rows.append({"stream": key, "dlq": name, "entry": s(eid), "at": (_ms_of(eid) or 0) / 1000,
                             **decode_fields(fields)})
    return rows[:limit]


def _dlq_keys(store: Store, name: str) -> list[str]:
    """One dead-letter stream per cell."""
    return [store.keys.dlq(name, cell) for cell in store.keys.all_cells]


def _int(value: Any) -> int:
    """A count from a pipeline reply (an error in place counts as 0: e.g. a stream not created yet)."""
    return int(value) if isinstance(value, int) else 0


@translate_errors
async def dlq_replay(store: Store, stage: str | None, entry: str | None) -> list[dict[str, str]]:
    """Resubmit the workflows of dead letters as new workflows and drop the replayed entries."""
    out = []
    for name, key in ((n, k) for n in dlq_names(store, stage) for k in _dlq_keys(store, n)):
        entries = await store.redis.xrange(key, entry, entry) if entry else await store.redis.xrange(key, count=1000)
        for eid, fields in entries:
            row = {"dlq": name, "entry": s(eid), "wf": s(fields.get(b"wf"))}
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


@translate_errors
async def dlq_count(store: Store, stage: str | None, entry: str | None) -> int:
    """How many dead letters `dlq_drop` would delete."""
    pipe = store.redis.pipeline(transaction=False)
    for key in (k for name in dlq_names(store, stage) for k in _dlq_keys(store, name)):
        if entry:
            pipe.xrange(key, entry, entry)
        else:
            pipe.xlen(key)
    return sum(len(r) if isinstance(r, list) else int(r) for r in await pipe.execute())


@translate_errors
async def dlq_drop(store: Store, stage: str | None, entry: str | None) -> int:
    """Delete dead letters (one entry, one stage's, or all); returns how many."""
    n = 0
    for key in (k for name in dlq_names(store, stage) for k in _dlq_keys(store, name)):
        if entry:
            n += await store.redis.xdel(key, entry)
        else:
            n += await store.redis.xlen(key)
            await store.redis.unlink(key)
    return n


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '2h', '7d' -> seconds (> 0)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    raw = text.strip().lower()
    factor = units.get(raw[-1:], None)
    number = raw[:-1] if factor else raw
    try:
        value = float(number) * (factor or 1)
    except ValueError:
        raise InvalidRequest(f"{text!r} is not a duration like 90s, 10m, 2h or 7d") from None
    if not value > 0 or value != value or value == float("inf"):
        raise InvalidRequest(f"{text!r}: a duration must be positive")
    return value


def since_ms(seconds: float | None) -> int | None:
    """The creation-time bound of an age filter: now minus `seconds`."""
    return None if seconds is None else int((time.time() - seconds) * 1000)
