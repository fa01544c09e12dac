"""The data plane inside the engine: large payloads by reference, release, backpressure, bad
references, and worker processes SIGKILLed mid-stream."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import eventually, omniflow, request, run_to_end

from dataplane_fixtures import expected_digest, pipeline
from dataplane_workers import (
    at_least, blob_keys, claimed, consumer_first, files, kill, reading, segments, spawn_worker, worker_env, worker_of,
)
from omniflow.config import DataPlaneMode
from omniflow.dataplane import DataPlane, Ref, TransportKind
from omniflow.dataplane.shm import DEFAULT_SHM_DIR, shm_available
from omniflow.storage.schema import log_events_raw

pytestmark = pytest.mark.skipif(not shm_available(DEFAULT_SHM_DIR), reason="no /dev/shm on this host")

KIB = 1 << 10


async def test_large_payloads_travel_through_shared_memory_and_are_released(engine_factory) -> None:
    async with engine_factory(pipeline(chunks=6, nbytes=256 * KIB), workers=False) as eng:
        sub = await consumer_first(eng)       # else the first chunks may go before it is known to be here
        doc = await eng.store.wait(sub.id, timeout_s=30)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(6, 256 * KIB)
        consumer = worker_of(eng, "dst")
        # by reference, released once its finish is written (the client may hear of the end first)
        await eventually(lambda: consumer.stats["payloads_released"] == 6, what="the 6 payloads released")
        assert not await blob_keys(eng)                          # none went through Redis keys
        prefix = eng.settings.prefix
        assert not segments(prefix)                              # handed back: the producer's arena holds none
        assert files(prefix)                                     # ... and stays, for the next payloads
        await DataPlane(eng.redis, eng.settings).sweep()         # the workflow ended: nothing of it stays
        assert not segments(prefix)
    assert not files(prefix)                                     # the arenas go with their workers


async def test_small_payloads_stay_inline(engine_factory) -> None:
    async with engine_factory(pipeline(chunks=5, nbytes=4 * KIB)) as eng:
        doc = await run_to_end(eng.store, request("x"), timeout_s=30)
        assert doc["state"] == "completed", doc["error"]
        assert worker_of(eng, "dst").stats["payloads_released"] == 0
        assert not segments(eng.settings.prefix) and not await blob_keys(eng)


async def test_redis_transport_stores_payloads_with_the_entry_and_the_terminal_frees_them(engine_factory) -> None:
    async with engine_factory(pipeline(chunks=6, nbytes=200 * KIB, consumer_delay_s=0.05),
                              dataplane_mode=DataPlaneMode.REDIS) as eng:
        sub = await eng.store.submit(request("x"))
        blobs = await eventually(lambda: blob_keys(eng), timeout_s=20)     # while the consumer reads
        ttl_ms = await eng.redis.pttl(blobs[0])
        assert ttl_ms > eng.settings.max_deadline_s * 1000
        doc = await eng.store.wait(sub.id, timeout_s=30)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(6, 200 * KIB)
        assert not await blob_keys(eng)                          # released by the consumer, then the terminal
        assert not segments(eng.settings.prefix)


async def test_the_terminal_frees_payload_keys_nobody_released(engine_factory) -> None:
    """Aborted while its consumer still reads: finalize (in the abort script) unlinks the workflow's
    payload keys at once; the shared-memory segments of the same run go with the abort fan-out."""
    async with engine_factory(pipeline(chunks=6, nbytes=200 * KIB, consumer_delay_s=1.0),
                              dataplane_mode=DataPlaneMode.REDIS) as eng:
        sub = await eng.store.submit(request("x"))
        await eventually(lambda: blob_keys(eng), timeout_s=20)
        await eng.store.abort(sub.id)
        assert not await blob_keys(eng)
        assert not await eng.redis.exists(eng.store.keys.blobs(sub.id))


async def test_a_bad_reference_fails_the_session_with_its_reason_and_the_worker_keeps_serving(
        engine_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = pipeline(chunks=3, nbytes=200 * KIB, max_attempts=1)
    async with engine_factory(spec, dataplane_mode=DataPlaneMode.REDIS) as eng:
        producer = worker_of(eng, "src")
        real = producer.plane.rediskey.put_op

        def corrupt(payload: Any, ctx: Any) -> tuple[Ref, list[Any]]:
            ref, op = real(payload, ctx)
            return Ref(ref.kind, ref.location, ref.nbytes, ref.checksum ^ 1, ref.host), op

        monkeypatch.setattr(producer.plane.rediskey, "put_op", corrupt)
        doc = await run_to_end(eng.store, request("x"), timeout_s=30)
        assert doc["state"] == "failed" and doc["error_stage"] == "dst"
        assert "checksum" in doc["error"], doc["error"]
        monkeypatch.setattr(producer.plane.rediskey, "put_op", real)
        doc = await run_to_end(eng.store, request("y"), timeout_s=30)
        assert doc["state"] == "completed", doc["error"]


async def test_backpressure_holds_a_fast_producer_to_the_bound(engine_factory) -> None:
    spec = pipeline(chunks=30, nbytes=2 * KIB, consumer_delay_s=0.01)
    async with engine_factory(spec, dataplane_edge_max_chunks=4, dataplane_edge_max_bytes=0) as eng:
        doc = await run_to_end(eng.store, request("x"), timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(30, 2 * KIB)
        bp = worker_of(eng, "src").backpressure
        assert bp.waits > 0 and bp.wait_s > 0
        assert 0 < bp.peak_chunks <= 4
        await worker_of(eng, "src").liveness.heartbeat_once()
        info = await eng.redis.hget(eng.store.keys.worker_info(worker_of(eng, "src").id), "stats")
        assert b'"backpressure_waits": ' in info


async def test_without_a_bound_the_same_producer_runs_ahead(engine_factory) -> None:
    """The control of the test above: the same pipeline, no bound, no wait."""
    spec = pipeline(chunks=30, nbytes=2 * KIB, consumer_delay_s=0.01)
    async with engine_factory(spec, dataplane_edge_max_chunks=0, dataplane_edge_max_bytes=0) as eng:
        doc = await run_to_end(eng.store, request("x"), timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert worker_of(eng, "src").backpressure.waits == 0


# --------------------------------------------------------------------------- worker processes, SIGKILL


@pytest.mark.slow
async def test_a_producer_killed_mid_stream_resumes_elsewhere_and_leaves_no_segment(engine_factory,
                                                                                  tmp_path: Path) -> None:
    spec = pipeline(chunks=12, nbytes=256 * KIB, producer_delay_s=0.1)
    async with engine_factory(spec, workers=False) as eng:
        await eng.add_worker("dst")
        sub = await eng.store.submit(request("x"))
        await eventually(lambda: claimed(eng, sub.id), timeout_s=30)     # so its chunks go to shared memory
        proc = spawn_worker(eng, tmp_path, "src", spec)
        try:
            await eventually(lambda: at_least(eng, sub.id, "src:seq", 4), timeout_s=30)
            assert segments(eng.settings.prefix)                 # the producer's chunks, by reference
        finally:
            kill(proc)
        await eng.add_worker("src")                              # the session resumes here
        doc = await eng.store.wait(sub.id, timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(12, 256 * KIB)   # each chunk once, in order
        assert doc["stages"]["src"]["attempt"] == 2
        # `inspect` shows the binding: each attempt of the producer on its replica
        code, out, err = await omniflow("inspect", sub.id, "--json", env=worker_env(eng, tmp_path, spec))
        assert code == 0, err
        lanes = {lane["stage"]: lane for lane in json.loads(out)["lanes"]}
        replicas = [a["replica"] for a in lanes["src"]["attempts"]]
        assert len(replicas) == 2 and all(replicas) and replicas[0] != replicas[1]
        assert replicas[1] == worker_of(eng, "src").id
        await DataPlane(eng.redis, eng.settings).sweep()
        assert not segments(eng.settings.prefix)


@pytest.mark.slow
async def test_a_consumer_killed_mid_read_resumes_from_the_edge_log(engine_factory, tmp_path: Path) -> None:
    spec = pipeline(chunks=10, nbytes=256 * KIB, consumer_delay_s=0.3)
    async with engine_factory(spec, workers=False) as eng:
        await eng.add_worker("src")
        proc = spawn_worker(eng, tmp_path, "dst", spec)
        try:
            sub = await eng.store.submit(request("x"))
            # the producer has written everything; the consumer is part-way through it
            await eventually(lambda: at_least(eng, sub.id, "src:seq", 10), timeout_s=30)
            await eventually(lambda: reading(eng, sub.id), timeout_s=30)
        finally:
            kill(proc)
        await eng.add_worker("dst")
        doc = await eng.store.wait(sub.id, timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(10, 256 * KIB)
        assert doc["stages"]["dst"]["attempt"] == 2
        await DataPlane(eng.redis, eng.settings).sweep()
        assert not segments(eng.settings.prefix)


async def _reader_on_this_host_killed(eng: Any, tmp_path: Path, spec: dict[str, Any]) -> tuple[str, Any]:
    """The producer (a worker here) streams its chunks into this host's shared memory for a consumer
    process on this host, SIGKILLed part-way through reading them; its retry can only land on a
    worker of another host (added here, returned with the workflow id)."""
    proc = spawn_worker(eng, tmp_path, "dst", spec)
    try:
        # the consumer's session is claimed before the producer starts: the producer learns its host at
        # once (shared memory from the first chunk on)
        sub = await eng.store.submit(request("x"))
        await eventually(lambda: claimed(eng, sub.id), timeout_s=30)
        await eng.add_worker("src")
        chunks = spec["stages"]["src"]["params"]["chunks"]
        await eventually(lambda: at_least(eng, sub.id, "src:seq", chunks), timeout_s=30)
        await eventually(lambda: reading(eng, sub.id), timeout_s=30)
        assert segments(eng.settings.prefix)            # the chunks, in this host's shared memory
    finally:
        kill(proc)
    other = await eng.add_worker("dst", settings=eng.settings.model_copy(update={"host_id": "other-host"}))
    return sub.id, other


@pytest.mark.slow
async def test_a_consumer_retried_on_another_host_has_its_producer_run_again(engine_factory, tmp_path: Path) -> None:
    """The consumer's retry lands on another host, which cannot map the chunks (as when their host
    died with them). Retrying the consumer there could never read them: the producer runs again
    instead (its new chunks go through Redis keys, the consumer being elsewhere), and the workflow
    completes exactly."""
    spec = pipeline(chunks=10, nbytes=256 * KIB, producer_delay_s=0.15, consumer_delay_s=0.3)
    async with engine_factory(spec, workers=False) as eng:
        wf_id, other = await _reader_on_this_host_killed(eng, tmp_path, spec)
        doc = await eng.store.wait(wf_id, timeout_s=60)
        assert doc["state"] == "completed", doc["error"]
        assert doc["outputs"]["dst"]["text"] == expected_digest(10, 256 * KIB)     # each chunk once, in order
        assert doc["stages"]["src"]["attempt"] == 2                                  # run again, once
        assert other.stats["regenerated"] == 1
        log = [event for _, fields in await eng.redis.xrange(eng.store.keys.log(wf_id)) for event in log_events_raw(fields)]
        restarts = [f for f in log if f.get(b"t") == b"restart"]
        assert len(restarts) == 1 and restarts[0][b"stage"] == b"src" and restarts[0][b"by"] == b"dst"
        assert any(f.get(b"t") == b"retry" and f.get(b"stage") == b"src" and b"cannot be read" in f.get(b"reason", b"")
                   for f in log)
        # the unread first chunks: nobody will release them; the producer's periodic sweep takes its
        # arena slots back (the workflow has ended)
        await worker_of(eng, "src").plane.sweep()
        assert not segments(eng.settings.prefix)


@pytest.mark.slow
async def test_a_producer_out_of_attempts_is_not_run_again(engine_factory, tmp_path: Path) -> None:
    """The same, with a producer allowed one attempt: it is not run again; the consumer fails with the
    reason (never a hang), after its own retries."""
    spec = pipeline(chunks=10, nbytes=256 * KIB, producer_delay_s=0.15, consumer_delay_s=0.3)
    spec["stages"]["src"]["retry"] = {**spec["stages"]["src"]["retry"], "max_attempts": 1}
    async with engine_factory(spec, workers=False) as eng:
        wf_id, other = await _reader_on_this_host_killed(eng, tmp_path, spec)
        doc = await eng.store.wait(wf_id, timeout_s=60)
        assert doc["state"] == "failed" and doc["error_stage"] == "dst", doc
        assert "cannot be read here" in doc["error"] and "src has used its attempts" in doc["error"], doc["error"]
        assert doc["stages"]["src"]["attempt"] == 1 and other.stats["regenerated"] == 0
        await worker_of(eng, "src").plane.sweep()
        assert not segments(eng.settings.prefix)


async def test_workers_and_reconcilers_sweep_their_host(engine_factory) -> None:
    """Segments of a workflow that ended while nobody released them (here: one that never existed)
    are freed by the periodic host sweep of the running processes, without anyone asking."""
    async with engine_factory(pipeline(chunks=1, nbytes=KIB), dataplane_sweep_interval_s=0.3) as eng:
        plane = DataPlane(eng.redis, eng.settings, worker_id="gone-worker")
        for seq in (1, 2):
            await plane.put(np.ones(1000), plane.context("wf-never", "src", "dst", 1, seq), kind=TransportKind.SHM)
        assert len(segments(eng.settings.prefix)) == 2
        await eventually(lambda: _none_left(eng.settings.prefix), timeout_s=20)
        swept = sum(w.stats["segments_swept"] for ws in eng.workers.values() for w in ws)
        assert swept + eng.reconcilers[0].counts["segments_swept"] == 2


async def _none_left(prefix: str) -> bool:
    return not segments(prefix)
