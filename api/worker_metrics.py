"""What the workers count, as Prometheus counters: the counters their heartbeats publish (`stats`,
`serving`: `omniflow.engine.worker.serving`) folded into this API process's own.

A worker's counters start at 0 with its process. Summed over the live workers they would drop
whenever one stops, which Prometheus reads as a counter reset (and `rate()` as a huge increase).
So each scrape adds each worker's *growth* since the previous scrape (by worker id; a worker seen
for the first time adds everything it counted; one whose counters went down restarted under the
same id and adds its new values) to totals that only grow. What a worker counted after the
heartbeat last read before it died is lost; nothing is counted twice. A malformed entry in a
heartbeat is skipped with one log line per worker and field.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from omniflow.executor.stepping import BATCH_BUCKETS
from omniflow.ops.fleet import WorkerReport

logger = logging.getLogger(__name__)

#: counters of a worker's `stats` (the whole worker: labelled with the stages it serves, comma-separated)
STATS = (
    ("backpressure_waits", "omniflow_backpressure_waits",
     "Emits that waited for their consumer (a chunk edge at its bound), by the stages the worker serves"),
    ("backpressure_wait_s", "omniflow_backpressure_wait_seconds", "Time emits waited for their consumer"),
    ("payloads_released", "omniflow_dataplane_payloads_released",
     "Chunk payloads (Redis keys, shared-memory segments) released by their consumers"),
    ("segments_swept", "omniflow_dataplane_segments_swept", "Shared-memory segments freed by the host sweep"),
    ("regenerated", "omniflow_dataplane_regenerated",
     "Producer stages run again because a consumer could not read their chunks (another host's shared memory)"),
)
TRANSPORTS = ("inline", "redis", "shm")
Key = tuple[str, ...]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


class WorkerCounters:
    """Monotonic totals of what the workers counted (see the module docstring)."""

    def __init__(self) -> None:
        self.totals: dict[Key, float] = {}
        self._last: dict[str, dict[Key, float]] = {}       # worker id -> its values at the last fold
        self._warned: set[tuple[str, str]] = set()

    def _skip(self, worker_id: str, what: str) -> None:
        if (worker_id, what) not in self._warned:
            self._warned.add((worker_id, what))
            logger.warning("worker %s: its heartbeat's %s is malformed; skipped", worker_id, what)

    def _values(self, report: WorkerReport) -> dict[Key, float]:
        """One worker's counters, flat: ('stat', field, label), ('batch', stage, 'steps'|'sessions'|bucket
        index), ('dataplane', stage, transport, 'chunks'|'bytes')."""
        out: dict[Key, float] = {}
        for field, _, _ in STATS:
            if field in report.stats:
                value = _number(report.stats[field])
                if value is None:
                    self._skip(report.id, f"stats.{field}")
                else:
                    out[("stat", field, report.label)] = value
        for stage, entry in report.serving.items():
            if not isinstance(entry, dict):
                self._skip(report.id, f"serving.{stage}")
                continue
            self._batch(report.id, stage, entry.get("batch"), out)
            self._traffic(report.id, stage, entry.get("dataplane"), out)
        return out

    def _batch(self, worker_id: str, stage: str, batch: Any, out: dict[Key, float]) -> None:
        if batch is None:
            return
        hist = batch.get("hist") if isinstance(batch, dict) else None
        counts = [_number(x) for x in hist] if isinstance(hist, list) else []
        steps, sessions = (_number(batch.get(k)) if isinstance(batch, dict) else None for k in ("steps", "sessions"))
        if len(counts) != len(BATCH_BUCKETS) + 1 or any(x is None for x in counts) or steps is None \
                or sessions is None:
            self._skip(worker_id, f"serving.{stage}.batch")
            return
        out[("batch", stage, "steps")] = steps
        out[("batch", stage, "sessions")] = sessions
        for i, count in enumerate(counts):
            out[("batch", stage, str(i))] = float(count or 0)

    def _traffic(self, worker_id: str, stage: str, traffic: Any, out: dict[Key, float]) -> None:
        if not isinstance(traffic, dict):
            if traffic is not None:
                self._skip(worker_id, f"serving.{stage}.dataplane")
            return
        for transport, counts in traffic.items():
            pair = [_number(x) for x in counts] if isinstance(counts, list) and len(counts) == 2 else []
            if transport not in TRANSPORTS or len(pair) != 2 or pair[0] is None or pair[1] is None:
                self._skip(worker_id, f"serving.{stage}.dataplane.{transport}")
                continue
            out[("dataplane", stage, transport, "chunks")] = pair[0]
            out[("dataplane", stage, transport, "bytes")] = pair[1]

    def fold(self, reports: Iterable[WorkerReport]) -> None:
        """Add each reported worker's growth since the last fold; forget the workers gone (reaped)."""
        seen: set[str] = set()
        for report in reports:
            values = self._values(report)
            before = self._last.get(report.id, {})
            for key, value in values.items():
                grown = value - before.get(key, 0.0)
                self.totals[key] = self.totals.get(key, 0.0) + (value if grown < 0 else grown)
            self._last[report.id] = values
            seen.add(report.id)
        for worker_id in set(self._last) - seen:
            del self._last[worker_id]

    def families(self, stages: Iterable[str]) -> list[Metric]:
        """The exposition: every stage of `stages` appears in every family (0 until counted)."""
        stages = list(stages)
        out: list[Metric] = []
        for field, name, doc in STATS:
            family = CounterMetricFamily(name, doc, labels=["stage"])
            labels = {key[2] for key in self.totals if key[:2] == ("stat", field)} | set(stages)
            for label in sorted(labels):
                family.add_metric([label], self.totals.get(("stat", field, label), 0.0))
            out.append(family)
        batch = HistogramMetricFamily("omniflow_batch_size", "Sessions stepped together per step of a batched "
                                      "executor's step loop (batch occupancy)", labels=["stage"])
        for stage in sorted({key[1] for key in self.totals if key[0] == "batch"}):
            cumulative, buckets = 0.0, []
            for i, bound in enumerate((*BATCH_BUCKETS, math.inf)):
                cumulative += self.totals.get(("batch", stage, str(i)), 0.0)
                buckets.append(("+Inf" if bound == math.inf else str(bound), cumulative))
            batch.add_metric([stage], buckets, sum_value=self.totals.get(("batch", stage, "sessions"), 0.0))
        out.append(batch)
        for unit, doc in (("chunks", "Chunk payloads sent to downstream stages, by transport"),
                          ("bytes", "Bytes of chunk payloads sent, by transport (inline: encoded in the entry)")):
            family = CounterMetricFamily(f"omniflow_dataplane_{unit}", doc, labels=["stage", "transport"])
            for stage in stages:
                for transport in TRANSPORTS:
                    family.add_metric([stage, transport], self.totals.get(("dataplane", stage, transport, unit), 0.0))
            out.append(family)
        return out
