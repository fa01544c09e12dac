"""Prometheus metrics, read from Redis at scrape time (docs/operations.md lists every family).

- Gauges (queue lag/pending, DLQ sizes, in-flight, workers by state, sessions held) are read fresh
  on every scrape through `omniflow.ops.fleet` (the same reads as the pools snapshot).
- Per-workflow figures come from workflow records: each scrape looks at the workflows created
  since the last one (and those it saw still running), and observes once, for each one that has
  become terminal, every stage's queue wait (`t_start - t_submit`), run time (`t_end - t_start`)
  and time to first output chunk (first text/audio entry of the stage in the event log, looked for
  in the first `LOG_SCAN` entries), and its serving figures (`omniflow.api.serving`: time to first
  audio, RTF, audio continuity, tokens).
- What workers count in memory (batch sizes, data-plane traffic, backpressure) comes with their
  heartbeats, folded into monotonic counters (`omniflow.api.worker_metrics`).

Each API replica keeps its own histograms and counters over all workflows and workers, so
aggregate replicas with `max`, not `sum`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omniflow.api.serving import ServingFigures
from omniflow.api.worker_metrics import WorkerCounters
from omniflow.client.store import Store
from omniflow.models import TERMINAL_STATES, WorkflowState
from omniflow.ops import fleet
from omniflow.storage.keys import DLQ_EVENTS
from omniflow.storage.schema import StatsField, now_ms

if TYPE_CHECKING:
    from omniflow.api.deps import ApiState

CONTENT_TYPE = CONTENT_TYPE_LATEST
SCAN_BATCH = 2_000
MAX_TRACKED = 20_000
LOG_SCAN = 4_096        # log entries read per finished workflow (its first outputs, its audio chunks)
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
TERMINAL = tuple(x.value for x in TERMINAL_STATES)


class StageLatency:
    """Stage latency histograms and finished-workflow counters, fed from workflow records."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["pipeline", "stage"]
        self.queue_wait = Histogram("omniflow_stage_queue_wait_seconds", "Stage task submitted -> claimed by a worker",
                                    labels, buckets=BUCKETS_S, registry=registry)
        self.run = Histogram("omniflow_stage_run_seconds", "Stage claimed -> finished",
                             labels, buckets=BUCKETS_S, registry=registry)
        self.first_chunk = Histogram("omniflow_stage_first_chunk_seconds",
                                     "Stage claimed -> first text/audio output (final stages)",
                                     labels, buckets=BUCKETS_S, registry=registry)
        self.serving = ServingFigures(registry)
        self.workers = WorkerCounters()
        self.finished: dict[str, int] = dict.fromkeys(TERMINAL, 0)
        self.retries: dict[tuple[str, str], int] = {}       # (pipeline, stage) -> extra attempts
        self.active: dict[str, str] = {}          # wf id -> pending|running
        self._cursors: dict[int, int] = {}        # cell -> creation ms scanned up to

    async def scan(self, store: Store) -> None:
        new = await fleet.created_since(store, self._cursors, limit=SCAN_BATCH)
        for cell, _wf_id, created_ms in new:
            self._cursors[cell] = created_ms
        ids = list(self.active) + [wf_id for _, wf_id, _ in new if wf_id not in self.active]
        ids = ids[:MAX_TRACKED]
        done = []
        for wf_id, state in zip(ids, await fleet.workflow_states(store, ids)):
            if state in TERMINAL:
                done.append((wf_id, state))
                self.active.pop(wf_id, None)
            elif state:
                self.active[wf_id] = state
            else:
                self.active.pop(wf_id, None)
        times = await fleet.stage_times(store, [wf_id for wf_id, _ in done], log_scan=LOG_SCAN)
        for (_wf_id, state), wf_times in zip(done, times):
            self.finished[state] += 1
            pipeline = wf_times.record.get("pipeline") or "unknown"
            for stage in wf_times.stages:
                self._observe_stage(pipeline, stage, wf_times.fields, wf_times.first_output_ms.get(stage))
            self.serving.observe(state, wf_times)

    def _observe_stage(self, pipeline: str, stage: str, st: dict[str, str], first_ms: int | None) -> None:
        submit, start, end, attempt = (int(raw) if (raw := st.get(f"{stage}:{f}") or "").isdigit() else 0
                                       for f in ("t_submit", "t_start", "t_end", "attempt"))
        if attempt > 1:
            self.retries[(pipeline, stage)] = self.retries.get((pipeline, stage), 0) + attempt - 1
        if submit and start >= submit:
            self.queue_wait.labels(pipeline, stage).observe((start - submit) / 1000)
        if start and end >= start and st.get(stage) == "done":
            self.run.labels(pipeline, stage).observe((end - start) / 1000)
        if start and first_ms and first_ms >= start:
            self.first_chunk.labels(pipeline, stage).observe((first_ms - start) / 1000)


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


def _age_s(ms: int | None, now: int) -> float:
    return max(0.0, (now - ms) / 1000) if ms else 0.0


async def _queue_families(state: ApiState) -> list[Metric]:
    """The gauges of the queues and of workflows in flight (read now)."""
    store, stages, now = state.store, list(state.store.stage_queues()), now_ms()
    queues = await fleet.read_queues(store)
    oldest_queued = await fleet.oldest_queued_ms(store, queues)
    stuck = await fleet.stuck(store)
    per_stage = {name: queues.stages[name] for name in stages}
    return [
        _gauge("omniflow_workflows_in_flight", "Non-terminal workflows (admission counter)", float(queues.in_flight)),
        _gauge("omniflow_admission_limit", "max_in_flight", float(state.settings.max_in_flight)),
        _gauge("omniflow_workflows_past_deadline", "Live workflows past their deadline (the reconciler's deadline "
               "sweep ends them within a sweep interval: more for long means it is not running)",
               float(stuck["past_deadline"])),
        _gauge("omniflow_oldest_workflow_age_seconds", "Age of the oldest live workflow in each state (0: none)",
               {live: _age_s(ms, now) for live, ms in stuck["oldest_ms"].items()}, label="state"),
        _gauge("omniflow_stage_queue_length", "Tasks of the stage queued or held, not finished (XINFO GROUPS lag + "
               "pending; the stream's length where Redis cannot tell the lag)",
               {name: float(sum(q.unfinished for q in rows)) for name, rows in per_stage.items()}),
        # each cell has its own task stream: the gauges are sums (a lag Redis cannot tell counts the whole stream)
        _gauge("omniflow_stage_queue_lag", "Tasks not yet delivered to any worker (XINFO GROUPS lag)",
               {name: float(sum(q.length if q.lag is None else q.lag for q in rows)) for name, rows in per_stage.items()}),
        _gauge("omniflow_stage_queue_pending", "Tasks delivered but not acked (XINFO GROUPS pending)",
               {name: float(sum(q.pending for q in rows)) for name, rows in per_stage.items()}),
        _gauge("omniflow_stage_oldest_queued_age_seconds", "Age of the stage's oldest task no worker has read (0: none)",
               {name: _age_s(oldest_queued[name], now) for name in stages}),
        _gauge("omniflow_stage_oldest_pending_age_seconds",
               "Age of the stage's oldest task read by a worker and not finished (0: none)",
               {name: _age_s(min((q.oldest_pending_ms for q in rows if q.oldest_pending_ms), default=None), now)
                for name, rows in per_stage.items()}),
        _gauge("omniflow_dlq_size", "Dead letters per stage ('events': malformed events)",
               {**{name: float(sum(q.dlq for q in rows)) for name, rows in per_stage.items()},
                DLQ_EVENTS: float(queues.dlq_events)}),
        _gauge("omniflow_events_backlog", "Stage reports not yet applied by a reconciler", float(queues.events)),
        _gauge("omniflow_retries_scheduled", "Stage retries waiting for their backoff", float(queues.retries)),
        _gauge("omniflow_webhook_pending", "Terminal workflows waiting for their webhook", float(queues.notify)),
    ]


async def _worker_families(state: ApiState) -> list[Metric]:
    """The workers: by state, sessions held against capacity, and what their heartbeats counted."""
    store, stages = state.store, list(state.store.stage_queues())
    live_workers = await store.live_workers()
    rows = await fleet.list_workers(store)
    by_state = GaugeMetricFamily("omniflow_workers", "Registered workers by stage served and state (loading: its "
                                 "models, not live yet; lapsed: dead, not reaped yet)", labels=["stage", "state"])
    for stage, counts in fleet.workers_by_state(rows, stages).items():
        for worker_state, count in counts.items():
            by_state.add_metric([stage, worker_state], count)
    live = [w for w in rows if w["alive"]]
    state.latency.workers.fold(await fleet.worker_reports(store))
    return [
        _gauge("omniflow_live_workers", "Workers with an unexpired lease",
               {k: float(v) for k, v in live_workers.items()}),
        by_state,
        _gauge("omniflow_stage_sessions", "Sessions held by the live workers of the stage",
               {name: float(sum(w["sessions"].get(name, 0) for w in live)) for name in stages}),
        _gauge("omniflow_stage_capacity", "max_sessions summed over the live workers of the stage",
               {name: float(sum(w["capacity"].get(name, 0) for w in live)) for name in stages}),
        *state.latency.workers.families(stages),
    ]


async def render(state: ApiState) -> bytes:
    """The exposition: this process's histograms and counters, and the gauges read now (every read
    goes through `omniflow.ops.fleet` or the store: Redis away or refusing is a 503, like every route)."""
    store, lat = state.store, state.latency
    await lat.scan(store)
    active = {x.value: 0.0 for x in (WorkflowState.PENDING, WorkflowState.RUNNING)}
    for wf_state in lat.active.values():
        active[wf_state] = active.get(wf_state, 0.0) + 1
    finished = CounterMetricFamily("omniflow_workflows_finished", "Workflows seen reaching a terminal state",
                                   labels=["state"])
    for name, count in lat.finished.items():
        finished.add_metric([name], count)
    retries = CounterMetricFamily("omniflow_stage_retries", "Extra attempts of stages of finished workflows",
                                  labels=["pipeline", "stage"])
    for key in sorted({*lat.retries, *((p.name, stage) for p in store.catalog for stage in p.order)}):
        retries.add_metric(list(key), lat.retries.get(key, 0))
    webhooks = CounterMetricFamily("omniflow_webhook_deliveries", "Webhook deliveries by outcome (from <prefix>:stats)",
                                   labels=["outcome"])
    for field, value in (await fleet.counters(store)).items():
        outcome = StatsField.webhook_outcome(field)
        if outcome is not None:
            webhooks.add_metric([outcome], value)
    families: list[Metric] = [
        _gauge("omniflow_workflows", "Non-terminal workflows by state", active, label="state"),
        finished, retries, webhooks,
        *await _queue_families(state),
        *await _worker_families(state),
    ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(state.registry) + generate_latest(registry)
