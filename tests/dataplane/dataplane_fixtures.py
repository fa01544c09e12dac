"""Executors for the data-plane engine tests (importable by worker subprocesses: tests/dataplane on
PYTHONPATH)."""
from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from omniflow.executor import Executor, Session


def block(i: int, nbytes: int) -> np.ndarray:
    """Chunk i's payload: deterministic, so a retried producer writes the same bytes."""
    return np.full(nbytes // 4, i, dtype=np.float32)


class BigProducer(Executor):
    """Emits `chunks` arrays of `nbytes` bytes (deterministic: a retry resumes without duplicates),
    `delay_s` apart."""

    runs_on = "loop"

    async def run(self, session: Session) -> Mapping[str, Any]:
        p = {**self.params, **session.params}
        n, nbytes, delay = int(p.get("chunks", 8)), int(p.get("nbytes", 1 << 20)), float(p.get("delay_s", 0.0))
        for i in range(1, n + 1):
            await session.emit(data={"i": i, "h": block(i, nbytes)})
            if delay:
                await asyncio.sleep(delay)      # the producer's pace (simulated)
        return {"chunks": n}


class DigestConsumer(Executor):
    """Reads every chunk (checking its content), then emits a digest of what it read as its text."""

    runs_on = "loop"

    async def run(self, session: Session) -> Mapping[str, Any]:
        p = {**self.params, **session.params}
        delay = float(p.get("delay_s", 0.0))
        digest = hashlib.sha256()
        n = 0
        async for chunk in session.inputs():
            h = chunk.data["h"]
            assert isinstance(h, np.ndarray) and h.dtype == np.float32 and bool((h == chunk.data["i"]).all())
            digest.update(h.tobytes())
            n += 1
            if delay:
                await asyncio.sleep(delay)      # the consumer's pace (simulated)
        await session.emit(text=f"{n}:{digest.hexdigest()[:16]}")
        return {"chunks": n}


def expected_digest(chunks: int, nbytes: int) -> str:
    digest = hashlib.sha256()
    for i in range(1, chunks + 1):
        digest.update(block(i, nbytes).tobytes())
    return f"{chunks}:{digest.hexdigest()[:16]}"


def pipeline(*, chunks: int = 8, nbytes: int = 1 << 20, producer_delay_s: float = 0.0,
             consumer_delay_s: float = 0.0, max_attempts: int = 3) -> dict[str, Any]:
    retry = {"max_attempts": max_attempts, "backoff_s": 0.01, "backoff_max_s": 0.05, "input_timeout_s": 60}
    return {
        "name": "dataplane-test",
        "stages": {
            "src": {"executor": "dataplane_fixtures:BigProducer", "retry": retry,
                    "params": {"chunks": chunks, "nbytes": nbytes, "delay_s": producer_delay_s}},
            "dst": {"executor": "dataplane_fixtures:DigestConsumer", "final_output": "text", "retry": retry,
                    "params": {"delay_s": consumer_delay_s}},
        },
        "edges": [{"from": "src", "to": "dst"}],
    }
