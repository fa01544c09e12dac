"""Where a low-load workflow's time goes, seen from the worker: every round trip its process writes
and every reply it reads, on the clock the client shares.

The toy pipeline of `make bench` on a fresh embedded Valkey: one `omniflow worker --stage all` (or
one worker process per stage with `--split`) and a reconciler, default settings, the executors on
their compute threads (`default`) or with `runs_on = "loop"` (`loop`); the public `Client` submits
one workflow at a time, 10 ms apart, and waits for its document. In each worker process a
`sitecustomize` (written to a temporary folder put first on its PYTHONPATH; nothing in omniflow
changes) wraps the lean transport's `_Conn.send` and `_Conn.data_received` to note the time, which
connection, and the first bytes; the notes are written when the worker exits. Per workflow, the
worker's events between its submit and its document; each step's median over the workflows whose
events follow the most common sequence.

    .venv/bin/python bench/io_timeline.py [--n 300] [--modes default,loop] [--split]

Per mode it prints the median submit -> document and, for each event, its median time after the
submit and the median gap from the event before: before a write, what the worker's own code took
(and its wake-up); before a reply, the round trip (the write, Valkey's wake-up and script, the
worker's wake-up). bench/notes.md, round 13, has what it showed.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import redis_client, running, start_server
from bench.omniflow_bench import LOOP_STAGES, USER_STAGES, Engine, pipeline_yaml
from bench.omniflow_user import _client_kwargs, _latency

TRACE_ENV = "OMNIFLOW_BENCH_IO_TRACE"
PACE_S = 0.01
# imported first by every Python process of the engine; only a worker traces (argv names it)
SITECUSTOMIZE = '''
import atexit, os, sys, time
_out = os.environ.get("%(env)s")
if _out and "worker" in sys.argv:
    import builtins
    _log = []
    _import = builtins.__import__

    def _patch():
        from omniflow.storage import resp
        conn = resp._Conn
        send, received = conn.send, conn.data_received

        def traced_send(self, packed, count):
            _log.append((time.time(), "S", id(self), bytes(packed[:160]).decode("latin-1")))
            return send(self, packed, count)

        def traced_received(self, data):
            _log.append((time.time(), "R", id(self), ""))
            return received(self, data)
        conn.send, conn.data_received = traced_send, traced_received

    _done = []

    def _hook(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        if not _done and hasattr(sys.modules.get("omniflow.storage.resp"), "Transport"):   # fully imported
            _done.append(True)
            builtins.__import__ = _import
            _patch()
        return module
    builtins.__import__ = _hook

    def _dump():
        import json
        with open(f"{_out}.{os.getpid()}", "w") as f:
            json.dump(_log, f)
    atexit.register(_dump)
''' % {"env": TRACE_ENV}


def label(head: str) -> str:
    """`FCALL claim`, `XREADGROUP`...: the command of a written round trip (its first one)."""
    words = head.split("\r\n")[2::2]
    if not words:
        return "?"
    if words[0].upper() == "FCALL" and len(words) > 1:
        return "FCALL " + words[1].rsplit("_", 1)[0]
    return words[0].upper()


def measure(mode: str, n: int, split: bool) -> dict[str, Any]:
    stages = LOOP_STAGES if mode == "loop" else USER_STAGES
    with tempfile.TemporaryDirectory(prefix="omniflow-io-") as tmp, start_server() as server:
        Path(tmp, "sitecustomize.py").write_text(SITECUSTOMIZE)
        out = str(Path(tmp, "trace"))
        eng = Engine(server.url, 1, pipeline_yaml(1, stages=stages), colocated=not split, defaults=True)
        eng.env[TRACE_ENV] = out
        eng.env["PYTHONPATH"] = tmp + os.pathsep + eng.env.get("PYTHONPATH", "")
        r = redis_client(server.url)
        marks: list[tuple[float, float]] = []
        with running(eng.commands(), env=eng.env) as procs:
            eng.wait_ready(r, procs)
            _latency(server.url, eng, "warm", 30)
            from omniflow.client import Client

            with Client(server.url, **_client_kwargs(server.url, eng)) as client:
                for i in range(n):
                    time.sleep(PACE_S)
                    t0 = time.time()
                    client.wait(client.submit(f"io{i}"), timeout_s=30)
                    marks.append((t0, time.time()))
        events: list[tuple[float, str, tuple[str, int], str]] = []
        for path in glob.glob(out + ".*"):       # one file per worker process: <out>.<pid>
            pid = path.rsplit(".", 1)[1]
            with open(path) as f:
                events += [(t, kind, (pid, conn), head) for t, kind, conn, head in json.load(f)]
    if not events:
        raise SystemExit("no worker wrote its trace (did it exit cleanly?)")
    events.sort()
    named: list[tuple[float, str]] = []
    last: dict[tuple[str, int], str] = {}    # connection -> the command it last wrote (what a reply answers)
    for t, kind, conn, head in events:
        if kind == "S":
            last[conn] = label(head)
            named.append((t, "write " + last[conn]))
        else:
            named.append((t, "reply to " + last.get(conn, "?")))
    per_wf = [(t1 - t0, [(t - t0, name) for t, name in named if t0 <= t <= t1]) for t0, t1 in marks]
    shape = Counter(tuple(name for _, name in seq) for _, seq in per_wf).most_common(1)[0][0]
    same = [seq for _, seq in per_wf if tuple(name for _, name in seq) == shape]
    steps = []
    for j, name in enumerate(shape):
        at = statistics.median(seq[j][0] for seq in same) * 1e3
        gap = statistics.median(seq[j][0] - (seq[j - 1][0] if j else 0.0) for seq in same) * 1e3
        steps.append({"event": name, "at_ms": round(at, 3), "gap_ms": round(gap, 3)})
    return {"mode": mode, "split": split, "n": n, "matching": len(same),
            "p50_ms": round(statistics.median(e for e, _ in per_wf) * 1e3, 3), "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--modes", default="default,loop", help="default (compute threads) and/or loop")
    ap.add_argument("--split", action="store_true", help="one worker process per stage")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        res = measure(mode, args.n, args.split)
        print(f"\n{mode}{' (one process per stage)' if args.split else ''}: submit -> document p50 "
              f"{res['p50_ms']:.3f} ms; steps: medians over the {res['matching']} of {res['n']} workflows "
              f"with the most common sequence")
        print("| event | ms after submit | gap ms |\n|---|---:|---:|")
        for step in res["steps"]:
            print(f"| {step['event']} | {step['at_ms']:.3f} | {step['gap_ms']:.3f} |")


if __name__ == "__main__":
    main()
