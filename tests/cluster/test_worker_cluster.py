"""The worker on a real Valkey Cluster, where it reads its tasks with one intake loop per cell."""
from __future__ import annotations

import asyncio

from conftest import toy_spec
from helpers import eventually, request


async def test_a_stopping_worker_claims_nothing_in_any_cell(engine_factory) -> None:
    """From SIGTERM on, the worker only finishes what it holds: every cell's intake loop stops (16 cells
    over 3 primaries), so workflows submitted during its grace period wait for another worker."""
    spec = toy_spec(thinker={"token_delay_s": 0.1, "max_words": 20})
    async with engine_factory(spec, workers=False) as eng:
        worker = await eng.add_worker("thinker", grace_s=30)
        stop, task = eng._tasks[-1]
        held = await eng.store.submit(request("held through the grace period", ["text"]))

        async def running() -> bool:
            return int(await eng.redis.hget(eng.store.keys.stages(held.id), "thinker:seq") or 0) >= 1

        async def stopping() -> bool:
            return worker._stopping

        await eventually(running)
        stop.set()
        await eventually(stopping)
        later = [await eng.store.submit(request(f"submitted during the grace period {i}", ["text"]))
                 for i in range(8)]
        assert len({eng.store.keys.cell_of(sub.id) for sub in later}) > 1
        await asyncio.wait_for(task, 30)        # the session it held ran to its end
        assert (await eng.store.document(held.id))["stages"]["thinker"]["status"] == "done"
        for sub in later:
            assert await eng.redis.hget(eng.store.keys.stages(sub.id), "thinker:replica") is None
