"""Retry backoff (pure logic, no Redis)."""
from __future__ import annotations

import random

from omniflow.engine.reconciler import backoff_ms


def test_backoff_grows_exponentially_and_is_capped() -> None:
    rng = random.Random(7)
    delays = [backoff_ms(a, base_s=0.1, cap_s=1.0, jitter=0.0, rng=rng) for a in range(1, 7)]
    assert delays == [100, 200, 400, 800, 1000, 1000]


def test_backoff_jitter_stays_within_its_band() -> None:
    rng = random.Random(7)
    samples = [backoff_ms(3, base_s=0.1, cap_s=10.0, jitter=0.2, rng=rng) for _ in range(500)]
    assert min(samples) >= 320 and max(samples) <= 480
    assert len(set(samples)) > 50          # it really spreads retries out
