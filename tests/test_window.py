"""The per-stage window a worker publishes with its heartbeat (pure logic)."""
from __future__ import annotations

from omniflow.engine.window import BUCKETS_S, StageWindow, merge, percentile


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_window_counts_the_last_minute_only() -> None:
    clock = Clock()
    win = StageWindow(["thinker"], clock=clock)
    win.finished("thinker", "done", 0.2)
    win.finished("thinker", "failed", 1.0)
    win.retried("thinker")
    clock.now += 30
    win.finished("thinker", "done", 0.2)
    snap = win.snapshot()["thinker"]
    assert (snap["done"], snap["failed"], snap["retries"]) == (2, 1, 1)
    clock.now += 45                       # the first slot is now over a minute old
    snap = win.snapshot()["thinker"]
    assert (snap["done"], snap["failed"], snap["retries"]) == (1, 0, 0)
    clock.now += 61
    assert win.snapshot()["thinker"]["done"] == 0


def test_merged_histograms_give_percentiles_within_a_bucket() -> None:
    a, b = StageWindow(["s"]), StageWindow(["s"])
    for _ in range(98):
        a.finished("s", "done", 0.03)     # bucket (0.025, 0.05]
    b.finished("s", "done", 4.0)          # bucket (2.5, 5]
    b.finished("s", "done", 4.0)
    total = merge([a.snapshot()["s"], b.snapshot()["s"]])
    assert total["done"] == 100 and len(total["hist"]) == len(BUCKETS_S) + 1
    assert 0.025 < percentile(total["hist"], 50) <= 0.05
    assert 2.5 < percentile(total["hist"], 99) <= 5.0
    assert percentile([0] * (len(BUCKETS_S) + 1), 50) is None
