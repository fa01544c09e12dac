"""Measure that Redis memory returns to its baseline after a load run (docs/reliability.md).

Runs the toy pipeline in-process on a private Valkey with result_ttl_s = 5, completes 2,000
workflows, then waits for their keys to expire. Run: .venv/bin/python bench/gc_memory.py
"""
import sys, asyncio, tempfile, time; REPO = __import__("pathlib").Path(__file__).resolve().parents[1]; sys.path.insert(0, str(REPO)); sys.path.insert(0, str(REPO / "tests"))
from pathlib import Path
from conftest import Engine, toy_spec
from omniflow.config import Settings
from omniflow.embedded import EmbeddedServer
from omniflow.pipeline import build_pipeline
from omniflow.models import SubmitRequest, WorkflowInput
from omniflow.batcher import Batcher
from omniflow.store import Store
async def main():
    srv = EmbeddedServer(data_dir=Path(tempfile.mkdtemp()), appendonly=False).start()
    try:
        st = Settings(redis_url=srv.url, prefix="gc", result_ttl_s=5, tombstone_ttl_s=5, idempotency_ttl_s=5,
                      max_deadline_s=10, default_deadline_s=10, max_in_flight=10**6)
        eng = Engine(srv.url, st, build_pipeline(toy_spec()))
        await eng.add_reconciler()
        for s in eng.pipeline.order:
            await eng.add_worker(s)
        info = lambda: eng.redis.info("memory")
        base = (await info())["used_memory"]; keys0 = await eng.redis.dbsize()
        store = Store(eng.redis, st, eng.pipeline, batcher=Batcher(eng.redis))
        subs = await asyncio.gather(*(store.submit(SubmitRequest(input=WorkflowInput(text=f"gc {i}"), request_id=f"r{i}")) for i in range(2000)))
        while await eng.redis.zcard("gc:inflight"): await asyncio.sleep(0.2)
        peak = (await info())["used_memory"]; keys1 = await eng.redis.dbsize()
        t0 = time.monotonic()
        while True:
            n = 0
            async for k in eng.redis.scan_iter(match="gc:*", count=5000): n += 1
            if await eng.redis.zcard("gc:all") == 0 and n <= keys0 + 12: break
            if time.monotonic() - t0 > 60: break
            await asyncio.sleep(1)
        after = (await info())["used_memory"]; keys2 = await eng.redis.dbsize()
        print(f"baseline {base/1e6:.2f} MB ({keys0} keys); after 2000 workflows {peak/1e6:.2f} MB ({keys1} keys); "
              f"after result_ttl {after/1e6:.2f} MB ({keys2} keys); waited {time.monotonic()-t0:.0f}s")
        await eng.close()
    finally:
        srv.stop()
asyncio.run(main())
