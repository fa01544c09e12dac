"""What a worker did in the last minute, per stage: sessions finished and failed, retried
attempts claimed, and a histogram of session times (claim -> finish).

Each worker keeps one `StageWindow` and publishes `snapshot()` with its heartbeat (field
`window` of `<p>:worker:<id>`). Histograms over fixed buckets add up, so the dashboard and
`omniflow stats` merge every worker of a stage (`merge`) and read p50/p99 from the sum
(`percentile`): exact to a bucket, linear inside it.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 60.0
SLOT_S = 10.0                   # the window slides in steps of this
# upper bounds of the histogram buckets (seconds); the last bucket is everything above
BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass
class _Slot:
    start: float
    done: int = 0
    failed: int = 0
    retries: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))


class StageWindow:
    """Per-stage counters over the last `WINDOW_S`, in slots of `SLOT_S`."""

    def __init__(self, stages: Iterable[str], *, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._slots: dict[str, list[_Slot]] = {name: [] for name in stages}

    def _slot(self, stage: str) -> _Slot:
        now = self._clock()
        slots = self._slots[stage]
        if not slots or now - slots[-1].start >= SLOT_S:
            slots.append(_Slot(start=now))
            while now - slots[0].start >= WINDOW_S + SLOT_S:
                slots.pop(0)
        return slots[-1]

    def finished(self, stage: str, outcome: str, seconds: float) -> None:
        """A session of `stage` ended (`done`, or anything else counted as failed) after `seconds`."""
        slot = self._slot(stage)
        if outcome == "done":
            slot.done += 1
            slot.hist[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        else:
            slot.failed += 1

    def retried(self, stage: str) -> None:
        """An attempt after the first was claimed."""
        self._slot(stage).retries += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per stage: the sums over the slots of the last minute (JSON-ready)."""
        now = self._clock()
        out = {}
        for stage, slots in self._slots.items():
            live = [x for x in slots if now - x.start < WINDOW_S]
            out[stage] = {"done": sum(x.done for x in live), "failed": sum(x.failed for x in live),
                          "retries": sum(x.retries for x in live),
                          "hist": [sum(col) for col in zip(*(x.hist for x in live))] or [0] * (len(BUCKETS_S) + 1)}
        return out


def merge(windows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Add the windows of several workers of one stage."""
    total: dict[str, Any] = {"done": 0, "failed": 0, "retries": 0, "hist": [0] * (len(BUCKETS_S) + 1)}
    for w in windows:
        for key in ("done", "failed", "retries"):
            total[key] += int(w.get(key) or 0)
        hist = w.get("hist") or []
        if len(hist) == len(total["hist"]):
            total["hist"] = [a + int(b) for a, b in zip(total["hist"], hist)]
    return total


def percentile(hist: list[int], q: float) -> float | None:
    """The `q`-th percentile (0-100) of a `BUCKETS_S` histogram, linear inside a bucket; None if empty."""
    n = sum(hist)
    if n == 0:
        return None
    rank = q / 100 * n
    seen = 0
    for i, count in enumerate(hist):
        if count and seen + count >= rank:
            low = BUCKETS_S[i - 1] if i > 0 else 0.0
            high = BUCKETS_S[i] if i < len(BUCKETS_S) else BUCKETS_S[-1] * 2
            return round(low + (high - low) * max(0.0, rank - seen) / count, 4)
        seen += count
    return BUCKETS_S[-1] * 2
