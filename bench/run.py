"""`make bench`: omniflow against the queues a user would pick instead, same machine, same run.

    .venv/bin/python bench/run.py                 # full run (~10 min on 2 cores)
    .venv/bin/python bench/run.py --quick         # smoke test (~1-2 min)
    .venv/bin/python bench/run.py --only raw,omniflow --n 3000 --repeats 5
    .venv/bin/python bench/run.py --only dataplane   # chunk payloads per transport: only its section of the docs
    .venv/bin/python bench/run.py --only dataplane --render   # that section again from bench/out/dataplane.json

Every configuration gets its own fresh embedded Valkey (never the system Redis).
Prints a table, writes docs/benchmarks.md + docs/benchmarks.png and bench/out/results.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    OUT_DIR, REPO_ROOT, BenchError, BenchSkip, Result, bench_env, format_table, log, median_results, skipped_result,
    start_server,
)
from bench.report import (
    DOCS, command_breakdown, plot, ratio_lines, splice_dataplane, splice_section, tracing_lines, user_lines, write_markdown,
)

CELERY_VENV = REPO_ROOT / ".venv-bench-celery"
# pipeline: bench/pipeline.py; user: omniflow as a user meets it (bench/omniflow_user.py); http: bench/api_latency.py
# realtime: bench/realtime.py (/v1/realtime barge-in, first deltas, audio turns)
# tracing: bench/tracing_bench.py (the cost of OpenTelemetry traces: off, on unsampled, on exported)
# speech: bench/speech.py (transcription and /v1/audio/speech against the models in process; real models)
GROUPS = ["raw", "inproc", "arq", "dramatiq", "celery", "bullmq", "omniflow", "user", "http", "pipeline", "dataplane",
          "realtime", "tracing", "speech", "overload"]
BULLMQ_CONCURRENCY = (1, 8, 32)


@dataclass
class Spec:
    group: str                       # --only name
    label: str                       # for progress lines
    fn: Callable[[str | None], Result]
    mode: str = "throughput"
    aof: bool = False                # AOF appendfsync everysec (the persistence rows)
    repeat: bool = True              # False: run once even with --repeats > 1 (slow, informative rows)
    server: bool = True


# --------------------------------------------------------------------------- configuration


def build_specs(args: argparse.Namespace, omni, user=None) -> list[Spec]:
    from bench import api_latency, hop
    from bench.peers import arq_chain, bullmq_chain, dramatiq_chain, inproc, raw_streams

    n, lat_n = args.n, args.latency_n
    raw_n = n if args.quick else 2 * n   # raw streams finish 2N in about a second
    specs: list[Spec] = []
    add = specs.append

    # Raw Redis Streams: the same one-call-per-workflow submit as the peers, and pipelined submits.
    for procs in (1, 2):
        add(Spec("raw", f"raw streams, submit 1/wf, {procs} proc/stage",
                 lambda u, p=procs: raw_streams.run_throughput(u, raw_n, p)))
    for procs in (1, 2):
        add(Spec("raw", f"raw streams, pipelined submit, {procs} proc/stage",
                 lambda u, p=procs: raw_streams.run_throughput(u, raw_n, p,
                                                               submit_batch=100)))
    add(Spec("raw", "raw streams, submit 1/wf, 1 proc/stage, AOF everysec",
             lambda u: raw_streams.run_throughput(u, n, 1), aof=True))
    add(Spec("raw", "raw streams latency", lambda u: raw_streams.run_latency(u, lat_n), mode="latency"))

    add(Spec("inproc", "in-process asyncio", lambda u: inproc.run_throughput(None, 10 * n), server=False))
    add(Spec("inproc", "in-process asyncio latency", lambda u: inproc.run_latency(None, lat_n),
             mode="latency", server=False))

    # Busy arq workers do not sleep between polls, so poll_delay barely moves throughput:
    # 0.01 with 1 and 2 processes (repeated), 0.001 with 1, once (keeps the full run near 10 minutes).
    for pd, procs in ((0.01, 1), (0.01, 2), (0.001, 1)):
        add(Spec("arq", f"arq poll_delay {pd}, {procs} proc",
                 lambda u, p=procs, d=pd: arq_chain.run_throughput(u, n, p, poll_delay=d), repeat=pd == 0.01))
    # arq's defaults (poll_delay 0.5 s, max_jobs 10) cap a worker at ~20 jobs/s: small n, run once.
    arq_default_n = 30 if args.quick else 100
    add(Spec("arq", "arq defaults, 2 procs",
             lambda u: arq_chain.run_throughput(u, arq_default_n, 2, poll_delay=None, warmup=5), repeat=False))
    for pd in (0.01, 0.001):
        add(Spec("arq", f"arq poll_delay {pd} latency",
                 lambda u, d=pd: arq_chain.run_latency(u, lat_n, poll_delay=d), mode="latency"))
    add(Spec("arq", "arq defaults latency",
             lambda u: arq_chain.run_latency(u, 5 if args.quick else 10, poll_delay=None),
             mode="latency", repeat=False))

    for procs in (1, 2):
        add(Spec("dramatiq", f"dramatiq {procs} proc",
                 lambda u, p=procs: dramatiq_chain.run_throughput(u, n, p)))
    add(Spec("dramatiq", "dramatiq latency", lambda u: dramatiq_chain.run_latency(u, lat_n), mode="latency"))

    # Celery is the slowest peer (~25 s per run at N=2000): concurrency 1 runs once, 2 gets the repeats.
    for procs in (1, 2):
        add(Spec("celery", f"celery concurrency {procs}",
                 lambda u, p=procs: run_celery("throughput", u, n, p, timeout_s=args.celery_timeout),
                 repeat=procs == 2))
    add(Spec("celery", "celery latency",
             lambda u: run_celery("latency", u, lat_n, 1, timeout_s=args.celery_timeout), mode="latency"))

    # BullMQ (Node): worker concurrency 1, 8, 32 with one process, and two processes at 8.
    for procs, conc in [(1, c) for c in BULLMQ_CONCURRENCY] + [(2, 8)]:
        add(Spec("bullmq", f"bullmq {procs} proc, concurrency {conc}",
                 lambda u, p=procs, c=conc: bullmq_chain.run_burst(u, n, p, c)))
    add(Spec("bullmq", "bullmq latency", lambda u: bullmq_chain.run_latency(u, lat_n), mode="latency"))

    if user is not None:
        # omniflow as a user meets it: default executors and settings, the public client, wait -> document
        for procs in (1, 2):
            add(Spec("user", f"omniflow user path, {procs} proc, stages co-located",
                     lambda u, p=procs: user.run_burst(u, n, p, colocated=True)))
        add(Spec("user", "omniflow user path, 1 proc/stage", lambda u: user.run_burst(u, n, 1, colocated=False)))
        for colocated in (True, False):
            add(Spec("user", f"omniflow user path latency{', stages co-located' if colocated else ', 1 proc/stage'}",
                     lambda u, c=colocated: user.run_latency(u, lat_n, colocated=c), mode="latency"))
        add(Spec("user", "omniflow user path, submit_many + wait_many, 1 proc, stages co-located",
                 lambda u: user.run_burst(u, n, 1, colocated=True, pipelined=True)))
        # the same with the stages on the worker's loop: what the default executors' compute-thread hop costs
        add(Spec("user", "omniflow user client, runs_on=loop, 1 proc, stages co-located",
                 lambda u: user.run_burst(u, n, 1, colocated=True, on_loop=True)))
        add(Spec("user", "omniflow user client latency, runs_on=loop, stages co-located",
                 lambda u: user.run_latency(u, lat_n, colocated=True, on_loop=True), mode="latency"))
        add(Spec("user", "compute-thread hop micro-benchmark (bench/hop.py)",
                 lambda u: hop.run(quick=args.quick), mode="hop", repeat=False, server=False))
    add(Spec("http", "HTTP path against the Python client (bench/api_latency.py)",
             lambda u: api_latency.run(quick=args.quick), mode="http", repeat=False, server=False))

    if omni is not None:
        for procs in (1, 2):
            add(Spec("omniflow", f"omniflow {procs} proc/stage",
                     lambda u, p=procs: omni.run_throughput(u, n, p)))
        # the peers' workers run all three steps in one process: so can omniflow's (`--stage all`)
        for procs in (1, 2):
            add(Spec("omniflow", f"omniflow {procs} proc, stages co-located",
                     lambda u, p=procs: omni.run_throughput(u, n, p, colocated=True)))
        add(Spec("omniflow", "omniflow 1 proc/stage, AOF everysec",
                 lambda u: omni.run_throughput(u, n, 1), aof=True))
        add(Spec("omniflow", "omniflow latency", lambda u: omni.run_latency(u, lat_n), mode="latency"))
        add(Spec("omniflow", "omniflow latency, stages co-located",
                 lambda u: omni.run_latency(u, lat_n, colocated=True), mode="latency"))
        # what traces cost: the co-located row (the engine's CPU bounds it) off, on unsampled, on exported
        from bench import tracing_bench

        for mode, label in tracing_bench.MODES.items():
            add(Spec("tracing", f"omniflow 1 proc, stages co-located, {label}",
                     lambda u, m=mode: tracing_bench.run(u, n, m)))
        if hasattr(omni, "run_extra"):
            # Optional: extra omniflow rows (e.g. the simulated-GPU run) -> list[Result].
            add(Spec("omniflow", "omniflow extra rows", lambda u: omni.run_extra(u, quick=args.quick),
                     mode="extra", repeat=False))
    return [s for s in specs if s.group in args.only]


def load_omniflow(module: str = "bench.omniflow_bench"):
    """bench/omniflow_bench.py (or omniflow_user.py), written once the engine exists. Never fake its numbers."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        log(f"omniflow row MISSING: {module} could not be imported ({exc})")
        return None


# --------------------------------------------------------------------------- celery (own venv)


def ensure_celery_venv() -> Path:
    """Celery 5.7 needs redis-py>=6.1 (the project pins <6): it lives in its own venv."""
    py = CELERY_VENV / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", "import celery, redis, msgpack"],
                                      capture_output=True).returncode == 0:
        return py
    base = shutil.which("python3") or sys.executable
    log(f"creating {CELERY_VENV.name} (celery[redis], msgpack) ...")
    subprocess.run([base, "-m", "venv", str(CELERY_VENV)], check=True, timeout=300)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "celery[redis]", "msgpack"], check=True, timeout=600)
    return py


def run_celery(mode: str, url: str, n: int, procs: int, timeout_s: float) -> Result:
    py = ensure_celery_venv()
    cmd = [str(py), str(REPO_ROOT / "bench" / "peers" / "celery_chain.py"), mode,
           "--url", url, "--n", str(n), "--procs", str(procs)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=bench_env(BENCH_REDIS_URL=url), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()                       # it stops its celery worker on SIGTERM
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
        raise BenchError(f"celery {mode} timed out after {timeout_s:.0f}s")
    if proc.returncode != 0:
        raise BenchError(f"celery {mode} failed (rc {proc.returncode}): {err[-1500:]}")
    return Result.from_dict(json.loads(out.strip().splitlines()[-1]))


# --------------------------------------------------------------------------- running


def _reps(spec: Spec, repeats: int) -> int:
    return repeats if spec.repeat else 1


def run_once(spec: Spec, i: int, reps: int) -> Result | list[Result]:
    """One repetition of one configuration, on a fresh server (exceptions are the caller's)."""
    t0 = time.monotonic()
    if spec.server:
        with start_server(appendonly=spec.aof, appendfsync="everysec") as server:
            res = spec.fn(server.url)
    else:
        res = spec.fn(None)
    if isinstance(res, list):          # groups that measure several rows in one go
        for row in res:
            log(f"  {row.variant}: {row.workflows_per_s:,.1f}/s  p50 {row.p50_ms:.2f} ms  p99 {row.p99_ms:.2f} ms")
        return list(res)
    res.mode = spec.mode
    res.extra["server"] = ("AOF everysec" if spec.aof else "AOF off") if spec.server else "none"
    if spec.aof:
        res.variant += " +AOF everysec"
    log(f"  {spec.label} [{i + 1}/{reps}]: {res.workflows_per_s:,.0f} wf/s  p50 {res.p50_ms:.2f} ms"
        f"  p99 {res.p99_ms:.2f} ms  ({time.monotonic() - t0:.1f}s)")
    return res


def run_specs(specs: list[Spec], repeats: int, *, interleave: bool = True) -> tuple[list[Result], list[str]]:
    """Every configuration, its medians in the order given, and the failures. `interleave`: the
    repetitions go round-robin (the first of every configuration, then the second...), so that each
    row's median spans the whole run and a neighbour's load moves all rows alike; otherwise each
    configuration's repetitions run back to back."""
    runs: dict[int, list[Result]] = {k: [] for k in range(len(specs))}
    final: dict[int, list[Result]] = {}            # rows settled early: skipped, failed, multi-row groups
    failures: list[str] = []
    order = [(i, k) for i in range(repeats) for k in range(len(specs))] if interleave else \
        [(i, k) for k in range(len(specs)) for i in range(repeats)]
    for i, k in order:
        spec = specs[k]
        if k in final or i >= _reps(spec, repeats):
            continue
        log(f"- {spec.label}" + (f" (repetition {i + 1})" if i and interleave else ""))
        try:
            res = run_once(spec, i, _reps(spec, repeats))
        except BenchSkip as exc:   # a peer whose runtime is not installed: a row saying so, not a failure
            log(f"  SKIPPED {spec.label}: {exc}")
            final[k] = [skipped_result(spec.group, spec.label, 0, spec.mode, str(exc))]
            continue
        except Exception as exc:  # one failing peer must not sink the whole run
            log(f"  FAILED {spec.label}: {exc}")
            (OUT_DIR / "errors.log").open("a").write(f"--- {spec.label}\n{traceback.format_exc()}\n")
            final[k] = [median_results(runs[k])] if runs[k] else []
            last = ([ln for ln in str(exc).splitlines() if ln.strip()] or [repr(exc)])[-1].strip()
            failures.append(f"{spec.label}: {last}")
            continue
        if isinstance(res, list):
            final[k] = res
        else:
            runs[k].append(res)
    results: list[Result] = []
    for k in range(len(specs)):
        results.extend(final[k] if k in final else [median_results(runs[k])] if runs[k] else [])
    return results, failures


# --------------------------------------------------------------------------- main


def load_dataplane() -> dict | None:
    """The last data-plane result (bench/out/dataplane.json), so a run of other groups keeps the section."""
    path = OUT_DIR / "dataplane.json"
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=None, help="workflows per throughput run (default 2000; quick 300)")
    ap.add_argument("--latency-n", type=int, default=None, help="workflows in the latency runs (default 200)")
    ap.add_argument("--repeats", type=int, default=None, help="repetitions per config, medians (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke test: small n, 1 repeat")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {','.join(GROUPS)}")
    ap.add_argument("--celery-timeout", type=float, default=300.0)
    ap.add_argument("--back-to-back", action="store_true",
                    help="run each configuration's repetitions one after another (default: round-robin over all)")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.{md,png}")
    ap.add_argument("--render", action="store_true",
                    help="measure nothing: rewrite docs/benchmarks.{md,png} from bench/out/ (e.g. after editing notes.md)")
    args = ap.parse_args(argv)
    args.n = args.n or (300 if args.quick else 2000)
    args.latency_n = args.latency_n or (50 if args.quick else 200)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.only = {x.strip() for x in args.only.split(",") if x.strip()}
    unknown = args.only - set(GROUPS)
    if unknown:
        ap.error(f"unknown --only {sorted(unknown)}; choose from {GROUPS}")

    if args.render and args.only == {"dataplane"}:
        dp = load_dataplane()
        if not dp:
            ap.error("no bench/out/dataplane.json: run --only dataplane first")
        from bench import dataplane

        dataplane.plot(dp, DOCS / "dataplane.png")
        splice_dataplane(DOCS / "benchmarks.md", dp)
        print(f"re-rendered the data-plane section of {DOCS / 'benchmarks.md'} from {OUT_DIR / 'dataplane.json'}")
        return 0
    if args.render:
        meta = json.loads((OUT_DIR / "run.json").read_text())
        results = [Result.from_dict(d) for d in json.loads((OUT_DIR / "results.json").read_text())]
        args.repeats, args.only = meta["repeats"], set(meta["only"])
        have_plot = plot(results, DOCS / "benchmarks.png")
        dp = load_dataplane()
        if dp:
            from bench import dataplane

            dataplane.plot(dp, DOCS / "dataplane.png")
        # the run's own end and load (run.json; a run.json of before has no time: results.json's mtime)
        ended = meta.get("ended") or (OUT_DIR / "results.json").stat().st_mtime
        write_markdown(DOCS / "benchmarks.md", results, meta["failures"], args, meta["wall_s"],
                       meta["omni_missing"], have_plot, dp, meta.get("load_start"), meta.get("load_end"),
                       dt.datetime.fromtimestamp(ended))
        print(f"re-rendered {DOCS / 'benchmarks.md'} from {OUT_DIR / 'results.json'}")
        return 0

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "errors.log").write_text("")
    t_start = time.monotonic()
    load_start = list(os.getloadavg())
    omni = load_omniflow() if args.only & {"omniflow", "tracing"} else None
    omni_missing = "omniflow" in args.only and omni is None
    user = load_omniflow("bench.omniflow_user") if "user" in args.only else None
    if "celery" in args.only:
        ensure_celery_venv()
    if "bullmq" in args.only:
        from bench.peers import bullmq_chain

        bullmq_chain.ensure_packages()

    results, failures = run_specs(build_specs(args, omni, user), args.repeats, interleave=not args.back_to_back)
    if "pipeline" in args.only:
        from bench import pipeline

        log("- the real CPU omni pipeline (bench/pipeline.py)")
        try:
            for line in pipeline.lines(pipeline.run(quick=args.quick)):
                log(f"  {line}")
        except Exception as exc:  # noqa: BLE001 - one failed group is reported, the others still render
            failures.append(f"pipeline: {exc!r}")
    if "overload" in args.only:
        from bench import overload

        log("- under overload: priorities and fair share (bench/overload.py)")
        try:
            doc = overload.run(**({"batch": 500, "probes": 30} if args.quick else {}))
            for line in overload.lines(doc):
                log(f"  {line}")
        except Exception as exc:  # noqa: BLE001 - one failed group is reported, the others still render
            failures.append(f"overload: {exc!r}")
    if "realtime" in args.only:
        from bench import realtime

        log("- /v1/realtime barge-in and first deltas (bench/realtime.py)")
        try:
            quick = {"turns": 5, "first_turns": 3} if args.quick else {"turns": 30, "first_turns": 10}
            log("  " + realtime.markdown(realtime.run(**quick))[4])
        except Exception as exc:  # noqa: BLE001 - one failed group is reported, the others still render
            failures.append(f"realtime: {exc!r}")
    if "speech" in args.only:
        from bench import speech

        log("- speech in and out against the models in process (bench/speech.py)")
        try:
            for line in speech.markdown(speech.run(quick=args.quick))[7:10]:
                log(f"  {line}")
        except Exception as exc:  # noqa: BLE001 - one failed group is reported, the others still render
            failures.append(f"speech: {exc!r}")
    dp_result = None
    if "dataplane" in args.only:
        from bench import dataplane

        log("- data plane (bench/dataplane.py)")
        try:
            dp_result = dataplane.run(quick=args.quick)
        except Exception as exc:  # one failing part must not sink the whole run
            (OUT_DIR / "errors.log").open("a").write(f"--- dataplane\n{traceback.format_exc()}\n")
            failures.append(f"dataplane: {exc}")
    wall = time.monotonic() - t_start

    print()
    print(format_table(results, markdown=False))
    if dp_result:
        from bench import dataplane

        print()
        print("\n".join(dataplane.table(dp_result)))
        print("\n".join(dp_result["lines"]))
    print()
    for line in user_lines(results) + ratio_lines(results, omni_missing, "omniflow" in args.only) + tracing_lines(results):
        print(line)
    print(f"load average at the start {' / '.join(f'{x:.1f}' for x in load_start)}, at the end "
          f"{' / '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min, {os.cpu_count()} CPUs)")
    if omni_missing:
        print("omniflow row MISSING: bench/omniflow_bench.py not found / not importable.")
    for f in failures:
        print(f"FAILED: {f}")
    print(f"wall time: {wall:.0f}s")

    if "tracing" in args.only:
        from bench import tracing_bench

        tracing_bench.save(results, list(os.getloadavg()))
    # a data-plane-only (or tracing-only) run keeps the last full run's results (what --render renders)
    if args.only not in ({"dataplane"}, {"tracing"}):
        (OUT_DIR / "results.json").write_text(json.dumps([r.to_dict() for r in results], indent=1, default=str))
        (OUT_DIR / "run.json").write_text(json.dumps({"wall_s": wall, "repeats": args.repeats,
                                                      "only": sorted(args.only), "failures": failures,
                                                      "omni_missing": omni_missing, "load_start": load_start,
                                                      "load_end": list(os.getloadavg()), "ended": time.time()}))
        breakdown = command_breakdown(results)
        if breakdown:
            (OUT_DIR / "commands.md").write_text("\n".join(["# omniflow user path: Redis commands per workflow", "",
                                                            *breakdown]))
    if not args.no_docs and args.only == {"tracing"}:
        from bench import tracing_bench

        splice_section(DOCS / "benchmarks.md", tracing_bench.BEGIN, tracing_bench.END, tracing_bench.markdown())
        print(f"updated the tracing section of {DOCS / 'benchmarks.md'}")
    elif not args.no_docs and args.only == {"dataplane"}:
        if dp_result:
            from bench import dataplane

            dataplane.plot(dp_result, DOCS / "dataplane.png")
            splice_dataplane(DOCS / "benchmarks.md", dp_result)
            print(f"updated the data-plane section of {DOCS / 'benchmarks.md'} and {DOCS / 'dataplane.png'}")
    elif not args.no_docs:
        DOCS.mkdir(exist_ok=True)
        have_plot = plot(results, DOCS / "benchmarks.png")
        dp = dp_result or load_dataplane()
        if dp_result:
            from bench import dataplane

            dataplane.plot(dp_result, DOCS / "dataplane.png")
        write_markdown(DOCS / "benchmarks.md", results, failures, args, wall, omni_missing, have_plot, dp, load_start)
        print(f"wrote {DOCS / 'benchmarks.md'}" + (f" and {DOCS / 'benchmarks.png'}" if have_plot else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
