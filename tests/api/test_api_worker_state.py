"""Worker state: a worker still loading its models is seen as `loading` (`omniflow workers`,
`/metrics`, the pools snapshot) but never counted as live or claiming (`/readyz`); then `ready`,
`draining`. Workers that die while loading are forgotten by the reconciler."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import cli_env, eventually, metric_values, omniflow, request
from workers_fixtures import SlowLoadingThinker

from omniflow.api.schemas import Pools, WorkerView
from omniflow.engine.worker import Worker
from omniflow.models import WorkerState
from omniflow.ops.fleet import list_workers, worker_state
from omniflow.storage.schema import now_ms


def _state_metric(values: dict[Any, float], stage: str, state: str) -> float:
    return values[("omniflow_workers", (("stage", stage), ("state", state)))]


async def _row(eng: Any, worker_id: str) -> dict[str, Any] | None:
    return next((w for w in await list_workers(eng.store) if w["id"] == worker_id), None)


async def _in_state(eng: Any, worker_id: str, state: str) -> dict[str, Any] | None:
    row = await _row(eng, worker_id)
    return row if row is not None and row["state"] == state else None


async def test_a_worker_loading_its_models_is_seen_as_loading_and_not_counted_live(api_factory,
                                                                                   tmp_path: Path) -> None:
    spec = toy_spec()
    spec["stages"]["thinker"]["executor"] = "workers_fixtures:SlowLoadingThinker"
    SlowLoadingThinker.loading.clear()
    SlowLoadingThinker.release.clear()
    async with api_factory(spec, workers=False) as (eng, server), server.client() as http:
        for stage in ("talker", "code2wav"):
            await eng.add_worker(stage)
        worker = Worker(settings=eng.settings, pipeline=eng.pipeline, stage="thinker", redis_url=eng.url)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        try:
            row = await eventually(lambda: _in_state(eng, worker.id, "loading"), what="the worker seen loading")
            assert SlowLoadingThinker.loading.is_set() and not row["alive"] and row["stages"] == ["thinker"]
            # ... by the CLI
            env = cli_env(eng, tmp_path)
            code, out, err = await omniflow("workers", "--json", env=env)
            assert code == 0, err
            views = {w.id: w for w in TypeAdapter(list[WorkerView]).validate_python(json.loads(out))}
            assert views[worker.id].state is WorkerState.LOADING and not views[worker.id].alive
            code, out, _ = await omniflow("workers", env=env)
            assert code == 0 and "loading" in out and "1 loading" in out
            # ... by /metrics and the pools snapshot; but never as live or claiming
            values = metric_values((await http.get("/metrics")).text)
            assert _state_metric(values, "thinker", "loading") == 1
            assert _state_metric(values, "thinker", "ready") == 0
            assert _state_metric(values, "talker", "ready") == 1
            assert values[("omniflow_live_workers", (("stage", "thinker"),))] == 0
            pools = Pools.model_validate((await http.get("/v1/admin/pools")).json())
            assert pools.stages["thinker"].loading_workers == 1 and pools.stages["thinker"].live_workers == 0
            ready = await http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["missing"] == ["thinker"]
            sub = await eng.store.submit(request("while the model loads", ["text"]))
            assert (await eng.store.document(sub.id))["stages"]["thinker"]["status"] == "pending"

            SlowLoadingThinker.release.set()
            row = await eventually(lambda: _in_state(eng, worker.id, "ready"), what="the worker ready")
            assert row["alive"] and row["state_age_s"] is not None
            assert (await eng.store.wait(sub.id, timeout_s=15))["state"] == "completed"
            assert await eng.redis.zcard(eng.store.keys.workers_loading) == 0
            assert (await http.get("/readyz")).status_code == 200
            values = metric_values((await http.get("/metrics")).text)
            assert _state_metric(values, "thinker", "ready") == 1 and _state_metric(values, "thinker", "loading") == 0

            code, _, err = await omniflow("drain", worker.id, env=env)
            assert code == 0, err
            await eventually(lambda: _in_state(eng, worker.id, "draining"), what="the worker draining")
            values = metric_values((await http.get("/metrics")).text)
            assert _state_metric(values, "thinker", "draining") == 1 and _state_metric(values, "thinker", "ready") == 0
        finally:
            SlowLoadingThinker.release.set()
            stop.set()
            await task


class _FailingSetup(SlowLoadingThinker):
    async def setup(self) -> None:
        raise RuntimeError("weights not found")


async def test_a_worker_whose_setup_fails_leaves_the_loading_set(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        worker = Worker(settings=eng.settings, pipeline=eng.pipeline, stage="thinker", redis_url=eng.url,
                        executor=_FailingSetup(stage="thinker", params={}))
        with pytest.raises(RuntimeError, match="weights not found"):
            await worker.run(asyncio.Event())
        assert await eng.redis.zcard(eng.store.keys.workers_loading) == 0
        assert (await _row(eng, worker.id)) is None or (await _row(eng, worker.id))["state"] == "lapsed"


async def test_the_reconciler_forgets_workers_that_died_while_loading(engine_factory) -> None:
    async with engine_factory(workers=False) as eng:
        keys = eng.store.keys
        # one died loading (its announcement lapsed); one lapsed there but holds a lease: it is kept
        await eng.redis.zadd(keys.workers_loading, {"thinker-dead-1": now_ms() - 1, "talker-live-1": now_ms() - 1})
        await eng.redis.hset(keys.worker_info("thinker-dead-1"), mapping={"stage": "thinker", "state": "loading"})
        await eng.redis.zadd(keys.workers, {"talker-live-1": now_ms() + 60_000})
        await eng.redis.hset(keys.worker_info("talker-live-1"), mapping={"stage": "talker", "state": "ready"})

        async def forgotten() -> bool:
            return await eng.redis.zcard(keys.workers_loading) == 0

        await eventually(forgotten, what="the lapsed loading entries removed")
        assert not await eng.redis.exists(keys.worker_info("thinker-dead-1"))
        assert await eng.redis.hget(keys.worker_info("talker-live-1"), "state") == b"ready"
        rows = {w["id"]: w for w in await list_workers(eng.store)}
        assert set(rows) == {"talker-live-1"} and rows["talker-live-1"]["state"] == "ready"


def test_worker_state_from_lease_announcement_and_info() -> None:
    assert worker_state(leased=True, loading=False, info={}) is WorkerState.READY
    assert worker_state(leased=True, loading=True, info={}) is WorkerState.READY      # took its lease
    assert worker_state(leased=True, loading=False, info={"drain": "1"}) is WorkerState.DRAINING
    assert worker_state(leased=True, loading=False, info={"state": "stopping", "drain": "1"}) is WorkerState.STOPPING
    assert worker_state(leased=False, loading=True, info={"state": "loading"}) is WorkerState.LOADING
    assert worker_state(leased=False, loading=False, info={"state": "ready"}) is WorkerState.LAPSED
