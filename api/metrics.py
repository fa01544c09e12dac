"""Prometheus metrics, read from Redis at scrape time.

Gauges (queue lag/pending, DLQ sizes, in-flight, live workers) are read fresh
on every scrape (`omniflow.ops.fleet`: the same reads as the pools snapshot). Stage latencies come
from workflow records: each scrape
looks at the workflows created since the last one (and those it saw still
running), and observes, for each one that has become terminal, every stage's
queue wait (`t_start - t_submit`), run time (`t_end - t_start`) and time to
first output chunk (first text/audio entry of the stage in the event log,
looked for in the first `LOG_SCAN` entries). Each API replica keeps its own
histograms over all workflows, so aggregate with `max`, not `sum`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omniflow.ops import fleet
from omniflow.storage.keys import DLQ_EVENTS
from omniflow.models import TERMINAL_STATES, WorkflowState
from omniflow.client.store import Store

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
            for stage in wf_times.stages:
                self._observe_stage(stage, wf_times.fields, wf_times.first_output_ms.get(stage))

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


DATAPLANE_COUNTERS = (
    ("backpressure_waits", "omniflow_backpressure_waits",
     "Emits that waited for their consumer (a chunk edge at its bound), live workers by stage served"),
    ("backpressure_wait_s", "omniflow_backpressure_wait_seconds", "Time emits waited for their consumer"),
    ("payloads_released", "omniflow_dataplane_payloads_released",
     "Chunk payloads (Redis keys, shared-memory segments) released by their consumers"),
    ("segments_swept", "omniflow_dataplane_segments_swept", "Shared-memory segments freed by the host sweep"),
    ("regenerated", "omniflow_dataplane_regenerated",
     "Producer stages run again because a consumer could not read their chunks (another host's shared memory)"),
)


async def render(state: ApiState) -> bytes:
    """The exposition: this process's histograms and the gauges read now (every read goes through
    `omniflow.ops.fleet` or the store: Redis away or refusing is a 503, like every route)."""
    store, stages = state.store, state.pipeline.order
    await state.latency.scan(store)
    queues = await fleet.read_queues(store)
    length = {name: float(sum(q.length for q in queues.stages[name])) for name in stages}
    # each cell has its own task stream: the gauges are sums (a lag Redis cannot tell counts the whole stream)
    lag = {name: float(sum(q.length if q.lag is None else q.lag for q in queues.stages[name])) for name in stages}
    pending = {name: float(sum(q.pending for q in queues.stages[name])) for name in stages}
    dlq = {**{name: float(sum(q.dlq for q in queues.stages[name])) for name in stages},
           DLQ_EVENTS: float(queues.dlq_events)}
    workers = await store.live_workers()
    states = fleet.workers_by_state(await fleet.list_workers(store), stages)
    by_state = GaugeMetricFamily("omniflow_workers", "Registered workers by stage served and state (loading: its "
                                 "models, not live yet; lapsed: dead, not reaped yet)", labels=["stage", "state"])
    for stage, counts in states.items():
        for worker_state, count in counts.items():
            by_state.add_metric([stage, worker_state], count)
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
    for field, value in (await fleet.counters(store)).items():
        if field.startswith("webhook:"):
            webhooks.add_metric([field.split(":", 1)[1]], value)
    dataplane = await fleet.worker_counters(store, tuple(field for field, _, _ in DATAPLANE_COUNTERS))
    families: list[Any] = [
        _gauge("omniflow_workflows", "Non-terminal workflows by state", active, label="state"),
        finished,
        _gauge("omniflow_workflows_in_flight", "Non-terminal workflows (admission counter)", float(queues.in_flight)),
        _gauge("omniflow_admission_limit", "max_in_flight", float(state.settings.max_in_flight)),
        _gauge("omniflow_stage_queue_length", "Entries in the stage's task stream", length),
        _gauge("omniflow_stage_queue_lag", "Tasks not yet delivered to any worker (XINFO GROUPS lag)", lag),
        _gauge("omniflow_stage_queue_pending", "Tasks delivered but not acked (XINFO GROUPS pending)", pending),
        _gauge("omniflow_dlq_size", "Dead letters per stage ('events': malformed events)", dlq),
        _gauge("omniflow_live_workers", "Workers with an unexpired lease", {k: float(v) for k, v in workers.items()}),
        by_state,
        _gauge("omniflow_retries_scheduled", "Stage retries waiting for their backoff", float(queues.retries)),
        _gauge("omniflow_webhook_pending", "Terminal workflows waiting for their webhook", float(queues.notify)),
        retries,
        webhooks,
    ]
    for field, name, doc in DATAPLANE_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["stage"])
        for stage, total in dataplane[field].items():
            counter.add_metric([stage], total)
        families.append(counter)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(state.registry) + generate_latest(registry)
