"""Data-plane faults inside the engine (issue 20): a full shared-memory directory, a segment cut
short under its reference, a SIGKILL in the middle of a shared-memory write or read, and every
process of a host stopping cleanly mid-workflow. Each ends with the workflow completed exactly and
nothing of it left in shared memory."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import eventually, log_entries, request, run_to_end

from dataplane_fixtures import expected_digest, pipeline
from dataplane_tmpfs import fill, small_tmpfs
from dataplane_workers import at_least, files, reading, segments, worker_of
from omniflow.dataplane import DataPlane
from omniflow.dataplane.shm import DEFAULT_SHM_DIR, parse_name, shm_available

pytestmark = pytest.mark.skipif(not shm_available(DEFAULT_SHM_DIR), reason="no /dev/shm on this host")

KIB = 1 << 10


@pytest.fixture
def full_shm() -> Iterator[Path]:
    """A shared-memory directory with no room left (a tmpfs of the test's own, filled)."""
    with small_tmpfs(4 << 20) as where:
        fill(where)
        yield where


async def test_a_full_shared_memory_directory_does_not_fail_the_stage(engine_factory, full_shm: Path) -> None:
    """Every large chunk used to raise ENOSPC out of the producer's emit: the stage burnt its attempts
    on an "executor bug" and the workflow failed. Now the chunks go through Redis keys."""
    async with engine_factory(pipeline(chunks=6, nbytes=256 * KIB), dataplane_shm_dir=full_shm) as eng:
        prefix = eng.settings.prefix
        doc = await run_to_end(eng.store, request("x"), timeout_s=30)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(6, 256 * KIB)
        assert doc["stages"]["src"]["attempt"] == 1                  # no attempt burnt
        producer = worker_of(eng, "src")
        assert producer.plane.domain == worker_of(eng, "dst").plane.domain          # it would have used it
        assert producer.plane.shm.refused > 0                         # ... and went to Redis keys instead
        assert not files(prefix, full_shm)
    assert not files(prefix, full_shm)


async def _segment_of(prefix: str, seq: int) -> str | None:
    return next((seg.name for name in files(prefix) if (seg := parse_name(name)) and seg.seq == seq), None)


async def test_a_segment_cut_short_has_its_producer_run_again(engine_factory) -> None:
    """A truncated segment used to fail the workflow for good (`SizeMismatch`, not retryable); now it
    is regenerated, as a missing one is: the producer runs again, the consumer reads the new chunks."""
    spec = pipeline(chunks=6, nbytes=256 * KIB, consumer_delay_s=0.3)
    async with engine_factory(spec, dataplane_shm_pool_bytes=0) as eng:          # segments of their own
        prefix = eng.settings.prefix
        sub = await eng.store.submit(request("x"))
        await eventually(lambda: at_least(eng, sub.id, "src:seq", 6), timeout_s=30)
        await eventually(lambda: reading(eng, sub.id), timeout_s=30)      # at its first chunk, 0.3 s each
        last = await eventually(lambda: _segment_of(prefix, 6), timeout_s=5)
        os.truncate(DEFAULT_SHM_DIR / last, (DEFAULT_SHM_DIR / last).stat().st_size // 2)
        doc = await eng.store.wait(sub.id, timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(6, 256 * KIB)     # each chunk once, in order
        assert doc["stages"]["src"]["attempt"] == 2                               # run again, once
        assert worker_of(eng, "dst").stats["regenerated"] == 1
        log = await log_entries(eng.store, sub.id)
        restarts = [f for f in log if f.get("t") == "restart"]
        assert len(restarts) == 1 and restarts[0]["stage"] == "src" and restarts[0]["by"] == "dst"
        assert any(f.get("t") == "retry" and "cut short" in f.get("reason", "") for f in log), log
        await DataPlane(eng.redis, eng.settings).sweep()           # attempt 1's unread segments: ended
        assert not segments(prefix)
