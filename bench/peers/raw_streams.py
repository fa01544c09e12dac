"""Raw Redis Streams: the practical limit for any stream-based design on this machine.

Three streams, one consumer group each; every worker loops XREADGROUP (COUNT 100,
BLOCK) → compute → one pipelined round trip with an XADD per message to the next
stream plus a single XACK for the whole batch. No workflow records, no Lua, no
retries, no state: nothing omniflow has to pay for durability. Workers use the
synchronous redis-py client with hiredis (cheaper per command than asyncio).

Worker: python -m bench.peers.raw_streams worker --url URL --stage thinker --consumer c1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # executed as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import msgpack

from bench import workload
from bench.common import (
    DoneReader, Result, cost_delta, redis_client, run_latency_loop, server_stats,
    running, summarize, timeout_for, wait_ready,
)

GROUP = "g"
STAGES = ["thinker", "talker", "code2wav"]
STREAM = {s: f"raw:{s}" for s in STAGES}
BATCH = 100
SUBMIT_BATCH = 100


def worker(url: str, stage: str, consumer: str) -> None:
    r = redis_client(url)
    src = STREAM[stage]
    idx = STAGES.index(stage)
    dst = STREAM[STAGES[idx + 1]] if idx + 1 < len(STAGES) else workload.DONE_STREAM
    packb, unpackb = msgpack.packb, msgpack.unpackb
    r.incr(workload.READY_KEY)
    while True:
        resp = r.xreadgroup(GROUP, consumer, {src: ">"}, count=BATCH, block=1000)
        if not resp:
            continue
        entries = resp[0][1]
        pipe = r.pipeline(transaction=False)
        ids = []
        for eid, f in entries:
            ids.append(eid)
            if stage == "thinker":
                out = {"wf": f[b"wf"], "ts": f[b"ts"], "d": packb(workload.thinker(f[b"p"].decode()))}
            elif stage == "talker":
                out = {"wf": f[b"wf"], "ts": f[b"ts"], "d": packb(workload.talker(unpackb(f[b"d"])))}
            else:
                audio = workload.code2wav(unpackb(f[b"d"]))
                out = {"wf": f[b"wf"], "ts": f[b"ts"], "td": repr(time.time()), "n": len(audio)}
            pipe.xadd(dst, out)
        pipe.xack(src, GROUP, *ids)
        pipe.execute()


def _setup(r) -> None:
    for s in STAGES:
        r.xgroup_create(STREAM[s], GROUP, id="0", mkstream=True)


def _worker_cmds(url: str, procs: int) -> list[tuple[str, list[str]]]:
    cmds = []
    for s in STAGES:
        for i in range(procs):
            cmds.append((f"raw-{s}-{i}", [sys.executable, "-m", "bench.peers.raw_streams", "worker",
                                          "--url", url, "--stage", s, "--consumer", f"{s}-{i}"]))
    return cmds


def run_throughput(url: str, n: int, procs: int, submit_batch: int = 1, warmup: int = 200) -> Result:
    """submit_batch=1: one XADD round trip per workflow, sequential (the discipline every peer
    uses: one client call per workflow). submit_batch=100: pipelined submits, the ceiling."""
    r = redis_client(url)
    _setup(r)
    with running(_worker_cmds(url, procs)) as ps:
        wait_ready(r, 3 * procs, ps)
        reader = DoneReader(r, ps)
        _submit_many(r, "warm", warmup, SUBMIT_BATCH)
        reader.wait(warmup, 30)
        before = server_stats(r)
        t0 = time.monotonic()
        _submit_many(r, "wf", n, submit_batch)
        submit_s = time.monotonic() - t0
        records = reader.wait(n, timeout_for(n, 300))
        cmds = cost_delta(before, server_stats(r), n)
    extra = {"topology": f"{procs} proc/stage ({3 * procs} processes)", "submit_s": round(submit_s, 3),
             "submit_mode": "single" if submit_batch == 1 else "pipelined", **cmds}
    variant = "submit 1 XADD/wf" if submit_batch == 1 else f"submit pipelined x{submit_batch}"
    return summarize("raw-streams", variant, procs, records, extra=extra)


def _submit_many(r, prefix: str, n: int, batch: int) -> None:
    if batch == 1:
        for i in range(n):
            r.xadd(STREAM["thinker"], {"wf": f"{prefix}-{i}", "ts": repr(time.time()), "p": "hello"})
        return
    for start in range(0, n, batch):
        pipe = r.pipeline(transaction=False)
        for i in range(start, min(n, start + batch)):
            pipe.xadd(STREAM["thinker"], {"wf": f"{prefix}-{i}", "ts": repr(time.time()), "p": "hello"})
        pipe.execute()


def run_latency(url: str, n: int, procs: int = 1) -> Result:
    r = redis_client(url)
    _setup(r)
    with running(_worker_cmds(url, procs)) as ps:
        wait_ready(r, 3 * procs, ps)
        reader = DoneReader(r, ps)
        _submit_many(r, "warm", 20, SUBMIT_BATCH)
        reader.wait(20, 30)

        def submit(wf: str, ts: float) -> None:
            r.xadd(STREAM["thinker"], {"wf": wf, "ts": repr(ts), "p": "hello"})

        records = run_latency_loop(submit, reader, n, timeout_for(n, 20))
    return summarize("raw-streams", "XREADGROUP/XADD/XACK", procs, records, mode="latency",
                     extra={"topology": f"{procs} proc/stage"})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--url", required=True)
    w.add_argument("--stage", choices=STAGES, required=True)
    w.add_argument("--consumer", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "worker":
        worker(args.url, args.stage, args.consumer)


if __name__ == "__main__":
    main()
