"""Data-plane faults inside the engine (issue 20): a full shared-memory directory, a segment cut
short under its reference, a SIGKILL in the middle of a shared-memory write or read, and every
process of a host stopping cleanly mid-workflow. Each ends with the workflow completed exactly and
nothing of it left in shared memory."""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import eventually, log_entries, request

from dataplane_fixtures import expected_digest, pipeline
from dataplane_killpoints import ENV as KILLPOINT
from dataplane_tmpfs import fill, small_tmpfs
from dataplane_workers import at_least, claimed, consumer_first, files, kill, reading, segments, spawn_worker, worker_of
from omniflow.dataplane import DataPlane, segment
from omniflow.dataplane.shm import DEFAULT_SHM_DIR, ShmTransport, parse_name, shm_available

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
    async with engine_factory(pipeline(chunks=6, nbytes=256 * KIB), workers=False, dataplane_shm_dir=full_shm) as eng:
        prefix = eng.settings.prefix
        sub = await consumer_first(eng)
        doc = await eng.store.wait(sub.id, timeout_s=30)
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
    async with engine_factory(spec, workers=False, dataplane_shm_pool_bytes=0) as eng:   # segments of their own
        prefix = eng.settings.prefix
        sub = await consumer_first(eng)
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


# --------------------------------------------------------------------------- SIGKILL mid-transfer


def killable(spec: dict[str, Any], stage: str, executor: str) -> dict[str, Any]:
    spec["stages"][stage]["executor"] = f"dataplane_killpoints:{executor}"
    return spec


async def _exists(path: Path) -> bool:
    return path.exists()


async def _live(eng: Any, n: int) -> bool:
    return len(await DataPlane(eng.redis, eng.settings).live_workers()) == n


def _pool(where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Settings (engine, worker process) for payloads in arena slots or in segments of their own."""
    return ({"dataplane_shm_pool_bytes": 0}, {"OMNIFLOW_DATAPLANE_SHM_POOL_BYTES": "0"}) if where == "segment" \
        else ({}, {})


@pytest.mark.slow
@pytest.mark.parametrize("where", ["arena", "segment"])
async def test_a_producer_killed_in_the_middle_of_a_shared_memory_write(engine_factory, tmp_path: Path,
                                                                        where: str) -> None:
    """SIGKILLed half-way through copying chunk 4 into its arena slot / its segment: the half-copied
    payload was never referenced (a reference is written once its payload is), the retry resumes after
    the last chunk stored, and nothing of the dead producer outlives the workflow."""
    spec = killable(pipeline(chunks=8, nbytes=256 * KIB, producer_delay_s=0.05), "src", "StallingProducer")
    settings, env = _pool(where)
    mark = tmp_path / "stopped"
    async with engine_factory(spec, workers=False, **settings) as eng:
        prefix = eng.settings.prefix
        await eng.add_worker("dst")
        sub = await eng.store.submit(request("x"))
        await eventually(lambda: claimed(eng, sub.id), timeout_s=30)     # so every chunk goes to shm
        proc = spawn_worker(eng, tmp_path, "src", spec, **{KILLPOINT: f"{where}:4:{mark}"}, **env)
        try:
            await eventually(lambda: _exists(mark), timeout_s=30)
            dead = files(prefix)                                  # the producer's, all of them
            assert dead
        finally:
            kill(proc)
        half = [n for n in dead if (seg := parse_name(n)) and seg.seq == 4]
        if where == "segment":                  # the half-written segment: shorter than its own header says
            path = str(DEFAULT_SHM_DIR / half[0])
            assert segment.is_short(path, segment.read_header(path))
        await eventually(lambda: _live(eng, 1), timeout_s=30)      # its lease lapsed: dead to every sweep
        kept = segments(prefix)
        await DataPlane(eng.redis, eng.settings).sweep()           # the workflow lives: its payloads stay...
        assert segments(prefix) == [n for n in kept if n not in half]     # ... but not a half-written one
        await eng.add_worker("src")                                # the session resumes here
        doc = await eng.store.wait(sub.id, timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(8, 256 * KIB)     # each chunk once, in order
        assert doc["stages"]["src"]["attempt"] == 2 and doc["stages"]["dst"]["attempt"] == 1
        await DataPlane(eng.redis, eng.settings).sweep()
        assert not segments(prefix)
        assert not set(dead) & set(files(prefix))                 # nothing of the dead producer is left


@pytest.mark.slow
@pytest.mark.parametrize("where", ["arena", "segment"])
async def test_a_consumer_killed_in_the_middle_of_a_shared_memory_read(engine_factory, tmp_path: Path,
                                                                       where: str) -> None:
    """SIGKILLed with chunk 4 mapped and half read (its views alive, nothing handed back): the retry
    reads every chunk again from the same shared memory and hands it all back."""
    spec = killable(pipeline(chunks=8, nbytes=256 * KIB), "dst", "StallingConsumer")
    settings, env = _pool(where)
    mark = tmp_path / "stopped"
    async with engine_factory(spec, workers=False, **settings) as eng:
        prefix = eng.settings.prefix
        proc = spawn_worker(eng, tmp_path, "dst", spec, **{KILLPOINT: f"read:4:{mark}"}, **env)
        try:
            sub = await eng.store.submit(request("x"))
            await eventually(lambda: claimed(eng, sub.id), timeout_s=30)  # so every chunk goes to shm
            await eng.add_worker("src")
            await eventually(lambda: _exists(mark), timeout_s=30)
            assert len(segments(prefix)) >= 4                      # what it was reading, in shared memory
        finally:
            kill(proc)
        await eng.add_worker("dst")
        doc = await eng.store.wait(sub.id, timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(8, 256 * KIB)
        assert doc["stages"]["dst"]["attempt"] == 2 and doc["stages"]["src"]["attempt"] == 1
        # released by the worker once it has read its finish's reply (a waiter may see the end first)
        await eventually(lambda: worker_of(eng, "dst").stats["payloads_released"] == 8, what="the payloads released")
        assert not segments(prefix)                                # all handed back by the retry
        await DataPlane(eng.redis, eng.settings).sweep()
        assert not segments(prefix)


# --------------------------------------------------------------------------- a clean stop of a whole host


@pytest.mark.slow
@pytest.mark.parametrize("back", ["on-this-host", "elsewhere"])
async def test_every_process_of_a_host_stopping_cleanly_mid_workflow(engine_factory, tmp_path: Path,
                                                                      back: str) -> None:
    """What a clean stop of a whole host does with its shared memory (docs/architecture.md, "Clean
    stop"): a live workflow's payloads stay in it. When the host's processes come back, the consumer's
    retry reads them (nothing runs again); when the work goes elsewhere, the producer runs again there.
    Either way the workflow completes exactly, and the kept payloads go with the first sweep on this
    host after it ended."""
    spec = pipeline(chunks=8, nbytes=256 * KIB, consumer_delay_s=0.3)
    async with engine_factory(spec, workers=False) as eng:        # (its reconciler: another host's)
        prefix = eng.settings.prefix
        grace = {"OMNIFLOW_SHUTDOWN_GRACE_S": "0.2"}
        host = [spawn_worker(eng, tmp_path, "dst", spec, **grace)]
        sub = await eng.store.submit(request("x"))
        await eventually(lambda: claimed(eng, sub.id), timeout_s=30)    # so every chunk goes to shm
        host.append(spawn_worker(eng, tmp_path, "src", spec, **grace))
        try:
            await eventually(lambda: at_least(eng, sub.id, "src:seq", 8), timeout_s=30)    # all written
            await eventually(lambda: reading(eng, sub.id), timeout_s=30)                    # part-way read
        finally:
            for proc in host:
                proc.send_signal(signal.SIGTERM)
            codes = [proc.wait(timeout=60) for proc in host]
        assert codes == [0, 0]
        stopped = files(prefix)
        kept = [f for f in ShmTransport(prefix).inventory() if f.slot >= 0 or not f.arena]
        assert len(kept) == 8 and {f.wf_id for f in kept} == {sub.id}      # every chunk, of the live workflow
        elsewhere = {"host_id": "other-host"} if back == "elsewhere" else {}
        for stage in ("src", "dst"):
            await eng.add_worker(stage, settings=eng.settings.model_copy(update=elsewhere))
        doc = await eng.store.wait(sub.id, timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(8, 256 * KIB)     # each chunk once, in order
        restarts = [f for f in await log_entries(eng.store, sub.id) if f.get("t") == "restart"]
        if back == "on-this-host":     # the retry read what the stopped producer left: it did not run again
            assert doc["stages"]["src"]["attempt"] == 1 and doc["stages"]["dst"]["attempt"] == 2 and not restarts
            await eventually(lambda: worker_of(eng, "dst").stats["payloads_released"] == 8 and not segments(prefix),
                             what="the payloads released")
        else:                          # another host cannot map them: the producer ran again there
            assert doc["stages"]["src"]["attempt"] == 2 and len(restarts) == 1
            assert set(stopped) & set(files(prefix))                 # left here, until this host's sweep
        await DataPlane(eng.redis, eng.settings).sweep()             # this host's next process
        assert not segments(prefix)
        assert not set(stopped) & set(files(prefix))                 # nothing of the stopped processes
