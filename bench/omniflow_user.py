"""omniflow as a user meets it: the `user` rows of `make bench`.

- stages: `Thinker`, `Talker`, `Code2Wav` of bench/omniflow_bench.py, written against the public
  `Executor` API with no flags (they run on each stage's compute thread, the default `runs_on`);
- engine: real `omniflow reconciler` and `omniflow worker` processes with every setting at its default
  (only `OMNIFLOW_REDIS_URL` and `OMNIFLOW_PIPELINE` are set; default key prefix, batch sizes, block
  times, log level), co-located (`--stage all`) or one process per stage;
- load: the public client, one `submit` and one `wait` (which returns the workflow document) per workflow.
  burst: an `AsyncClient` in one event loop with 8 submitter tasks (each awaits its `submit` before the
  next) and 8 waiter tasks that `wait` on the submitted ids in submission order; wf/s = N / (last
  document returned − first submit), p50/p99 are submit -> document. Like BullMQ's client: 8 concurrent
  adds, completion observed by the client (BullMQ's one QueueEvents reader; omniflow has no wait-on-many
  yet, so 8 waits are in flight). latency: the synchronous `Client`, submit then wait, one at a time.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    BenchError, ProcessCPU, Result, cost_delta, redis_client, running, server_stats, summarize,
)
from bench.omniflow_bench import LOOP_STAGES, USER_STAGES, Engine, pipeline_yaml

CONCURRENCY = 8           # client tasks submitting, and as many waiting
WAIT_TIMEOUT_S = 120.0
USER_BURST = "user path: default executors, AsyncClient submit+wait c=8"
USER_LATENCY = "user path: default executors, Client submit+wait"
# the same client and settings with the stages on the worker's loop (`runs_on = "loop"`): what the
# compute-thread hop costs the default executors (issue 19 item 2: within 10 % in wf/s and p50)
LOOP_BURST = "reference: runs_on=loop, AsyncClient submit+wait c=8"
LOOP_LATENCY = "reference: runs_on=loop, Client submit+wait"
Record = tuple[str, float, float]


def _client_kwargs(url: str, eng: Engine) -> dict[str, Any]:
    from omniflow.config import Settings
    from omniflow.pipeline import load_pipeline

    return {"settings": Settings(redis_url=url, prefix=eng.prefix), "pipeline": load_pipeline(eng.yaml)}


def _completed(wf: str, doc: dict[str, Any]) -> None:
    if doc.get("state") != "completed":
        raise BenchError(f"workflow {wf} ended {doc.get('state')!r}: {doc.get('error')!r:.300}")


async def _burst(url: str, eng: Engine, tag: str, n: int, concurrency: int = CONCURRENCY) -> list[Record]:
    from omniflow.client import AsyncClient

    records: list[Record] = []
    submitted: asyncio.Queue[tuple[str, float] | None] = asyncio.Queue()
    indexes = iter(range(n))
    async with AsyncClient(url, **_client_kwargs(url, eng)) as client:
        async def submitter() -> None:
            for i in indexes:
                t0 = time.time()
                await submitted.put((await client.submit(f"{tag}{i}"), t0))

        async def waiter() -> None:
            while (item := await submitted.get()) is not None:
                wf, t0 = item
                doc = await client.wait(wf, timeout_s=WAIT_TIMEOUT_S)
                records.append((wf, t0, time.time()))
                _completed(wf, doc)

        waiters = [asyncio.create_task(waiter()) for _ in range(concurrency)]
        try:
            await asyncio.gather(*(submitter() for _ in range(concurrency)))
            for _ in waiters:
                submitted.put_nowait(None)
            await asyncio.gather(*waiters)
        finally:
            for task in waiters:
                task.cancel()
    return records


def _latency(url: str, eng: Engine, tag: str, n: int) -> list[Record]:
    from omniflow.client import Client

    records: list[Record] = []
    with Client(url, **_client_kwargs(url, eng)) as client:
        for i in range(n):
            t0 = time.time()
            wf = client.submit(f"{tag}{i}")
            doc = client.wait(wf, timeout_s=30)
            records.append((wf, t0, time.time()))
            _completed(wf, doc)
    return records


def _topology(procs: int, colocated: bool, on_loop: bool = False) -> str:
    where = f"{procs} `omniflow worker --stage all`" if colocated else f"{procs} `omniflow worker` per stage"
    return f"{where} + 1 `omniflow reconciler`, default settings, {'loop' if on_loop else 'compute-thread'} executors"


def run_burst(redis_url: str, n: int, procs: int, *, colocated: bool, warmup: int = 100,
              on_loop: bool = False) -> Result:
    """`on_loop`: the stages with `runs_on = "loop"` (the reference beside the default executors)."""
    stages = LOOP_STAGES if on_loop else USER_STAGES
    eng = Engine(redis_url, procs, pipeline_yaml(procs, stages=stages), colocated=colocated, defaults=True)
    r = redis_client(redis_url)
    with running(eng.commands(), env=eng.env) as ps:
        eng.wait_ready(r, ps)
        asyncio.run(_burst(redis_url, eng, "warm", warmup))
        before = server_stats(r)
        meter = ProcessCPU(r, ps)
        records = asyncio.run(_burst(redis_url, eng, "p", n))
        cpu = meter.take()
        extra = cost_delta(before, server_stats(r), n)
    extra.update(ProcessCPU.per_wf(cpu, n), submit_mode=f"c={CONCURRENCY}",
                 topology=_topology(procs, colocated, on_loop))
    variant = (LOOP_BURST if on_loop else USER_BURST) + (", stages co-located" if colocated else "")
    return summarize("omniflow", variant, procs, records, extra=extra)


def run_latency(redis_url: str, n: int, *, colocated: bool, on_loop: bool = False) -> Result:
    stages = LOOP_STAGES if on_loop else USER_STAGES
    eng = Engine(redis_url, 1, pipeline_yaml(1, stages=stages), colocated=colocated, defaults=True)
    r = redis_client(redis_url)
    with running(eng.commands(), env=eng.env) as ps:
        eng.wait_ready(r, ps)
        _latency(redis_url, eng, "warm", 20)
        before = server_stats(r)
        records = _latency(redis_url, eng, "l", n)
        extra = cost_delta(before, server_stats(r), n)
    extra["topology"] = _topology(1, colocated, on_loop)
    variant = (LOOP_LATENCY if on_loop else USER_LATENCY) + (", stages co-located" if colocated else "")
    return summarize("omniflow", variant, 1, records, mode="latency", extra=extra)


if __name__ == "__main__":
    import json

    from bench.common import start_server

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for colocated in (True, False):
        with start_server() as server:
            print(json.dumps(run_burst(server.url, n, 1, colocated=colocated).to_dict()))
        with start_server() as server:
            print(json.dumps(run_latency(server.url, 100, colocated=colocated).to_dict()))
