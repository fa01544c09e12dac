"""Celery with the Redis broker and the Redis result backend: chain(thinker, talker, code2wav).

Celery 5.7 needs redis-py >= 6.1, which conflicts with the project's pinned redis<6,
so it runs in its own virtualenv `.venv-bench-celery` (created by bench/run.py when
missing). The harness runs this file with that venv's python and reads one JSON
object from stdout:

    .venv-bench-celery/bin/python bench/peers/celery_chain.py throughput --url URL --n 2000 --procs 2
    .venv-bench-celery/bin/python bench/peers/celery_chain.py latency --url URL --n 200

What a user would run: one `celery worker` (prefork pool, `--concurrency P`), JSON
serializer (never pickle), results stored in Redis, default prefetch; gossip, mingle
and heartbeat events off (they only slow start-up and add idle traffic).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import redis
from celery import Celery, chain
from celery.signals import worker_ready

from bench import workload

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:1/0")   # set by the harness / argv

app = Celery("bench_celery", broker=URL, backend=URL)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@app.task(name="bench.thinker")
def thinker(wf: str, ts: float, prompt: str) -> dict:
    return {"wf": wf, "ts": ts, "texts": workload.thinker(prompt)}


@app.task(name="bench.talker")
def talker(prev: dict) -> dict:
    return {"wf": prev["wf"], "ts": prev["ts"], "codes": workload.talker(prev["texts"])}


_done_client = None


@app.task(name="bench.code2wav")
def code2wav(prev: dict) -> int:
    global _done_client
    audio = workload.code2wav(prev["codes"])
    if _done_client is None:
        _done_client = redis.Redis.from_url(app.conf.broker_url)
    _done_client.xadd(workload.DONE_STREAM, {"wf": prev["wf"], "ts": repr(prev["ts"]), "td": repr(time.time())})
    return len(audio)


@worker_ready.connect
def _ready(**_kw) -> None:
    redis.Redis.from_url(app.conf.broker_url).incr(workload.READY_KEY)


def _cmd(procs: int) -> list[tuple[str, list[str]]]:
    celery_bin = str(Path(sys.executable).with_name("celery"))
    return [("celery", [celery_bin, "-A", "bench.peers.celery_chain", "worker", "--pool", "prefork",
                        "--concurrency", str(procs), "--loglevel", "WARNING",
                        "--without-gossip", "--without-mingle", "--without-heartbeat"])]


def _submit(wf: str, ts: float) -> None:
    chain(thinker.s(wf, ts, "hello"), talker.s(), code2wav.s()).apply_async()


def run_throughput(url: str, n: int, procs: int, warmup: int = 50) -> dict:
    from bench.common import DoneReader, bench_env, running, submit_and_collect, summarize, wait_ready

    r = redis.Redis.from_url(url)
    with running(_cmd(procs), env=bench_env(BENCH_REDIS_URL=url)) as ps:
        wait_ready(r, 1, ps)
        records, cmds, submit_s = submit_and_collect(r, DoneReader(r, ps), _submit, n, warmup=warmup, min_rate=15)
    extra = {"topology": f"celery worker --pool prefork --concurrency {procs}", "submit_s": round(submit_s, 3),
             "submit_mode": "single", **cmds}
    return summarize("celery", "redis broker+backend", procs, records, extra=extra).to_dict()


def run_latency(url: str, n: int, procs: int = 1) -> dict:
    from bench.common import DoneReader, bench_env, run_latency_loop, running, summarize, timeout_for, wait_ready

    r = redis.Redis.from_url(url)
    with running(_cmd(procs), env=bench_env(BENCH_REDIS_URL=url)) as ps:
        wait_ready(r, 1, ps)
        reader = DoneReader(r, ps)
        _submit("warm-0", time.time())
        reader.wait(1, 60)
        records = run_latency_loop(_submit, reader, n, timeout_for(n, 5))
    return summarize("celery", "redis broker+backend", procs, records, mode="latency",
                     extra={"topology": f"--concurrency {procs}"}).to_dict()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["throughput", "latency"])
    ap.add_argument("--url", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--procs", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ["BENCH_REDIS_URL"] = args.url
    app.conf.update(broker_url=args.url, result_backend=args.url)
    # The harness stops us with SIGTERM on its own timeout: unwind so the worker is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    fn = run_throughput if args.mode == "throughput" else run_latency
    result = fn(args.url, args.n, args.procs)
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
