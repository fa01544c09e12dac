"""Shared benchmark plumbing: results, percentiles, processes, servers, measurement, tables.

Import-light on purpose: only the standard library at import time (redis-py and
omniflow are imported lazily) because the Celery virtualenv imports this module too.
"""
from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from bench.workload import DONE_STREAM, READY_KEY

REPO_ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = REPO_ROOT / "bench" / "out"          # git-ignored: worker logs, raw JSON
LOG_DIR = OUT_DIR / "logs"


class BenchError(RuntimeError):
    """A run that could not produce a number (timeout, dead worker, broken peer)."""


class BenchSkip(BenchError):
    """A peer that cannot run on this machine (its runtime is not installed): a note, not a failure."""


# --------------------------------------------------------------------------- results


@dataclass
class Result:
    system: str
    variant: str
    procs: int
    n: int
    workflows_per_s: float
    p50_ms: float
    p99_ms: float
    extra: dict[str, Any] = field(default_factory=dict)
    mode: str = "throughput"          # "throughput" or "latency" (one workflow at a time)

    def key(self) -> tuple[str, str, str, int]:
        return (self.mode, self.system, self.variant, self.procs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Result":
        return cls(**d)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def summarize(
    system: str,
    variant: str,
    procs: int,
    records: Sequence[tuple[str, float, float]],
    *,
    mode: str = "throughput",
    extra: dict[str, Any] | None = None,
) -> Result:
    """records: (workflow id, submit time, completion time), wall-clock seconds."""
    if not records:
        raise BenchError(f"{system}/{variant}: no completed workflows")
    first_submit = min(r[1] for r in records)
    last_done = max(r[2] for r in records)
    lat_ms = [(r[2] - r[1]) * 1000.0 for r in records]
    span = max(last_done - first_submit, 1e-9)
    ex = {"span_s": round(span, 4)}
    ex.update(extra or {})
    return Result(
        system=system,
        variant=variant,
        procs=procs,
        n=len(records),
        workflows_per_s=len(records) / span,
        p50_ms=percentile(lat_ms, 50),
        p99_ms=percentile(lat_ms, 99),
        extra=ex,
        mode=mode,
    )


def median_results(runs: Sequence[Result]) -> Result:
    """Median of repeated runs of one configuration (each metric independently)."""
    first = runs[0]
    extra = dict(first.extra)
    extra["repeats"] = len(runs)
    extra["workflows_per_s_runs"] = [round(r.workflows_per_s, 1) for r in runs]
    for k in ("cmds_per_wf", "bytes_in_per_wf", "valkey_cpu_us_per_wf"):
        vals = [r.extra[k] for r in runs if isinstance(r.extra.get(k), (int, float))]
        if vals:
            extra[k] = statistics.median(vals)
    return Result(
        system=first.system,
        variant=first.variant,
        procs=first.procs,
        n=first.n,
        workflows_per_s=statistics.median(r.workflows_per_s for r in runs),
        p50_ms=statistics.median(r.p50_ms for r in runs),
        p99_ms=statistics.median(r.p99_ms for r in runs),
        extra=extra,
        mode=first.mode,
    )


# --------------------------------------------------------------------------- processes

_LIVE: list[subprocess.Popen] = []


def on_worker_loop(coro: Any) -> Any:
    """Run `coro` to its end on the event loop a worker runs on (`omniflow.runtime.loop_factory`,
    `OMNIFLOW_LOOP`: uvloop by default)."""
    import asyncio

    from omniflow.runtime import loop_factory

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)


def bench_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def spawn(cmd: Sequence[str], name: str, *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a real subprocess in its own process group, output to bench/out/logs/<name>.log."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = open(LOG_DIR / f"{name}.log", "wb")
    try:
        proc = subprocess.Popen(
            list(cmd), cwd=REPO_ROOT, env=env or bench_env(), stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    finally:
        log.close()
    proc.bench_name = name  # type: ignore[attr-defined]
    _LIVE.append(proc)
    return proc


def stop(procs: Iterable[subprocess.Popen], timeout_s: float = 5.0) -> None:
    """SIGTERM each process group, then SIGKILL whatever is left after timeout_s."""
    procs = list(procs)
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        # Kill the whole group even if the leader exited: forked children (dramatiq,
        # celery prefork) must not outlive the run.
        _signal_group(p, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(2.0)
        if p in _LIVE:
            _LIVE.remove(p)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, sig)


@contextlib.contextmanager
def running(cmds: Sequence[tuple[str, Sequence[str]]], *, env: dict[str, str] | None = None) -> Iterator[list[subprocess.Popen]]:
    """Start (name, argv) processes; always stop them on the way out."""
    procs: list[subprocess.Popen] = []
    try:
        for name, cmd in cmds:
            procs.append(spawn(cmd, name, env=env))
        yield procs
    finally:
        stop(procs)


def check_alive(procs: Iterable[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is not None:
            name = getattr(p, "bench_name", str(p.args))
            log = LOG_DIR / f"{name}.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            raise BenchError(f"worker {name} exited with code {p.returncode}:\n{tail}")


def _cleanup_all() -> None:
    if _LIVE:
        stop(list(_LIVE), timeout_s=2.0)


atexit.register(_cleanup_all)


# --------------------------------------------------------------------------- servers


@contextlib.contextmanager
def start_server(appendonly: bool = False, appendfsync: str = "everysec") -> Iterator[Any]:
    """A fresh private Valkey (never the system Redis); `.url`. Removed afterwards."""
    from omniflow.ops.embedded import EmbeddedServer

    tmp = Path(tempfile.mkdtemp(prefix="omniflow-bench-"))
    server = EmbeddedServer(data_dir=tmp, appendonly=appendonly, appendfsync=appendfsync)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- measurement (sync redis-py)


def _cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process (from /proc; 0 where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class ProcessCPU:
    """user + system CPU of a row's processes (spawned ones under their names, `more` by name: pid),
    Valkey's and this client's (the harness process), from its creation on."""

    def __init__(self, r: Any, procs: Sequence[subprocess.Popen], more: dict[str, int] | None = None) -> None:
        self.watched = {getattr(p, "bench_name", str(p.pid)): p.pid for p in procs}
        self.watched.update(more or {})
        self.watched["valkey"] = int(r.info("server")["process_id"])
        self.cpu0 = {name: _cpu_s(pid) for name, pid in self.watched.items()}
        self.client0 = time.process_time()

    def take(self) -> dict[str, float]:
        cpu = {name: _cpu_s(pid) - self.cpu0[name] for name, pid in self.watched.items()}
        cpu["client"] = time.process_time() - self.client0
        return cpu

    @staticmethod
    def per_wf(cpu: dict[str, float], n: int) -> dict[str, Any]:
        """{cpu_us_per_wf: {role: µs}, cpu_us_per_wf_total: µs}; a role is a process name less its
        index (and less `omniflow-`): the replicas of one role add up."""
        by_role: dict[str, float] = {}
        for name, secs in cpu.items():
            role = re.sub(r"-\d+$", "", name.removeprefix("omniflow-"))
            by_role[role] = by_role.get(role, 0.0) + secs
        return {"cpu_us_per_wf": {role: round(1e6 * secs / n) for role, secs in sorted(by_role.items())},
                "cpu_us_per_wf_total": round(1e6 * sum(by_role.values()) / n)}


def redis_client(url: str):
    import redis

    return redis.Redis.from_url(url)


def wait_ready(r, expected: int, procs: Sequence[subprocess.Popen] = (), timeout_s: float = 60.0) -> float:
    """Wait until `expected` workers INCRed bench:ready. Returns seconds waited."""
    t0 = time.monotonic()
    while True:
        n = int(r.get(READY_KEY) or 0)
        if n >= expected:
            return time.monotonic() - t0
        check_alive(procs)
        if time.monotonic() - t0 > timeout_s:
            raise BenchError(f"only {n}/{expected} workers ready after {timeout_s:.0f}s")
        time.sleep(0.05)


class DoneReader:
    """Reads completion records (wf, submit ts, done ts) from the bench:done stream."""

    def __init__(self, r, procs: Sequence[subprocess.Popen] = ()) -> None:
        self.r = r
        self.procs = procs
        self.last_id: bytes | str = "0-0"

    def wait(self, k: int, timeout_s: float) -> list[tuple[str, float, float]]:
        got: list[tuple[str, float, float]] = []
        deadline = time.monotonic() + timeout_s
        last_check = 0.0
        while len(got) < k:
            now = time.monotonic()
            if now > deadline:
                raise BenchError(f"timeout after {timeout_s:.0f}s: {len(got)}/{k} workflows completed")
            if now - last_check > 0.5:
                check_alive(self.procs)
                last_check = now
            resp = self.r.xread({DONE_STREAM: self.last_id}, count=1000, block=100)
            for _stream, entries in resp or ():
                for entry_id, f in entries:
                    self.last_id = entry_id
                    got.append((f[b"wf"].decode(), float(f[b"ts"]), float(f[b"td"])))
        return got


@dataclass
class ServerStats:
    """What one Valkey has done so far: calls and µs per command (INFO commandstats, commands run
    inside Lua scripts included), bytes it has read from clients (INFO stats) and its CPU (INFO cpu)."""

    calls: dict[str, int]
    usec: dict[str, int]
    net_input_bytes: int
    cpu_s: float


def server_stats(r) -> ServerStats:
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for k, v in r.info("commandstats").items():
        if isinstance(v, dict):
            name = k.removeprefix("cmdstat_")
            calls[name], usec[name] = int(v.get("calls", 0)), int(v.get("usec", 0))
    stats, cpu = r.info("stats"), r.info("cpu")
    return ServerStats(calls, usec, int(stats["total_net_input_bytes"]),
                       float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]))


def cost_delta(before: ServerStats, after: ServerStats, n: int) -> dict[str, Any]:
    """The server's cost per workflow between two snapshots (the measurement's own INFO calls are left
    out of the commands; its completion reads and the systems' idle polling are in)."""
    n = max(n, 1)
    calls = {k: v - before.calls.get(k, 0) for k, v in after.calls.items() if k != "info"}
    calls = {k: v for k, v in calls.items() if v > 0}
    usec = {k: after.usec.get(k, 0) - before.usec.get(k, 0) for k in calls}
    top = sorted(calls.items(), key=lambda kv: -kv[1])
    return {
        "cmds_per_wf": round(sum(calls.values()) / n, 2),
        "cmds_top": {k: round(v / n, 2) for k, v in top[:8]},
        # every command: [calls per workflow, Valkey µs per workflow inside it]
        "cmds_breakdown": {k: [round(v / n, 3), round(usec[k] / n, 2)] for k, v in top},
        "bytes_in_per_wf": round((after.net_input_bytes - before.net_input_bytes) / n),
        "valkey_cpu_us_per_wf": round(1e6 * (after.cpu_s - before.cpu_s) / n, 1),
    }


def run_latency_loop(
    submit_one: Callable[[str, float], None], reader: DoneReader, n: int, timeout_s: float, prefix: str = "lat"
) -> list[tuple[str, float, float]]:
    """One workflow at a time: submit, wait for its completion, repeat."""
    records: list[tuple[str, float, float]] = []
    deadline = time.monotonic() + timeout_s
    for i in range(n):
        wf = f"{prefix}-{i}"
        submit_one(wf, time.time())
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BenchError(f"latency run timed out after {i}/{n} workflows")
        records.extend(reader.wait(1, remaining))
    return records


def submit_and_collect(r, reader: "DoneReader", submit: Callable[[str, float], None], n: int, *, warmup: int,
                       min_rate: float) -> tuple[list[tuple[str, float, float]], dict[str, Any], float]:
    """Warm up, then submit `n` workflows one client call each and collect their completions.

    Returns (records, the server's cost per workflow (`cost_delta`), seconds spent submitting)."""
    for i in range(warmup):
        submit(f"warm-{i}", time.time())
    reader.wait(warmup, 60)
    before = server_stats(r)
    t0 = time.monotonic()
    for i in range(n):
        submit(f"wf-{i}", time.time())
    submit_s = time.monotonic() - t0
    records = reader.wait(n, timeout_for(n, min_rate, floor_s=60))
    return records, cost_delta(before, server_stats(r), n), submit_s


def timeout_for(n: int, min_rate: float, floor_s: float = 30.0) -> float:
    """A bounded wait: n workflows at no less than min_rate per second, at least floor_s."""
    return max(floor_s, n / min_rate)


# --------------------------------------------------------------------------- tables


def _fmt(x: float, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def skipped_result(system: str, variant: str, procs: int, mode: str, reason: str) -> Result:
    """The row of a peer that could not run here: shown in the table with its reason, never measured."""
    nan = float("nan")
    return Result(system, variant, procs, 0, nan, nan, nan, extra={"skipped": reason}, mode=mode)


def measured(results: Iterable[Result]) -> list[Result]:
    return [r for r in results if not r.extra.get("skipped")]


def format_table(results: Sequence[Result], *, markdown: bool = True) -> str:
    headers = ["mode", "system", "variant", "procs", "n", "workflows/s", "p50 ms", "p99 ms", "cmds/wf",
               "bytes→Valkey/wf", "Valkey CPU µs/wf", "runs (wf/s)"]
    rows = []
    for r in results:
        runs = r.extra.get("workflows_per_s_runs")
        skipped = r.extra.get("skipped")
        cost = [r.extra.get(k) for k in ("cmds_per_wf", "bytes_in_per_wf", "valkey_cpu_us_per_wf")]
        rows.append([
            r.mode, r.system, r.variant + (f" — skipped: {skipped}" if skipped else ""), str(r.procs),
            str(r.n) if not skipped else "–", _fmt(r.workflows_per_s), _fmt(r.p50_ms), _fmt(r.p99_ms),
            *(_fmt(x) if isinstance(x, (int, float)) else "–" for x in cost),
            " / ".join(f"{x:,.0f}" for x in runs) if runs and len(runs) > 1 else "",
        ])
    if markdown:
        right = set(range(3, 11))
        lines = ["| " + " | ".join(headers) + " |",
                 "|" + "|".join("---:" if i in right else "---" for i in range(len(headers))) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(headers)]
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
