"""Python function calls per workflow in omniflow's worker (co-located, or one stage's) or in its
client, counted by cProfile: their side of what `bench/script_cost.py` is for Valkey's.

The user-path burst (bench/omniflow_user.py: default executors, `AsyncClient` with 8 submitters and
the completions watcher, one `omniflow worker --stage all`, every setting at its default) runs on an
embedded Valkey; after a warm-up, the worker's main thread (its event loop: where a no-op stage runs
once `runs_on = "auto"` has judged it) is profiled over N workflows. The worker is the real process,
started through a small wrapper that turns cProfile on at SIGUSR1 and writes the profile at SIGUSR2.

The count repeats to ~0.5 % between runs (batching moves only the per-flush calls, ~45 flushes per
2,000 workflows), where the worker's CPU per workflow moves by 5-15 % on this machine: the way to
measure a change to the worker's own Python (bench/notes.md, round 20). cProfile counts every resume
of a coroutine as a call, and builtins called from Python (`len`, `dict.get`) as calls too. Its own
overhead about doubles the worker's time: the `µs` columns rank, they do not time.

    .venv/bin/python bench/py_calls.py [--n 2000] [--top 40] [--save FILE] [--base FILE] [--client | --stage NAME] [--low]

`--stage NAME`: one worker process per stage (as in the one-process-per-stage rows), and that
stage's worker counted. `--client`: the burst's client instead (`AsyncClient`'s submits, its completions watcher and the
documents it decodes; in this process, its event loop's waits in `epoll` included in the µs).

`--low`: the workflows one at a time (the low-load latency rows' `Client` submit + wait) instead of
the burst: what a workflow costs the worker when it shares no batch with another.

`--save FILE` writes the counts per function as JSON; `--base FILE` prints each function's change
against such a file (two trees: run each tree's copy with `--save`, then compare).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import redis_client, running, start_server
from bench.omniflow_bench import USER_STAGES, Engine, pipeline_yaml
from bench.omniflow_user import _burst, _latency

# the worker under cProfile: on at SIGUSR1, written to $PY_CALLS_OUT at SIGUSR2
WRAPPER = """
import cProfile, os, signal, sys
profile = cProfile.Profile()
def start(*_):
    profile.enable()
def write(*_):
    profile.disable()
    profile.dump_stats(os.environ["PY_CALLS_OUT"])
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, write)
sys.argv = ["omniflow", *sys.argv[1:]]
from omniflow.cli import main
main()
"""


def _name(path: str, line: int, fn: str) -> str:
    for cut in (str(Path(__file__).resolve().parents[1]) + "/", "site-packages/", "lib/python3."):
        if cut in path:
            path = path.split(cut, 1)[1]
            if cut == "lib/python3.":
                path = "py3." + path
    return f"{path}:{fn}" if path != "~" else fn      # (no line: a change above a function keeps its name)


def profile_worker(n: int, warmup: int = 300, *, client: bool = False,
                   stage: str | None = None, low: bool = False) -> tuple[pstats.Stats, float]:
    """cProfile's stats of the worker's main thread over `n` workflows of the user-path burst, and the
    burst's wf/s (under the profiler: a fraction of the real rate). `client`: the burst's client
    instead (this process: `AsyncClient`'s submits, the completions watcher, the documents).
    `stage`: one worker process per stage (the split rows), and that stage's worker profiled.
    `low`: the workflows one at a time (the low-load latency rows' `Client` submit + wait): what a
    workflow costs when nothing is shared with another one."""
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-py-calls-"))
    wrapper, out = tmp / "wrapper.py", tmp / "worker.prof"
    wrapper.write_text(WRAPPER)
    profiled = f"omniflow-{stage}-0" if stage else "omniflow-worker-0"
    try:
        with start_server() as server:
            eng = Engine(server.url, 1, pipeline_yaml(1, stages=USER_STAGES), colocated=stage is None, defaults=True)
            cmds = [(name, [sys.executable, str(wrapper), *argv[3:]] if name == profiled else argv)
                    for name, argv in eng.commands()]
            if profiled not in (name for name, _ in cmds):
                raise SystemExit(f"no worker {profiled} in this topology: {[name for name, _ in cmds]}")
            r = redis_client(server.url)
            with running(cmds, env=dict(eng.env, PY_CALLS_OUT=str(out))) as procs:
                eng.wait_ready(r, procs)
                asyncio.run(_burst(server.url, eng, "warm", warmup))
                if client:
                    profile = cProfile.Profile()
                    t0 = time.perf_counter()
                    profile.enable()
                    asyncio.run(_burst(server.url, eng, "p", n))
                    profile.disable()
                    return pstats.Stats(profile), n / (time.perf_counter() - t0)
                worker = next(p for p in procs if getattr(p, "bench_name", "") == profiled)
                if low:
                    _latency(server.url, eng, "lw", 50)
                os.kill(worker.pid, signal.SIGUSR1)
                time.sleep(0.2)
                t0 = time.perf_counter()
                if low:
                    _latency(server.url, eng, "p", n)
                else:
                    asyncio.run(_burst(server.url, eng, "p", n))
                rate = n / (time.perf_counter() - t0)
                os.kill(worker.pid, signal.SIGUSR2)
                for _ in range(100):
                    if out.exists() and out.stat().st_size > 0:
                        break
                    time.sleep(0.1)
                time.sleep(0.3)         # (written in one go; wait for the file to be whole)
                return pstats.Stats(str(out)), rate
    finally:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def per_function(stats: pstats.Stats, n: int) -> dict[str, tuple[float, float]]:
    """name -> (calls per workflow, profiled µs per workflow of its own time)."""
    rows: dict[str, tuple[float, float]] = {}
    for (path, line, fn), (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        name = _name(path, line, fn)
        calls, us = rows.get(name, (0.0, 0.0))       # (two functions of one name in a file: summed)
        rows[name] = (calls + nc / n, us + tt / n * 1e6)
    return rows


def by_module(rows: dict[str, tuple[float, float]]) -> list[tuple[str, float, float]]:
    calls: Counter[str] = Counter()
    us: Counter[str] = Counter()
    for name, (c, t) in rows.items():
        module = name.split(":", 1)[0] if ":" in name else "(builtins)"
        calls[module] += c
        us[module] += t
    return sorted(((m, calls[m], us[m]) for m in calls), key=lambda x: -x[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=2000, help="workflows profiled (after a warm-up of 300)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--save", type=Path, help="write the counts per function to this JSON file")
    ap.add_argument("--base", type=Path, help="print the change against counts saved by --save")
    who_is_counted = ap.add_mutually_exclusive_group()
    who_is_counted.add_argument("--client", action="store_true",
                                help="count the burst's client (this process) instead")
    who_is_counted.add_argument("--stage", help="one worker process per stage, and this stage's counted "
                                                "(thinker, talker, code2wav)")
    ap.add_argument("--low", action="store_true",
                    help="one workflow at a time (Client submit + wait), not the burst")
    args = ap.parse_args()
    if args.low and args.client:
        ap.error("--low counts a worker (the client of one workflow at a time is the sync Client)")
    stats, rate = profile_worker(args.n, client=args.client, stage=args.stage, low=args.low)
    rows = per_function(stats, args.n)
    if args.save:       # (before the tables: a reader that stops early, `| head`, loses no counts)
        args.save.write_text(json.dumps({"n": args.n, "rows": rows}, indent=0))
    total_calls = sum(c for c, _ in rows.values())
    total_us = sum(t for _, t in rows.values())
    who = ("client (AsyncClient, this process)" if args.client else
           f"the {args.stage} worker (main thread), one process per stage" if args.stage else
           "worker (main thread), stages co-located") + (", one workflow at a time" if args.low else "")
    print(f"{who}, {args.n} workflows: {total_calls:,.1f} Python calls per workflow, "
          f"{total_us:,.0f} profiled µs per workflow ({rate:,.0f} wf/s under the profiler)\n")
    print("| module | calls/wf | profiled µs/wf |\n|---|---:|---:|")
    for module, c, t in by_module(rows)[:args.top // 2]:
        print(f"| {module} | {c:,.1f} | {t:,.1f} |")
    print("\n| function | calls/wf | profiled µs/wf |\n|---|---:|---:|")
    for name, (c, t) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {name} | {c:,.1f} | {t:,.1f} |")
    if args.base:
        base = {k: tuple(v) for k, v in json.loads(args.base.read_text())["rows"].items()}
        base_calls = sum(c for c, _ in base.values())
        print(f"\nagainst {args.base}: {base_calls:,.1f} -> {total_calls:,.1f} calls per workflow "
              f"({(total_calls / base_calls - 1) * 100:+.1f} %)\n")
        diffs = {k: rows.get(k, (0.0, 0.0))[0] - base.get(k, (0.0, 0.0))[0] for k in set(rows) | set(base)}
        print("| function | before | after |\n|---|---:|---:|")
        for k, d in sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:args.top // 2]:
            if abs(d) >= 0.05:
                print(f"| {k} | {base.get(k, (0.0, 0.0))[0]:,.1f} | {rows.get(k, (0.0, 0.0))[0]:,.1f} |")


if __name__ == "__main__":
    main()
