"""Prometheus metrics, read from Redis at scrape time.

Gauges (queue lag/pending, DLQ sizes, in-flight, live workers) are read fresh
on every scrape. Stage latencies come from workflow records: each scrape
looks at the workflows created since the last one (and those it saw still
running), and observes, for each one that has become terminal, every stage's
queue wait (`t_start - t_submit`), run time (`t_end - t_start`) and time to
first output chunk (first text/audio entry of the stage in the event log,
looked for in the first `LOG_SCAN` entries). Each API replica keeps its own
histograms over all workflows, so aggregate with `max`, not `sum`.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from omniflow.api.fleet import live_workers
from omniflow.keys import TASK_GROUP, Keys
from omniflow.models import TERMINAL_STATES, WorkflowState
from omniflow.redisio import translated
from omniflow.store import csv, s

if TYPE_CHECKING:
    from omniflow.api.deps import ApiState

CONTENT_TYPE = CONTENT_TYPE_LATEST
SCAN_BATCH = 2_000
MAX_TRACKED = 20_000
LOG_SCAN = 256
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
TERMINAL = tuple(x.value for x in TERMINAL_STATES)


class StageLatency:
    """Stage latency histograms and finished-workflow counters, fed from workflow records."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["stage"]
        self.queue_wait = Histogram("omniflow_stage_queue_wait_seconds", "Stage task submitted -> claimed by a worker",
                                    labels, buckets=BUCKETS_S, registry=registry)
        self.run = Histogram("omniflow_stage_run_seconds", "Stage claimed -> finished",
                             labels, buckets=BUCKETS_S, registry=registry)
        self.first_chunk = Histogram("omniflow_stage_first_chunk_seconds",
                                     "Stage claimed -> first text/audio output (final stages)",
                                     labels, buckets=BUCKETS_S, registry=registry)
        self.finished: dict[str, int] = dict.fromkeys(TERMINAL, 0)
        self.retries: dict[str, int] = {}
        self.active: dict[str, str] = {}          # wf id -> pending|running
        self._cursors: dict[int, str] = {}        # cell -> creation ms scanned up to

    async def scan(self, redis: Redis, keys: Keys) -> None:
        new = []
        for cell in keys.all_cells:
            got = await redis.zrangebyscore(keys.all_wf(cell), self._cursors.get(cell, "-inf"), "+inf", start=0,
                                            num=SCAN_BATCH, withscores=True)
            if got:
                self._cursors[cell] = f"({int(got[-1][1])}"
            new += got
        ids = list(self.active) + [s(m) for m, _ in new if s(m) not in self.active]
        ids = ids[:MAX_TRACKED]
        if not ids:
            return
        pipe = redis.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hget(keys.wf(wf_id), "state")
        states = [s(x) for x in await pipe.execute()]
        done = []
        for wf_id, state in zip(ids, states):
            if state in TERMINAL:
                done.append((wf_id, state))
                self.active.pop(wf_id, None)
            elif state:
                self.active[wf_id] = state
            else:
                self.active.pop(wf_id, None)
        if done:
            await self._observe(redis, keys, done)

    async def _observe(self, redis: Redis, keys: Keys, done: list[tuple[str, str]]) -> None:
        pipe = redis.pipeline(transaction=False)
        for wf_id, _ in done:
            pipe.hget(keys.wf(wf_id), "stages")
            pipe.hgetall(keys.stages(wf_id))
            pipe.xrange(keys.log(wf_id), count=LOG_SCAN)
        replies = await pipe.execute()
        for i, (_wf_id, state) in enumerate(done):
            stages_csv, raw, log = replies[3 * i: 3 * i + 3]
            self.finished[state] += 1
            st = {s(k): s(v) for k, v in (raw or {}).items()}
            first: dict[str, int] = {}
            for eid, fields in log or []:
                if s(fields.get(b"t")) in ("text", "audio"):
                    first.setdefault(s(fields.get(b"stage")), int(s(eid).split("-")[0]))
            for stage in csv(stages_csv):
                self._observe_stage(stage, st, first.get(stage))

    def _observe_stage(self, stage: str, st: dict[str, str], first_ms: int | None) -> None:
        submit, start, end = (int(st.get(f"{stage}:{f}") or 0) for f in ("t_submit", "t_start", "t_end"))
        attempt = int(st.get(f"{stage}:attempt") or 0)
        if attempt > 1:
            self.retries[stage] = self.retries.get(stage, 0) + attempt - 1
        if submit and start >= submit:
            self.queue_wait.labels(stage).observe((start - submit) / 1000)
        if start and end >= start and st.get(stage) == "done":
            self.run.labels(stage).observe((end - start) / 1000)
        if start and first_ms and first_ms >= start:
            self.first_chunk.labels(stage).observe((first_ms - start) / 1000)


class _Snapshot(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _gauge(name: str, doc: str, values: dict[str, float] | float, label: str = "stage") -> GaugeMetricFamily:
    if isinstance(values, dict):
        family = GaugeMetricFamily(name, doc, labels=[label])
        for key, value in values.items():
            family.add_metric([key], value)
        return family
    return GaugeMetricFamily(name, doc, value=values)


async def _queue_stats(redis: Redis, keys: Keys, stages: tuple[str, ...]) -> tuple[dict[str, float], ...]:
    length, lag, pending = {}, {}, {}
    for stage in stages:
        length[stage] = lag[stage] = pending[stage] = 0.0
        for cell in keys.all_cells:         # each cell has its own task stream: the gauges are sums
            key = keys.tasks(stage, cell)
            n = float(await redis.xlen(key))
            try:
                groups = await redis.xinfo_groups(key)
            except ResponseError:           # the stream does not exist yet
                groups = []
            info = next((g for g in groups if s(g.get("name")) == TASK_GROUP), None)
            raw_lag = info.get("lag") if info else None
            length[stage] += n
            pending[stage] += float(info.get("pending") or 0) if info else 0.0
            lag[stage] += float(raw_lag) if raw_lag is not None else n
    return length, lag, pending


DATAPLANE_COUNTERS = (
    ("backpressure_waits", "omniflow_backpressure_waits",
     "Emits that waited for their consumer (a chunk edge at its bound), live workers by stage served"),
    ("backpressure_wait_s", "omniflow_backpressure_wait_seconds", "Time emits waited for their consumer"),
    ("payloads_released", "omniflow_dataplane_payloads_released",
     "Chunk payloads (Redis keys, shared-memory segments) released by their consumers"),
    ("segments_swept", "omniflow_dataplane_segments_swept", "Shared-memory segments freed by the host sweep"),
)


async def _worker_counters(redis: Redis, keys: Keys) -> dict[str, dict[str, float]]:
    """The data-plane counters of the live workers' heartbeats, summed per stage served
    (a worker serving several stages is counted under their comma list)."""
    ids = [s(x) for x in await redis.zrangebyscore(keys.workers, "(" + str(int(time.time() * 1000)), "+inf")]
    out: dict[str, dict[str, float]] = {field: {} for field, _, _ in DATAPLANE_COUNTERS}
    if not ids:
        return out
    pipe = redis.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hmget(keys.worker_info(worker_id), "stage", "stats")
    for stage, raw in await pipe.execute():
        try:
            stats = json.loads(raw) if raw else {}
        except ValueError:
            continue
        for field, _, _ in DATAPLANE_COUNTERS:
            value = stats.get(field)
            if isinstance(value, (int, float)):
                out[field][s(stage)] = out[field].get(s(stage), 0.0) + float(value)
    return out


@translated                   # Redis away or refusing: 503 with Retry-After, like every route
async def render(state: ApiState) -> bytes:
    redis, keys, stages = state.redis, state.store.keys, state.pipeline.order
    await state.latency.scan(redis, keys)
    length, lag, pending = await _queue_stats(redis, keys, stages)
    pipe = redis.pipeline(transaction=False)
    names = (*stages, "events")
    for cell in keys.all_cells:
        for stage in names:
            pipe.xlen(keys.dlq(stage, cell))
        pipe.zcard(keys.inflight(cell))
        pipe.zcard(keys.retries(cell))
        pipe.xlen(keys.notify(cell))
    pipe.hgetall(keys.stats)
    *per_cell, stats = await pipe.execute()
    width = len(names) + 3                  # the sums over the cells of each figure
    totals = [sum(per_cell[i::width]) for i in range(width)]
    dlq, (inflight, retries_due, notify) = totals[:len(names)], totals[len(names):]
    workers = await live_workers(state.store)
    lat = state.latency
    active = {x.value: 0.0 for x in (WorkflowState.PENDING, WorkflowState.RUNNING)}
    for wf_state in lat.active.values():
        active[wf_state] = active.get(wf_state, 0.0) + 1
    finished = CounterMetricFamily("omniflow_workflows_finished", "Workflows seen reaching a terminal state",
                                   labels=["state"])
    for name, count in lat.finished.items():
        finished.add_metric([name], count)
    retries = CounterMetricFamily("omniflow_stage_retries", "Extra attempts of stages of finished workflows",
                                  labels=["stage"])
    for stage in stages:
        retries.add_metric([stage], lat.retries.get(stage, 0))
    webhooks = CounterMetricFamily("omniflow_webhook_deliveries", "Webhook deliveries by outcome (from <prefix>:stats)",
                                   labels=["outcome"])
    for field, value in ((s(k), s(v)) for k, v in (stats or {}).items()):
        if field.startswith("webhook:") and value.lstrip("-").isdigit():
            webhooks.add_metric([field.split(":", 1)[1]], int(value))
    dataplane = await _worker_counters(redis, keys)
    families: list[Any] = [
        _gauge("omniflow_workflows", "Non-terminal workflows by state", active, label="state"),
        finished,
        _gauge("omniflow_workflows_in_flight", "Non-terminal workflows (admission counter)", float(inflight)),
        _gauge("omniflow_admission_limit", "max_in_flight", float(state.settings.max_in_flight)),
        _gauge("omniflow_stage_queue_length", "Entries in the stage's task stream", length),
        _gauge("omniflow_stage_queue_lag", "Tasks not yet delivered to any worker (XINFO GROUPS lag)", lag),
        _gauge("omniflow_stage_queue_pending", "Tasks delivered but not acked (XINFO GROUPS pending)", pending),
        _gauge("omniflow_dlq_size", "Dead letters per stage ('events': malformed events)",
               dict(zip((*stages, "events"), (float(x) for x in dlq)))),
        _gauge("omniflow_live_workers", "Workers with an unexpired lease", {k: float(v) for k, v in workers.items()}),
        _gauge("omniflow_retries_scheduled", "Stage retries waiting for their backoff", float(retries_due)),
        _gauge("omniflow_webhook_pending", "Terminal workflows waiting for their webhook", float(notify)),
        retries,
        webhooks,
    ]
    for field, name, doc in DATAPLANE_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["stage"])
        for stage, value in dataplane[field].items():
            counter.add_metric([stage], value)
        families.append(counter)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(state.registry) + generate_latest(registry)
