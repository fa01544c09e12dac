"""The worker runtime carries real models: blocking model code runs on the stage's compute
thread (never on the worker's loop), continuous batching, checkpoints for resume, tensors."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from conftest import toy_spec
from helpers import eventually, request, run_to_end
from workers_fixtures import BlockingThinker, CountingLM

from omniflow.engine.compute import ComputeThread
from omniflow.engine.reconciler import Reconciler

LEASE_S = 1.0


def blocking_spec(executor: str, *, block_s: float, max_attempts: int = 3) -> dict:
    spec = toy_spec()
    spec["stages"]["thinker"]["executor"] = f"workers_fixtures:{executor}"
    spec["stages"]["thinker"]["params"]["block_s"] = block_s
    spec["stages"]["thinker"]["retry"]["max_attempts"] = max_attempts
    return spec


@asynccontextmanager
async def reconciler_elsewhere(eng) -> AsyncIterator[Reconciler]:
    """The reconciler on a loop of its own (as in production, another process), so a worker that
    blocks the test's loop cannot also stall the one who would declare it lost."""
    rec = Reconciler(settings=eng.settings, pipeline=eng.pipeline, redis_url=eng.url)
    thread = ComputeThread("reconciler")
    stop: list[asyncio.Event] = []

    async def main() -> None:
        stop.append(asyncio.Event())
        await rec.run(stop[0])

    done = thread.submit(main())
    try:
        await eventually(lambda: _started(rec))
        yield rec
    finally:
        thread.loop.call_soon_threadsafe(stop[0].set)
        await asyncio.wrap_future(done)
        thread.stop()


async def _started(rec: Reconciler) -> bool:
    return rec.started.is_set()


async def test_blocking_step_of_three_leases_does_not_lose_the_session(engine_factory) -> None:
    """A single blocking call of 3x the lease: heartbeats keep their timing, nothing is declared lost."""
    async with engine_factory(blocking_spec("BlockingThinker", block_s=3 * LEASE_S), reconciler=False,
                              lease_timeout_s=LEASE_S) as eng, reconciler_elsewhere(eng) as rec:
        doc = await run_to_end(eng.store, request("slow forward pass"), timeout_s=30)
        assert doc["state"] == "completed", doc
        assert doc["stages"]["thinker"]["attempt"] == 1
        assert rec.counts["lost"] == 0


async def test_the_same_blocking_step_on_the_event_loop_loses_the_session(engine_factory) -> None:
    """The control: the very same executor on the worker's loop stalls the heartbeat and the
    session is declared lost (this is what the compute thread prevents)."""
    async with engine_factory(blocking_spec("BlockingThinkerOnLoop", block_s=3 * LEASE_S, max_attempts=1),
                              reconciler=False, lease_timeout_s=LEASE_S) as eng, reconciler_elsewhere(eng):
        doc = await run_to_end(eng.store, request("slow forward pass"), timeout_s=30)
        assert doc["state"] == "failed"
        assert "worker lost" in doc["error"]


async def test_abort_reaches_a_session_blocked_in_model_code(engine_factory) -> None:
    BlockingThinker.cancelled_after_block.clear()
    async with engine_factory(blocking_spec("BlockingThinker", block_s=3 * LEASE_S), reconciler=False,
                              lease_timeout_s=LEASE_S) as eng, reconciler_elsewhere(eng) as rec:
        sub = await eng.store.submit(request("abort me while I compute"))
        await eventually(lambda: asyncio.to_thread(BlockingThinker.blocked.wait, 0.05))
        assert await eng.store.abort(sub.id) == "aborted"
        doc = await eng.store.wait(sub.id, timeout_s=5)
        assert doc["state"] == "aborted"
        assert doc["stages"]["thinker"]["status"] == "aborted"
        # the cancellation lands in the executor as soon as its blocking call returns
        assert await asyncio.to_thread(BlockingThinker.cancelled_after_block.wait, 10)
        assert doc["outputs"]["thinker"]["text"] == ""
        assert rec.counts["lost"] == 0


async def test_compute_thread_runs_coroutines_off_the_calling_loop() -> None:
    compute = ComputeThread("t")
    try:
        caller = asyncio.get_running_loop()

        async def where() -> bool:
            return asyncio.get_running_loop() is caller

        assert await compute.run(where()) is False

        running = threading.Event()

        async def forever() -> None:
            running.set()
            await asyncio.sleep(3600)       # the coroutine to cancel: it never ends by itself

        task = asyncio.ensure_future(compute.run(forever()))
        await eventually(running.is_set, what="the coroutine running on the compute thread")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        compute.stop()
    assert not compute.alive


def counting_spec(**thinker_params: object) -> dict:
    spec = toy_spec()
    spec["stages"]["thinker"]["executor"] = "workers_fixtures:CountingLM"
    spec["stages"]["thinker"]["params"].update({"max_words": 6, "max_batch": 8, **thinker_params})
    return spec


def counting_text(prompt: str, n: int = 6) -> str:
    return " ".join(f"{prompt}-{i}" for i in range(n))


async def test_batched_executor_steps_concurrent_sessions_together_through_the_engine(engine_factory) -> None:
    CountingLM.steps_seen.clear()
    async with engine_factory(counting_spec(step_s=0.05)) as eng:
        # a session lasts 6 steps of 50 ms: submitted together, they overlap and share steps
        subs = await asyncio.gather(*(eng.store.submit(request(f"p{i} hello")) for i in range(6)))
        docs = [await eng.store.wait(sub.id, timeout_s=20) for sub in subs]
    for i, doc in enumerate(docs):
        assert doc["state"] == "completed"
        assert doc["outputs"]["thinker"]["text"] == counting_text(f"p{i}")
        assert doc["outputs"]["code2wav"]["chunks"] == 6       # one audio chunk per word, downstream intact
    assert max(CountingLM.steps_seen) > 1                      # sessions shared steps


async def test_batched_session_resumes_from_its_checkpoint_after_a_failed_step(engine_factory) -> None:
    async with engine_factory(counting_spec(fail_at_step=4, fail_attempts=1)) as eng:
        doc = await run_to_end(eng.store, request("resume me"), timeout_s=20)
        assert doc["state"] == "completed", doc
        assert doc["stages"]["thinker"]["attempt"] == 2
        assert doc["outputs"]["thinker"]["text"] == counting_text("resume")   # nothing repeated or missing
        stages = await eng.redis.hgetall(eng.store.keys.stages(doc["id"]))
        assert stages[b"thinker:ckpt"].decode() == "".join(f"resume-{i} " for i in range(6))


@pytest.mark.parametrize(("choice", "loop_module"), [(None, "uvloop"), ("uvloop", "uvloop"), ("asyncio", "asyncio")])
def test_long_running_processes_run_on_the_loop_omniflow_loop_names(monkeypatch, choice, loop_module) -> None:
    from omniflow.runtime import run_until_signal

    pytest.importorskip("uvloop")       # uvicorn[standard], a dependency, brings it where it builds
    monkeypatch.setenv("OMNIFLOW_GC_TUNE", "0")
    if choice is None:
        monkeypatch.delenv("OMNIFLOW_LOOP", raising=False)
    else:
        monkeypatch.setenv("OMNIFLOW_LOOP", choice)
    seen: list[str] = []

    async def main(stop: asyncio.Event) -> None:
        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])

    run_until_signal(main)
    assert seen == [loop_module]


def test_an_unknown_omniflow_loop_is_refused_with_the_choices(monkeypatch) -> None:
    from omniflow.errors import ConfigError
    from omniflow.runtime import loop_factory

    monkeypatch.setenv("OMNIFLOW_LOOP", "trio")
    with pytest.raises(ConfigError, match="OMNIFLOW_LOOP must be one of uvloop, asyncio, not 'trio'"):
        loop_factory()
