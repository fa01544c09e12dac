"""The user-path engine at a fixed offered rate: CPU per workflow of every process, latency, Redis work.

A burst moves by ±15 % from one run to the next on this machine, and its batching changes with every
change to the hot path; a fixed rate below saturation repeats to about ±2 % and shows what a burst
hides, the cost of a workflow whose every hop is its own round trip (bench/notes.md, round 11).

The toy pipeline of `make bench` co-located (`omniflow worker --stage all` + `omniflow reconciler`,
default settings, default executors: `--loop` for `runs_on = "loop"`), an `AsyncClient` submitting at
exactly `--rate` workflows/s (each `submit` awaited in turn) and one `completions()` watcher; after a
warm-up, `--seconds` of it. Prints one JSON line: wf/s reached, p50/p99 submit -> document (ms), µs of
CPU per workflow of each process (worker, reconciler, Valkey, this client) and in all, Redis commands
and script calls per workflow.

    .venv/bin/python bench/rate.py [--rate 600] [--seconds 5] [--loop] [--split] [--client-uvloop] [--commands]

To compare two trees of the code, run each tree's copy of this script, alternately, several times:
each imports omniflow from the tree it is in.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ProcessCPU, cost_delta, on_worker_loop, redis_client, running, server_stats, start_server
from bench.omniflow_bench import LOOP_STAGES, USER_STAGES, Engine, pipeline_yaml
from bench.omniflow_user import _burst, _client_kwargs

WARMUP = 200


async def paced(url: str, eng: Engine, rate: float, n: int) -> list[float]:
    """Submit `n` workflows at `rate` per second; each one's seconds from submit to its document."""
    from omniflow.client import AsyncClient

    latencies: list[float] = []
    watched: list[asyncio.Future[Any]] = []
    async with AsyncClient(url, **_client_kwargs(url, eng)) as client, client.completions() as ends:
        start = time.perf_counter()
        for i in range(n):
            ahead = start + i / rate - time.perf_counter()
            if ahead > 0:
                await asyncio.sleep(ahead)
            t0 = time.time()
            fut = ends.watch(await client.submit(f"r{i}"))
            fut.add_done_callback(lambda _f, t0=t0: latencies.append(time.time() - t0))
            watched.append(fut)
        await asyncio.wait_for(asyncio.gather(*watched), 120)
    return sorted(latencies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rate", type=float, default=600.0, help="workflows per second offered (default 600)")
    ap.add_argument("--seconds", type=float, default=5.0, help="how long (default 5)")
    ap.add_argument("--loop", action="store_true", help="the stages with runs_on = 'loop'")
    ap.add_argument("--split", action="store_true", help="one worker process per stage (default: co-located)")
    ap.add_argument("--commands", action="store_true", help="also every command's calls and Valkey µs per workflow")
    ap.add_argument("--client-uvloop", action="store_true",
                    help="this client on the workers' loop (OMNIFLOW_LOOP: uvloop by default; else asyncio.run's)")
    args = ap.parse_args()
    n = int(args.rate * args.seconds)
    with start_server() as server:
        url = server.url
        eng = Engine(url, 1, pipeline_yaml(1, stages=LOOP_STAGES if args.loop else USER_STAGES), colocated=not args.split,
                     defaults=True)
        r = redis_client(url)
        with running(eng.commands(), env=eng.env) as procs:
            eng.wait_ready(r, procs)
            asyncio.run(_burst(url, eng, "warm", WARMUP))
            before, meter, t0 = server_stats(r), ProcessCPU(r, procs), time.time()
            lat = (on_worker_loop if args.client_uvloop else asyncio.run)(paced(url, eng, args.rate, n))
            wall, cpu, cost = time.time() - t0, meter.take(), cost_delta(before, server_stats(r), n)
    per_wf = {name.replace("omniflow-", ""): round(s * 1e6 / n) for name, s in cpu.items()}
    print(json.dumps({"rate": args.rate, "wf/s": round(n / wall), "p50_ms": round(lat[len(lat) // 2] * 1000, 2),
                      "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2), **per_wf,
                      "total": sum(per_wf.values()), "cmds_per_wf": cost["cmds_per_wf"],
                      "fcall_per_wf": cost["cmds_top"].get("fcall"),
                      **({"commands": cost["cmds_breakdown"]} if args.commands else {})}))


if __name__ == "__main__":
    main()
