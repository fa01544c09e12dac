"""Measure that Redis memory returns to its baseline after a load run (docs/reliability.md).

Runs the toy pipeline in-process on a private Valkey with `result_ttl_s = 5`, completes 2,000
workflows, then waits for their keys to expire. Run: .venv/bin/python bench/gc_memory.py
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from conftest import Engine, toy_spec  # noqa: E402

from omniflow.storage.batcher import Batcher  # noqa: E402
from omniflow.config import Settings  # noqa: E402
from omniflow.ops.embedded import EmbeddedServer  # noqa: E402
from omniflow.models import SubmitRequest, WorkflowInput  # noqa: E402
from omniflow.pipeline import build_pipeline  # noqa: E402
from omniflow.client.store import Store  # noqa: E402

N = 2000


async def main() -> None:
    server = EmbeddedServer(data_dir=Path(tempfile.mkdtemp()), appendonly=False).start()
    try:
        settings = Settings(redis_url=server.url, prefix="gc", result_ttl_s=5, tombstone_ttl_s=5,
                            idempotency_ttl_s=5, max_deadline_s=10, default_deadline_s=10, max_in_flight=10**6)
        eng = Engine(server.url, settings, build_pipeline(toy_spec()))
        await eng.add_reconciler()
        for stage in eng.pipeline.order:
            await eng.add_worker(stage)

        async def used() -> int:
            return int((await eng.redis.info("memory"))["used_memory"])

        base, keys0 = await used(), await eng.redis.dbsize()
        store = Store(eng.redis, settings, eng.pipeline, batcher=Batcher(eng.redis))
        await asyncio.gather(*(store.submit(SubmitRequest(input=WorkflowInput(text=f"gc {i}"), request_id=f"r{i}"))
                               for i in range(N)))
        while await eng.redis.zcard(store.keys.inflight(0)):
            await asyncio.sleep(0.2)
        peak, keys1 = await used(), await eng.redis.dbsize()
        started = time.monotonic()
        while time.monotonic() - started < 60:
            # SCAN reclaims keys whose TTL has passed, like any client touching them
            n = len([k async for k in eng.redis.scan_iter(match="gc:*", count=5000)])
            if await eng.redis.zcard("gc:all") == 0 and n <= keys0 + 12:
                break
            await asyncio.sleep(1)
        after, keys2 = await used(), await eng.redis.dbsize()
        print(f"baseline {base / 1e6:.2f} MB ({keys0} keys); after {N} workflows {peak / 1e6:.2f} MB ({keys1} keys); "
              f"after result_ttl {after / 1e6:.2f} MB ({keys2} keys); waited {time.monotonic() - started:.0f}s")
        await eng.close()
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
