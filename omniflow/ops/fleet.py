"""What operators watch: the reads behind `omniflow stats`/`workers`, the API's admin routes
(the dashboard) and `/metrics`.

- `collect_stats`: the pools snapshot (per stage: workers, sessions, queue lag/pending and the
  age of the oldest entry, the last minute of work from the workers' windows, dead letters;
  workflows per state and in flight against the admission limit).
- `list_workers` / `workers_by_state`: every registered worker (its state: loading, ready, draining,
  stopping, lapsed; stages, host, heartbeat age, sessions, drain flag).
- `read_queues`: every cell's task streams, dead letters and sets in one round trip (the
  snapshot's and the metrics' gauges); `counters`.
- `created_since`, `workflow_states`, `stage_times`: what the metrics' per-workflow figures (stage
  latencies, time to first audio, RTF, audio continuity, tokens) are observed from.
- `worker_reports`: the counters workers publish with their heartbeats (batch sizes, data plane).

Every function takes a `Store` and comes out with its errors translated (`omniflow.storage.redisio`).
The operator's actions (drain, retry, purge, dead letters) are in `omniflow.ops.admin`.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omniflow.storage import listing, registry
from omniflow.storage.keys import DLQ_EVENTS, PRIORITY_NAMES, TASK_GROUP
from omniflow.storage.redisio import translated
from omniflow.storage.schema import csv, log_events_raw, now_ms, s, stages_in_record, text_fields
from omniflow.engine.window import WINDOW_S, merge, percentile
from omniflow.models import WorkerState

logger = logging.getLogger(__name__)

#: text and audio log entries: a stage's first one is its time to first output
OUTPUT_EVENTS = ("text", "audio")

if TYPE_CHECKING:       # (the store's deadline shedding reads the queues through this module)
    from omniflow.client.store import Store


def entry_ms(entry_id: Any) -> int | None:
    """The creation ms of a stream entry id ('1700000000000-3')."""
    text = s(entry_id)
    return int(text.split("-")[0]) if text and text[0].isdigit() else None


def _age_s(ms: int | None, now: int) -> float | None:
    return round(max(0, now - ms) / 1000, 3) if ms else None


def _int(value: Any) -> int:
    """A count from a pipeline reply (an error in place counts as 0: e.g. a stream not created yet)."""
    return int(value) if isinstance(value, int) else 0


# ---------------------------------------------------------------- workers
def worker_state(*, leased: bool, loading: bool, info: dict[str, str]) -> WorkerState:
    """What a registered worker is doing: `leased` its lease is current, `loading` its loading
    announcement is (it is in the loading set and that has not lapsed)."""
    if leased:
        if info.get("state") == WorkerState.STOPPING.value:
            return WorkerState.STOPPING
        return WorkerState.DRAINING if info.get("drain") else WorkerState.READY
    return WorkerState.LOADING if loading else WorkerState.LAPSED


def _worker_row(wid: str, expiry: float, loading_until: float, info: dict[str, str], now: int) -> dict[str, Any]:
    stages = csv(info.get("stage"))
    active = [int(x) for x in csv(info.get("active")) if x.isdigit()]
    capacity = [int(x) for x in csv(info.get("capacity")) if x.isdigit()]
    seen = int(info.get("seen_ms") or 0) if (info.get("seen_ms") or "").isdigit() else 0
    since = int(info["since_ms"]) if (info.get("since_ms") or "").isdigit() else None
    state = worker_state(leased=expiry > now, loading=loading_until > now, info=info)
    try:
        window = json.loads(info["window"]) if info.get("window") else {}
    except ValueError:
        logger.warning("worker %s: its heartbeat's window does not decode; shown empty", wid)
        window = {}
    return {
        "id": wid, "stages": stages, "host": info.get("host") or None,
        "pid": int(info["pid"]) if info.get("pid", "").isdigit() else None,
        "state": state.value, "state_age_s": _age_s(since, now),
        "alive": expiry > now, "lease_left_s": round(max(0.0, expiry - now) / 1000, 3),
        "heartbeat_age_s": _age_s(seen, now), "draining": bool(info.get("drain")),
        "sessions": dict(zip(stages, active)), "capacity": dict(zip(stages, capacity)),
        "runs_on": dict(zip(stages, csv(info.get("runs")))),
        "sessions_held": sum(active),
        "window": {k: v for k, v in window.items() if isinstance(v, dict)} if isinstance(window, dict) else {},
    }


@translated
async def list_workers(store: Store) -> list[dict[str, Any]]:
    """Every registered worker (live, loading its models, or not yet reaped), by id: its state, stages,
    host, heartbeat age, sessions."""
    now = now_ms()
    pipe = store.client.pipeline(transaction=False)
    pipe.zrange(store.keys.workers, 0, -1, withscores=True)
    pipe.zrange(store.keys.workers_loading, 0, -1, withscores=True)
    leased, loading = await pipe.execute()
    expiry = {s(wid): float(score) for wid, score in leased}
    loading_until = {s(wid): float(score) for wid, score in loading}
    ids = sorted(set(expiry) | set(loading_until))
    pipe = store.client.pipeline(transaction=False)
    for wid in ids:
        pipe.hgetall(store.keys.worker_info(wid))
    infos = await pipe.execute() if ids else []
    return [_worker_row(wid, expiry.get(wid, 0.0), loading_until.get(wid, 0.0),
                        text_fields(info), now)
            for wid, info in zip(ids, infos)]


def workers_by_state(workers: list[dict[str, Any]], stages: tuple[str, ...] | list[str]) -> dict[str, dict[str, int]]:
    """stage -> state -> how many of `workers` (`list_workers` rows) serving it are in that state; every
    state of every stage is there (0 included). A worker serving several stages counts for each."""
    out = {stage: dict.fromkeys((x.value for x in WorkerState), 0) for stage in stages}
    for w in workers:
        for stage in w["stages"]:
            if stage in out and w["state"] in out[stage]:
                out[stage][w["state"]] += 1
    return out


# ---------------------------------------------------------------- queues
@dataclass(frozen=True)
class StageQueue:
    """One stage's task stream of one priority class in one cell."""

    length: int
    group: dict[Any, Any]           # the `workers` group's XINFO GROUPS row ({} before the group exists)
    oldest_pending_ms: int | None   # creation ms of the oldest task delivered and not yet acknowledged
    dlq: int                        # its dead letters in that cell (counted on the `api` class's row)
    stream: str = ""
    priority: str = "api"

    @property
    def lag(self) -> int | None:
        """Tasks not yet delivered to any worker; None when Redis cannot tell (XINFO GROUPS lag)."""
        raw = self.group.get("lag")
        return None if raw is None else int(raw)

    @property
    def pending(self) -> int:
        return int(self.group.get("pending") or 0)

    @property
    def unfinished(self) -> int:
        """Tasks queued or held: lag + pending. A finished task's entry stays in the stream until the
        next trim (`trim_tasks.lua`, every half second), so the stream's length counts some that are
        done: it is the answer only where Redis cannot tell the lag."""
        lag = self.lag
        return self.length if lag is None else lag + self.pending


@dataclass(frozen=True)
class Queues:
    """The task streams of every stage (one `StageQueue` per cell) and the cells' sets, summed."""

    stages: dict[str, list[StageQueue]]
    dlq_events: int          # malformed events
    in_flight: int
    retries: int             # stage retries waiting for their backoff
    events: int              # stage reports not yet applied
    notify: int              # terminal workflows waiting for their webhook


@translated
async def read_queues(store: Store) -> Queues:
    """Every cell's task streams, dead letters and sets, in one round trip."""
    redis, keys = store.client, store.keys
    by_stage = store.stage_queues()         # a stage of several pipelines (versions): the sum of its queues
    order = [(name, queue) for name, queues in by_stage.items() for queue in queues]
    pipe = redis.pipeline(transaction=False)
    for cell in keys.all_cells:
        for name, queue in order:
            for stream in keys.task_streams(queue, cell):
                pipe.xlen(stream)
                pipe.xinfo_groups(stream)
                pipe.xpending(stream, TASK_GROUP)
            if queue == by_stage[name][0]:      # dead letters are per stage name: counted once
                pipe.xlen(keys.dlq(name, cell))
            else:
                pipe.echo("0")
        pipe.xlen(keys.dlq(DLQ_EVENTS, cell))
        pipe.zcard(keys.inflight(cell))
        pipe.zcard(keys.retries(cell))
        pipe.xlen(keys.events(cell))
        pipe.xlen(keys.notify(cell))
    replies = await pipe.execute(raise_on_error=False)
    per_stage = 3 * len(PRIORITY_NAMES) + 1
    width = per_stage * len(order) + 5
    per_cell = [replies[width * i: width * (i + 1)] for i in keys.all_cells]
    stages: dict[str, list[StageQueue]] = {}
    for i, (name, queue) in enumerate(order):
        stages.setdefault(name, [])
        for cell, row in zip(keys.all_cells, per_cell):
            part = row[per_stage * i: per_stage * (i + 1)]
            dlq = part[-1]
            for j, (prio, stream) in enumerate(zip(PRIORITY_NAMES, keys.task_streams(queue, cell))):
                length, groups, pending = part[3 * j: 3 * j + 3]
                group: dict[Any, Any] = next(
                    (g for g in (groups if isinstance(groups, list) else []) if s(g.get("name")) == TASK_GROUP), {})
                oldest = entry_ms(pending.get("min")) if isinstance(pending, dict) and pending.get("min") else None
                stages[name].append(StageQueue(length=_int(length), group=group, oldest_pending_ms=oldest,
                                               dlq=_int(dlq) if prio == "api" else 0, stream=stream, priority=prio))
    dlq_events, in_flight, retries, events, notify = (sum(_int(row[per_stage * len(order) + j]) for row in per_cell)
                                                      for j in range(5))
    return Queues(stages=stages, dlq_events=dlq_events, in_flight=in_flight, retries=retries, events=events,
                  notify=notify)


@translated
async def counters(store: Store) -> dict[str, int]:
    """The deployment's counters (`<prefix>:stats`: webhook deliveries by outcome, ...)."""
    raw = await store.client.hgetall(store.keys.stats)
    return {s(k): int(s(v)) for k, v in (raw or {}).items() if s(v).lstrip("-").isdigit()}


@translated
async def oldest_queued_ms(store: Store, queues: Queues) -> dict[str, int | None]:
    """Per stage, the creation ms of the oldest task no worker has read yet (over the cells; None: none)."""
    pipe = store.client.pipeline(transaction=False)
    spans = []
    for name, rows in queues.stages.items():      # one row per queue, cell and priority class (read_queues)
        spans.append((name, len(rows)))
        for row in rows:
            pipe.xrange(row.stream, f"({s(row.group.get('last-delivered-id')) or '0-0'}", "+", count=1)
    firsts = await pipe.execute(raise_on_error=False)
    out: dict[str, int | None] = {}
    at = 0
    for name, n in spans:
        found = [entry_ms(f[0][0]) for f in firsts[at:at + n] if isinstance(f, list) and f]
        at += n
        out[name] = min((x for x in found if x), default=None)
    return out


@translated
async def stuck(store: Store) -> dict[str, Any]:
    """What says workflows are stuck: how many live ones are past their deadline (the reconciler's
    deadline sweep ends them within a sweep interval), and the creation ms of the oldest pending and
    the oldest running one (None: none), over the cells."""
    past_deadline, oldest = await listing.live_ages(store.client, store.keys, now_ms(),
                                                    longest_ms=int(store.settings.max_deadline_s * 1000))
    return {"past_deadline": past_deadline, "oldest_ms": oldest}


# ---------------------------------------------------------------- the pools snapshot
@translated
async def collect_stats(store: Store) -> dict[str, Any]:
    """The pools snapshot (`omniflow stats`, `GET /v1/admin/pools`, the dashboard)."""
    keys, order = store.keys, list(store.stage_queues())
    workers = await list_workers(store)
    now = now_ms()
    # every figure is over the cells: each has its own task streams, sets and dead letters
    queues = await read_queues(store)
    oldest = await oldest_queued_ms(store, queues)
    stages: dict[str, Any] = {}
    for name in order:
        rows = queues.stages[name]
        mine = [w for w in workers if w["alive"] and name in w["stages"]]
        window = merge(w["window"].get(name, {}) for w in mine)
        stages[name] = {
            "queued": sum(r.unfinished for r in rows),
            "lag": sum(r.lag or 0 for r in rows),
            "pending": sum(r.pending for r in rows),
            "oldest_pending_age_s": _age_s(min((r.oldest_pending_ms for r in rows if r.oldest_pending_ms),
                                               default=None), now),
            "oldest_queued_age_s": _age_s(oldest[name], now),
            "live_workers": len(mine),
            "draining_workers": sum(1 for w in mine if w["draining"]),
            "loading_workers": sum(1 for w in workers if w["state"] == WorkerState.LOADING.value
                                   and name in w["stages"]),
            "active_sessions": sum(w["sessions"].get(name, 0) for w in mine),
            "capacity": sum(w["capacity"].get(name, 0) for w in mine),
            "dlq": sum(r.dlq for r in rows),
            "last_minute": {
                "done": window["done"], "failed": window["failed"], "retries": window["retries"],
                "throughput_per_s": round(window["done"] / WINDOW_S, 3),
                "p50_s": percentile(window["hist"], 50), "p99_s": percentile(window["hist"], 99),
            },
        }
    return {
        "at": now / 1000,
        "in_flight": queues.in_flight,
        "max_in_flight": store.settings.max_in_flight,
        "cells": keys.cells,
        "scheduled_retries": queues.retries,
        "events_backlog": queues.events,
        "dlq_events": queues.dlq_events,
        "workflows": await store.state_counts(),
        "stages": stages,
        "workers": workers,
        "pipelines": await registry.snapshot(store.client, keys),
    }


# ---------------------------------------------------------------- stage latencies
@translated
async def created_since(store: Store, after_ms: dict[int, int], *, limit: int) -> list[tuple[int, str, int]]:
    """(cell, id, creation ms) of up to `limit` workflows per cell created after `after_ms[cell]`
    (exclusive; a cell not in it: from the first), oldest first, every cell in one round trip."""
    pipe = store.client.pipeline(transaction=False)
    for cell in store.keys.all_cells:
        low = f"({after_ms[cell]}" if cell in after_ms else "-inf"
        pipe.zrangebyscore(store.keys.all_wf(cell), low, "+inf", start=0, num=limit, withscores=True)
    return [(cell, s(member), int(score)) for cell, reply in zip(store.keys.all_cells, await pipe.execute())
            for member, score in reply]


@translated
async def workflow_states(store: Store, ids: list[str]) -> list[str]:
    """The state of each workflow ('' for one that is gone)."""
    if not ids:
        return []
    pipe = store.client.pipeline(transaction=False)
    for wf_id in ids:
        pipe.hget(store.keys.wf(wf_id), "state")
    return [s(x) for x in await pipe.execute()]


@dataclass(frozen=True)
class AudioChunk:
    """One `audio` entry of a workflow's log: when clients could read it, and how much audio it is."""

    at_ms: int
    seq: int
    samples: int
    sample_rate: int


@dataclass(frozen=True)
class StageTimes:
    """What a finished workflow says about its stages' timing."""

    stages: list[str]              # the stages it ran
    fields: dict[str, str]         # its stage hash (`<s>:t_submit`, `<s>:t_start`, `<s>:t_end`, `<s>:attempt`, ...)
    first_output_ms: dict[str, int]   # per stage, the time of its first text/audio log entry
    record: dict[str, str] = field(default_factory=dict)   # pipeline, created_ms, finished_ms of the record
    first_text_ms: dict[str, int] = field(default_factory=dict)     # per stage, its first `text` log entry
    audio: dict[str, list[AudioChunk]] = field(default_factory=dict)  # per stage, its `audio` entries in order
    log_truncated: bool = False    # the log had more than the entries read


RECORD_FIELDS = ("stages", "pipeline", "created_ms", "finished_ms")


def _audio_chunk(eid: Any, entry: dict[bytes, bytes]) -> AudioChunk | None:
    at = entry_ms(eid)
    seq, samples, rate = (s(entry.get(k)) for k in (b"seq", b"samples", b"sr"))
    if at is None or not (seq.isdigit() and samples.isdigit() and rate.isdigit()) or int(rate) == 0:
        return None
    return AudioChunk(at_ms=at, seq=int(seq), samples=int(samples), sample_rate=int(rate))


@translated
async def stage_times(store: Store, ids: list[str], *, log_scan: int) -> list[StageTimes]:
    """The stage timings of each workflow, from its record (with its stage fields) and the first `log_scan`
    entries of its log (first outputs, every audio chunk)."""
    if not ids:
        return []
    pipe = store.client.pipeline(transaction=False)
    for wf_id in ids:
        pipe.hgetall(store.keys.wf(wf_id))                # the record, with the stage fields
        pipe.hgetall(store.keys.stages_legacy(wf_id))     # (but for a workflow of before: `Keys.stages`)
        pipe.xrange(store.keys.log(wf_id), count=log_scan)
    replies = await pipe.execute()
    out = []
    for i in range(len(ids)):
        raw_record, legacy, log = replies[3 * i: 3 * i + 3]
        full = text_fields(raw_record)
        fields = full if stages_in_record(full) else text_fields(legacy)
        first: dict[str, int] = {}
        first_text: dict[str, int] = {}
        audio: dict[str, list[AudioChunk]] = {}
        for eid, entry in ((eid, event) for eid, fields in log or [] for event in log_events_raw(fields)):
            kind = s(entry.get(b"t"))
            if kind not in OUTPUT_EVENTS:
                continue
            stage = s(entry.get(b"stage"))
            first.setdefault(stage, entry_ms(eid) or 0)
            if kind == "text":
                first_text.setdefault(stage, entry_ms(eid) or 0)
                continue
            chunk = _audio_chunk(eid, entry)
            if chunk is None:
                logger.warning("workflow %s: a malformed audio log entry %s skipped", ids[i], s(eid))
                continue
            audio.setdefault(stage, []).append(chunk)
        record = {name: full.get(name, "") for name in RECORD_FIELDS}
        out.append(StageTimes(stages=csv(record.get("stages")), fields=fields,
                              first_output_ms=first, record=record, first_text_ms=first_text, audio=audio,
                              log_truncated=len(log or []) >= log_scan))
    return out


# ---------------------------------------------------------------- what workers count (heartbeats)
@dataclass(frozen=True)
class WorkerReport:
    """A registered worker's counters, as its last heartbeat published them."""

    id: str
    label: str                       # the stages it serves, comma-separated
    stats: dict[str, Any]            # its `stats` field (counters of the whole worker)
    serving: dict[str, Any]          # its `serving` field (per stage: batch sizes, data-plane traffic)


def _json_object(raw: Any, worker_id: str, name: str) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        logger.warning("worker %s: its heartbeat's %s is not a JSON object; skipped", worker_id, name)
        return {}
    return value


@translated
async def worker_reports(store: Store) -> list[WorkerReport]:
    """Every worker holding a lease entry (live, or dead and not reaped yet): its published counters."""
    ids = [s(x) for x in await store.client.zrange(store.keys.workers, 0, -1)]
    if not ids:
        return []
    pipe = store.client.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hmget(store.keys.worker_info(worker_id), "stage", "stats", "serving")
    return [WorkerReport(id=worker_id, label=s(label), stats=_json_object(stats, worker_id, "stats"),
                         serving=_json_object(serving, worker_id, "serving"))
            for worker_id, (label, stats, serving) in zip(ids, await pipe.execute())]
