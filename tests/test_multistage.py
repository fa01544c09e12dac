"""One worker process serving several stages that share a device (`--stage thinker,talker`, `--stage all`)."""
from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from omniflow.ops.fleet import collect_stats
from omniflow.errors import PipelineError
from omniflow.pipeline import build_pipeline
from omniflow.engine.worker import parse_stages

from conftest import toy_spec
from helpers import cli_env, eventually, expected_text, log_entries, omniflow, request, text_steps


def test_stage_lists_are_validated_against_the_pipeline() -> None:
    pipe = build_pipeline(toy_spec())
    assert parse_stages("all", pipe) == ["thinker", "talker", "code2wav"]
    assert parse_stages("talker, code2wav", pipe) == ["talker", "code2wav"]
    with pytest.raises(PipelineError, match="unknown stage 'vocoder'"):
        parse_stages("talker,vocoder", pipe)
    with pytest.raises(PipelineError, match="listed twice"):
        parse_stages("talker,talker", pipe)
    with pytest.raises(PipelineError, match="no stage given"):
        parse_stages(" , ", pipe)


async def test_one_worker_serving_every_stage_runs_workflows_to_completion(engine_factory) -> None:
    async with engine_factory(workers=False) as eng:
        worker = await eng.add_worker("all")
        subs = [await eng.store.submit(request(f"shared device {i}")) for i in range(6)]
        docs = [await eng.store.wait(sub.id, timeout_s=20) for sub in subs]
        for i, doc in enumerate(docs):
            assert doc["state"] == "completed"
            assert doc["outputs"]["thinker"]["text"] == expected_text(f"shared device {i}")
            assert doc["outputs"]["code2wav"]["chunks"] == 8
            # every session of the workflow ran in the one worker
            assert {st["replica"] for st in doc["stages"].values()} == {worker.id}
        # whose producers handed its sessions their chunks in memory: no inbox copy of any of them
        assert await eng.redis.xlen(eng.store.keys.inbox(worker.id, 0)) == 0
        stats = await collect_stats(eng.store)
        for name in ("thinker", "talker", "code2wav"):
            assert stats["stages"][name]["live_workers"] == 1
            assert stats["stages"][name]["capacity"] == eng.pipeline.stages[name].max_sessions


async def test_sessions_of_a_multistage_worker_that_stops_are_requeued_for_every_stage(engine_factory) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.1, "max_words": 12})
    async with engine_factory(spec, workers=False) as eng:
        await eng.add_worker("thinker,talker,code2wav", grace_s=0.05)
        sub = await eng.store.submit(request("move house"))
        async def midway() -> bool:
            return int(await eng.redis.hget(eng.store.keys.stages(sub.id), "talker:seq") or 0) >= 2
        await eventually(midway)
        stop, task = eng._tasks[1]          # the multi-stage worker
        stop.set()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 20)
        await eng.add_worker("thinker")
        await eng.add_worker("talker,code2wav")
        doc = await eng.store.wait(sub.id, timeout_s=20)
        assert doc["state"] == "completed"
        assert {name: st["attempt"] for name, st in doc["stages"].items()} == {"thinker": 2, "talker": 2,
                                                                                "code2wav": 2}
        assert doc["outputs"]["thinker"]["text"] == expected_text("move house", 12)
        assert doc["outputs"]["code2wav"]["chunks"] == 12


async def test_cli_worker_serves_all_stages_and_refuses_unknown_ones(engine_factory, tmp_path) -> None:
    async with engine_factory(workers=False) as eng:
        env = cli_env(eng, tmp_path)
        code, _, stderr = await omniflow("worker", "--stage", "thinker,vocoder", env=env)
        assert code != 0
        assert "unknown stage 'vocoder'" in stderr and "Traceback" not in stderr
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "omniflow.cli", "worker", "--stage", "all",
                                                    env=env, stderr=asyncio.subprocess.PIPE)
        try:
            sub = await eng.store.submit(request("from a subprocess"))
            doc = await eng.store.wait(sub.id, timeout_s=30)
            assert doc["state"] == "completed"
            assert len({st["replica"] for st in doc["stages"].values()}) == 1
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()


async def test_writes_spread_over_several_connections_keep_each_workflows_order(engine_factory) -> None:
    """With `write_connections` > 1 every workflow's writes still take one connection: no step is
    refused as a gap, nothing is retried, every text step is logged once and in order."""
    async with engine_factory(workers=False, write_connections=3) as eng:
        worker = await eng.add_worker("all")
        assert len({id(worker.batcher_for(f"wf{i}")) for i in range(50)}) == 3
        subs = await asyncio.gather(*(eng.store.submit(request(f"ordered {i}")) for i in range(40)))
        docs = await asyncio.gather(*(eng.store.wait(sub.id, timeout_s=30) for sub in subs))
        for i, doc in enumerate(docs):
            assert doc["state"] == "completed"
            assert {st["attempt"] for st in doc["stages"].values()} == {1}
            assert doc["outputs"]["thinker"]["text"] == expected_text(f"ordered {i}")
            assert text_steps(await log_entries(eng.store, doc["id"])) == list(range(1, 9))


async def test_a_full_stage_of_a_multistage_worker_takes_tasks_again_as_soon_as_a_slot_frees(engine_factory) -> None:
    """A stage with no free slot is left out of the worker's blocking intake read; it must be back
    in the read when a slot frees, not only when the read times out (`block_ms`, 30 s here)."""
    spec = toy_spec()
    spec["stages"]["talker"].update(max_sessions=1, prefetch=0)
    async with engine_factory(spec, workers=False, block_ms=30_000) as eng:
        await eng.add_worker("all")
        subs = [await eng.store.submit(request(f"one talker slot {i}")) for i in range(3)]
        docs = [await eng.store.wait(sub.id, timeout_s=10) for sub in subs]
        assert [d["state"] for d in docs] == ["completed"] * 3
