"""Dramatiq with its Redis broker: three actors, each sending the next.

What a user would run: the `dramatiq` CLI with all three actors in one module on the
default queue, `--processes P --threads 8` (8 threads is Dramatiq's default), default
middleware and the default JSON encoder. The harness enqueues the first message with
a plain RedisBroker client (one enqueue call per workflow, sequential).
"""
from __future__ import annotations

import sys
import time

from bench.common import (
    DoneReader, Result, bench_env, redis_client, run_latency_loop, running, submit_and_collect, summarize,
    timeout_for, wait_ready,
)

THREADS = 8


def _cmd(procs: int) -> list[tuple[str, list[str]]]:
    return [("dramatiq", [sys.executable, "-m", "dramatiq", "bench.peers._dramatiq_actors",
                          "--processes", str(procs), "--threads", str(THREADS)])]


def _client(url: str):
    import dramatiq
    from dramatiq.brokers.redis import RedisBroker

    broker = RedisBroker(url=url)
    broker.declare_queue("default")

    def submit(wf: str, ts: float) -> None:
        broker.enqueue(dramatiq.Message(queue_name="default", actor_name="thinker", args=(wf, ts, "hello"),
                                        kwargs={}, options={}))
    return broker, submit


def run_throughput(url: str, n: int, procs: int, warmup: int = 100) -> Result:
    r = redis_client(url)
    broker, submit = _client(url)
    with running(_cmd(procs), env=bench_env(BENCH_REDIS_URL=url)) as ps:
        wait_ready(r, procs, ps)
        records, cmds, submit_s = submit_and_collect(r, DoneReader(r, ps), submit, n, warmup=warmup, min_rate=100)
    broker.close()
    extra = {"topology": f"dramatiq CLI --processes {procs} --threads {THREADS}", "submit_s": round(submit_s, 3),
             "submit_mode": "single", **cmds}
    return summarize("dramatiq", "redis broker", procs, records, extra=extra)


def run_latency(url: str, n: int, procs: int = 1) -> Result:
    r = redis_client(url)
    broker, submit = _client(url)
    with running(_cmd(procs), env=bench_env(BENCH_REDIS_URL=url)) as ps:
        wait_ready(r, procs, ps)
        reader = DoneReader(r, ps)
        submit("warm-0", time.time())
        reader.wait(1, 60)
        records = run_latency_loop(submit, reader, n, timeout_for(n, 5))
    broker.close()
    return summarize("dramatiq", "redis broker", procs, records, mode="latency",
                     extra={"topology": f"--processes {procs} --threads {THREADS}"})
