"""How fast the workflow listing (`GET /v1/workflows`, `omniflow ls`, the dashboard) is with many records.

    .venv/bin/python bench/listing.py              # 100,000 workflows
    .venv/bin/python bench/listing.py --n 20000

Creates N real workflows with `submit.lua` (group-committed, 10 tenants, a request id each,
no workers), retires 10 % of them with `abort.lua` (1 % as failed, 9 % aborted) in a fresh
embedded Valkey, then times each query (median of `--repeats` runs, one client, no other load)
and prints a table: the figures in docs/operations.md come from here.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import start_server


async def fill(store, n: int) -> list[str]:
    from omniflow.storage.batcher import Batcher
    from omniflow.models import SubmitRequest, WorkflowInput

    batched = type(store)(store.client, store.settings, store.pipeline, batcher=Batcher(store.client))
    ids: list[str] = []
    for start in range(0, n, 2000):
        subs = await asyncio.gather(*(batched.submit(
            SubmitRequest(input=WorkflowInput(text=f"prompt {i}"), output_modalities=["text"] if i % 4 else None,
                          request_id=f"order-{i:06d}"), tenant=f"tenant-{i % 10}")
            for i in range(start, min(n, start + 2000))))
        ids.extend(x.id for x in subs)
    for start in range(0, n, 10):           # every 10th retired: 1 in 10 of those as failed
        await store.abort(ids[start], reason="bench", **({"state": _failed()} if start % 100 == 0 else {}))
    return ids


def _failed():
    from omniflow.models import WorkflowState

    return WorkflowState.FAILED


async def main(n: int, repeats: int) -> None:
    from omniflow.config import Settings
    from omniflow.storage.listing import ListFilter
    from omniflow.pipeline import load_pipeline
    from omniflow.client.store import Store, connect

    with start_server() as server:
        settings = Settings(redis_url=server.url, prefix="lb", max_in_flight=10 ** 7, max_deadline_s=10 ** 6,
                            default_deadline_s=10 ** 6)
        redis = connect(server.url)
        store = Store(redis, settings, load_pipeline(settings.pipeline_path()))
        started = time.perf_counter()
        ids = await fill(store, n)
        print(f"created {n} workflows in {time.perf_counter() - started:.1f}s", flush=True)
        middle = int((await redis.zscore(store.keys.all_wf(0), ids[n // 2])))
        cases = [
            ("first page, no filter", ListFilter(), 0),
            (f"page at offset {n // 2:,}", ListFilter(), n // 2),
            ("state=failed (1 %)", ListFilter(state="failed"), 0),
            ("state=pending (90 %)", ListFilter(state="pending"), 0),
            ("tenant=tenant-3 (10 %)", ListFilter(tenant="tenant-3"), 0),
            ("state=aborted + tenant=tenant-0", ListFilter(state="aborted", tenant="tenant-0"), 0),
            ("since: the newest half", ListFilter(since_ms=middle), 0),
            ("stage=code2wav (25 %)", ListFilter(stage="code2wav"), 0),
            ("request_id contains '12345' (1 match)", ListFilter(request_id="12345"), 0),
            ("request_id matching nothing (bounded scan)", ListFilter(request_id="zzz"), 0),
        ]
        print(f"\n{'query (limit 50)':<46} {'ms':>8} {'rows':>5} {'scanned':>8}  next_offset")
        for label, flt, offset in cases:
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                page = await store.list_workflows(flt, offset=offset, limit=50)
                times.append((time.perf_counter() - t0) * 1000)
            print(f"{label:<46} {statistics.median(times):8.2f} {len(page.rows):5d} {page.scanned:8d}  "
                  f"{page.next_offset}", flush=True)
        t0 = time.perf_counter()
        counts = await store.state_counts()
        print(f"{'state counts (ZCARD x6)':<46} {(time.perf_counter() - t0) * 1000:8.2f}  {counts}")
        from omniflow.ops import fleet

        # every deadline here is the default: a longest deadline above it makes the walk read on
        # (the worst case: up to 50,000 records)
        for label, longest in (("", settings.max_deadline_s), (", longest deadline +1 h", settings.max_deadline_s + 3600)):
            # the oldest pending workflow (/metrics): pending has no index, the in-flight set is walked
            store.settings = settings.model_copy(update={"max_deadline_s": longest})
            t0 = time.perf_counter()
            stuck = await fleet.stuck(store)
            print(f"{'oldest pending and running' + label:<46} {(time.perf_counter() - t0) * 1000:8.2f}  {stuck}")
        store.settings = settings
        await redis.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.n, args.repeats))
