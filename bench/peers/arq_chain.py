"""arq: three chained jobs (thinker enqueues talker enqueues code2wav; code2wav writes the result).

What a user would run: one arq worker process serving all three functions on arq's
single default queue (arq has no per-function routing without separate queues), and
more worker processes to scale. Everything is arq's default (max_jobs=10, results
kept, health checks) except the job serializer (msgpack — never pickle) and
`poll_delay` (0.5 s default; 0.01 and 0.001 tuned).

Worker: python -m bench.peers.arq_chain worker --url URL --poll-delay 0.01
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack

from bench import workload
from bench.common import (
    DoneReader, Result, cost_delta, redis_client, run_latency_loop, running, server_stats, summarize,
    timeout_for, wait_ready,
)

SERIALIZE = msgpack.packb
DESERIALIZE = partial(msgpack.unpackb, raw=False)


async def thinker(ctx, wf: str, ts: float, prompt: str) -> None:
    await ctx["redis"].enqueue_job("talker", wf, ts, workload.thinker(prompt))


async def talker(ctx, wf: str, ts: float, texts: list[str]) -> None:
    await ctx["redis"].enqueue_job("code2wav", wf, ts, workload.talker(texts))


async def code2wav(ctx, wf: str, ts: float, codes: list[list[int]]) -> int:
    audio = workload.code2wav(codes)
    await ctx["redis"].xadd(workload.DONE_STREAM, {"wf": wf, "ts": repr(ts), "td": repr(time.time())})
    return len(audio)


async def _on_startup(ctx) -> None:
    await ctx["redis"].incr(workload.READY_KEY)


def worker(url: str, poll_delay: float | None) -> None:
    from arq.connections import RedisSettings
    from arq.worker import Worker

    kwargs = {} if poll_delay is None else {"poll_delay": poll_delay}
    w = Worker(
        functions=[thinker, talker, code2wav],
        redis_settings=RedisSettings.from_dsn(url),
        job_serializer=SERIALIZE,
        job_deserializer=DESERIALIZE,
        on_startup=_on_startup,
        **kwargs,
    )
    w.run()


def _worker_cmds(url: str, procs: int, poll_delay: float | None) -> list[tuple[str, list[str]]]:
    extra = [] if poll_delay is None else ["--poll-delay", str(poll_delay)]
    return [(f"arq-{i}", [sys.executable, "-m", "bench.peers.arq_chain", "worker", "--url", url, *extra])
            for i in range(procs)]


def _variant(poll_delay: float | None) -> str:
    return "poll_delay 0.5 (default)" if poll_delay is None else f"poll_delay {poll_delay:g}"


async def _pool(url: str):
    from arq.connections import RedisSettings, create_pool

    return await create_pool(RedisSettings.from_dsn(url), job_serializer=SERIALIZE, job_deserializer=DESERIALIZE)


def run_throughput(url: str, n: int, procs: int, poll_delay: float | None = 0.01, warmup: int = 50) -> Result:
    r = redis_client(url)
    loop = asyncio.new_event_loop()
    try:
        pool = loop.run_until_complete(_pool(url))

        async def submit_many(prefix: str, k: int) -> None:
            for i in range(k):
                await pool.enqueue_job("thinker", f"{prefix}-{i}", time.time(), "hello")

        with running(_worker_cmds(url, procs, poll_delay)) as ps:
            wait_ready(r, procs, ps)
            reader = DoneReader(r, ps)
            loop.run_until_complete(submit_many("warm", warmup))
            reader.wait(warmup, timeout_for(warmup, 1))
            before = server_stats(r)
            t0 = time.monotonic()
            loop.run_until_complete(submit_many("wf", n))
            submit_s = time.monotonic() - t0
            records = reader.wait(n, timeout_for(n, 5 if poll_delay is None else 50, floor_s=60))
            cmds = cost_delta(before, server_stats(r), n)
        loop.run_until_complete(pool.aclose())
    finally:
        loop.close()
    extra = {"topology": f"{procs} worker process(es), all 3 functions each", "submit_s": round(submit_s, 3),
             "submit_mode": "single", **cmds}
    return summarize("arq", _variant(poll_delay), procs, records, extra=extra)


def run_latency(url: str, n: int, procs: int = 1, poll_delay: float | None = 0.01) -> Result:
    r = redis_client(url)
    loop = asyncio.new_event_loop()
    try:
        pool = loop.run_until_complete(_pool(url))
        with running(_worker_cmds(url, procs, poll_delay)) as ps:
            wait_ready(r, procs, ps)
            reader = DoneReader(r, ps)

            def submit(wf: str, ts: float) -> None:
                loop.run_until_complete(pool.enqueue_job("thinker", wf, ts, "hello"))

            submit("warm-0", time.time())
            reader.wait(1, 30)
            records = run_latency_loop(submit, reader, n, timeout_for(n, 0.3 if poll_delay is None else 5))
        loop.run_until_complete(pool.aclose())
    finally:
        loop.close()
    return summarize("arq", _variant(poll_delay), procs, records, mode="latency",
                     extra={"topology": f"{procs} worker process(es)"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--url", required=True)
    w.add_argument("--poll-delay", type=float, default=None)
    args = ap.parse_args(argv)
    worker(args.url, args.poll_delay)


if __name__ == "__main__":
    main()
