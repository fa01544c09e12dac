"""omniflow as a user meets it: the `user` rows of `make bench`.

- stages: `Thinker`, `Talker`, `Code2Wav` of bench/omniflow_bench.py, written against the public
  `Executor` API with no flags (they run on each stage's compute thread, the default `runs_on`);
- engine: real `omniflow reconciler` and `omniflow worker` processes with every setting at its default
  (only `OMNIFLOW_REDIS_URL` and `OMNIFLOW_PIPELINE` are set; default key prefix, batch sizes, block
  times, log level), co-located (`--stage all`) or one process per stage;
- load: the public client, one `submit` and one `wait` (which returns the workflow document) per workflow.
  burst: an `AsyncClient` in one event loop with 8 submitter tasks (each awaits its `submit` before the
  next) and one `completions()` watcher that every submitted id is handed to (its document comes back
  once the workflow is terminal: one blocking read for all of them); wf/s = N / (last document returned
  − first submit), p50/p99 are submit -> document. Like BullMQ's client: 8 concurrent adds, completion
  observed by one QueueEvents reader. `pipelined`: `submit_many` (one round trip per 256) then
  `wait_many` (the documents come back together: p50/p99 are submit -> the workflow's `finished_at`). latency: the synchronous `Client`, submit then wait, one at a time.
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
USER_BURST = "user path: default executors, AsyncClient submit c=8 + completions watcher"
USER_PIPELINED = "user path: default executors, AsyncClient submit_many + wait_many"
USER_LATENCY = "user path: default executors, Client submit+wait"
# the same client and settings with the stages on the worker's loop (`runs_on = "loop"`): what the
# compute-thread hop costs the default executors (issue 19 item 2: within 10 % in wf/s and p50)
LOOP_BURST = "reference: runs_on=loop, AsyncClient submit c=8 + completions watcher"
LOOP_LATENCY = "reference: runs_on=loop, Client submit+wait"
Record = tuple[str, float, float]


def _client_kwargs(url: str, eng: Engine) -> dict[str, Any]:
    from omniflow.config import Settings
    from omniflow.pipeline import load_pipeline

    return {"settings": Settings(redis_url=url, prefix=eng.prefix), "pipeline": load_pipeline(eng.yaml)}


def _completed(wf: str, doc: dict[str, Any]) -> None:
    if doc.get("state") != "completed":
        raise BenchError(f"workflow {wf} ended {doc.get('state')!r}: {doc.get('error')!r:.300}")


async def _burst(url: str, eng: Engine, tag: str, n: int, concurrency: int = CONCURRENCY,
                 pipelined: bool = False) -> list[Record]:
    from omniflow.client import AsyncClient

    records: list[Record] = []
    seen: list[asyncio.Future[None]] = []
    indexes = iter(range(n))
    async with AsyncClient(url, **_client_kwargs(url, eng)) as client:
        if pipelined:
            t0 = time.time()
            ids = await client.submit_many([f"{tag}{i}" for i in range(n)])
            docs = await client.wait_many(ids, timeout_s=WAIT_TIMEOUT_S)
            for wf, doc in docs.items():
                _completed(wf, doc)
                records.append((wf, t0, doc["finished_at"] or time.time()))
            # the last document returned: the end of the run
            records[-1] = (records[-1][0], t0, max(time.time(), records[-1][2]))
            return records
        async with client.completions() as ends:
            def seen_at(wf: str, t0: float, _fut: asyncio.Future[dict[str, Any]]) -> None:
                records.append((wf, t0, time.time()))

            async def submitter() -> None:
                for i in indexes:
                    t0 = time.time()
                    wf = await client.submit(f"{tag}{i}")
                    fut = ends.watch(wf)
                    fut.add_done_callback(lambda f, wf=wf, t0=t0: seen_at(wf, t0, f))
                    seen.append(fut)   # type: ignore[arg-type]

            await asyncio.gather(*(submitter() for _ in range(concurrency)))
            docs = await asyncio.wait_for(asyncio.gather(*seen), WAIT_TIMEOUT_S)
            for (wf, _, _), doc in zip(records, docs):
                _completed(wf, doc)       # type: ignore[arg-type]
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
              on_loop: bool = False, pipelined: bool = False) -> Result:
    """`on_loop`: the stages with `runs_on = "loop"` (the reference beside the default executors);
    `pipelined`: `submit_many` + `wait_many` instead of 8 submitters and the watcher."""
    stages = LOOP_STAGES if on_loop else USER_STAGES
    eng = Engine(redis_url, procs, pipeline_yaml(procs, stages=stages), colocated=colocated, defaults=True)
    r = redis_client(redis_url)
    with running(eng.commands(), env=eng.env) as ps:
        eng.wait_ready(r, ps)
        asyncio.run(_burst(redis_url, eng, "warm", warmup))
        before = server_stats(r)
        meter = ProcessCPU(r, ps)
        records = asyncio.run(_burst(redis_url, eng, "p", n, pipelined=pipelined))
        cpu = meter.take()
        extra = cost_delta(before, server_stats(r), n)
    extra.update(ProcessCPU.per_wf(cpu, n), submit_mode="submit_many" if pipelined else f"c={CONCURRENCY}",
                 topology=_topology(procs, colocated, on_loop))
    variant = (LOOP_BURST if on_loop else USER_PIPELINED if pipelined else USER_BURST) + \
        (", stages co-located" if colocated else "")
    return summarize("omniflow", variant, procs, records, extra=extra)


def run_latency(redis_url: str, n: int, *, colocated: bool, on_loop: bool = False) -> Result:
    stages = LOOP_STAGES if on_loop else USER_STAGES
    eng = Engine(redis_url, 1, pipeline_yaml(1, stages=stages), colocated=colocated, defaults=True)
    r = redis_client(redis_url)
    with running(eng.commands(), env=eng.env) as ps:
        eng.wait_ready(r, ps)
        _latency(redis_url, eng, "warm", 80)      # past a window of `runs_on = "auto"` (64 sessions): steady state
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
