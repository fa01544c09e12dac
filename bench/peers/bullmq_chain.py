"""BullMQ (Node): three queues chained (thinker's processor adds the talker job, talker's the code2wav job).

What a user would run: `bench/peers/bullmq/chain.js` through BullMQ's public API only (`Queue.add`,
`Worker`, `QueueEvents`), BullMQ's defaults (job retention, locks, stalled checks, auto job ids) except
the Worker `concurrency`. One worker process holds the three Workers; more processes to scale. The
client is Node too (BullMQ has no Python producer in this benchmark): it adds the thinker jobs and
observes every chain's end with one `QueueEvents` on the code2wav queue, the way BullMQ's docs wait
for jobs. The version is pinned in `bench/peers/bullmq/package.json` (+ package-lock.json); `make
bench` runs `npm ci` there. Without node (or its packages) the rows are skipped with a note.

- burst: N chains added by 8 concurrent submitters (each awaits its `Queue.add`), completion from
  QueueEvents; wf/s = N / (last completion seen − first add).
- latency: one chain at a time, `Queue.add` -> its 'completed' event seen by the client.
"""
from __future__ import annotations

import json
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import (
    LOG_DIR, REPO_ROOT, BenchError, BenchSkip, ProcessCPU, Result, check_alive, cost_delta, log, redis_client,
    running, server_stats,
    summarize, timeout_for, wait_ready,
)

PKG_DIR = REPO_ROOT / "bench" / "peers" / "bullmq"
SCRIPT = PKG_DIR / "chain.js"
CLIENT_CONCURRENCY = 8


def node() -> str:
    """The node binary, or BenchSkip saying why the BullMQ rows cannot run here."""
    exe = shutil.which("node")
    if exe is None:
        raise BenchSkip("node not found (install Node.js >= 18, then `npm ci` in bench/peers/bullmq)")
    if not (PKG_DIR / "node_modules" / "bullmq" / "package.json").exists():
        raise BenchSkip("bench/peers/bullmq/node_modules missing (`npm ci` there; `make bench` does it)")
    return exe


def ensure_packages() -> None:
    """`npm ci` in bench/peers/bullmq when node is there and the packages are not (a note if it fails)."""
    npm = shutil.which("npm")
    if shutil.which("node") is None or npm is None or (PKG_DIR / "node_modules" / "bullmq").exists():
        return
    log("installing the BullMQ peer's npm packages (npm ci in bench/peers/bullmq) ...")
    proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=PKG_DIR, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        log(f"npm ci failed (the BullMQ rows will be skipped): {proc.stderr.strip()[-500:]}")


def version() -> str | None:
    path = PKG_DIR / "node_modules" / "bullmq" / "package.json"
    return json.loads(path.read_text())["version"] if path.exists() else None


def _worker_cmds(exe: str, url: str, procs: int, concurrency: int) -> list[tuple[str, list[str]]]:
    return [(f"bullmq-{i}", [exe, str(SCRIPT), "worker", "--url", url, "--concurrency", str(concurrency)])
            for i in range(procs)]


def _line(proc: subprocess.Popen, timeout_s: float, procs: list[subprocess.Popen]) -> dict[str, Any]:
    """The client's next JSON line on stdout (bounded; a dead client or worker is an error)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            return json.loads(line)
        if proc.poll() is not None:
            break
        check_alive(procs)
    tail = (LOG_DIR / "bullmq-client.log").read_text(errors="replace")[-1500:]
    raise BenchError(f"bullmq client gave no result (rc {proc.poll()}):\n{tail}")


def _measure(url: str, mode: str, n: int, procs: int, concurrency: int, warmup: int,
             min_rate: float) -> tuple[list[tuple[str, float, float]], dict[str, Any]]:
    exe = node()
    r = redis_client(url)
    with running(_worker_cmds(exe, url, procs, concurrency)) as ps:
        wait_ready(r, procs, ps)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        with open(LOG_DIR / "bullmq-client.log", "wb") as err:
            client = subprocess.Popen(
                [exe, str(SCRIPT), "client", "--url", url, "--mode", mode, "--n", str(n),
                 "--concurrency", str(CLIENT_CONCURRENCY), "--warmup", str(warmup)],
                cwd=PKG_DIR, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True)
        try:
            _line(client, 60, ps)                                   # {"event": "warm"}
            before = server_stats(r)
            meter = ProcessCPU(r, ps, {"node-client": client.pid})
            client.stdin.write("go\n")
            client.stdin.flush()
            done = _line(client, timeout_for(n, min_rate, floor_s=60), ps)
            cost = cost_delta(before, server_stats(r), n)
            cost.update(ProcessCPU.per_wf(meter.take(), n))
            client.stdin.close()
            client.wait(15)
        finally:
            if client.poll() is None:
                client.kill()
                client.wait()
    records = [(str(wf), float(ts), float(td)) for wf, ts, td in done["records"]]
    return records, cost


def run_burst(url: str, n: int, procs: int, concurrency: int, warmup: int = 100) -> Result:
    records, cost = _measure(url, "burst", n, procs, concurrency, warmup, min_rate=10)
    extra = {"topology": f"{procs} node worker process(es) x 3 Workers (concurrency {concurrency} each); "
                         f"node client, {CLIENT_CONCURRENCY} concurrent Queue.add, one QueueEvents",
             "submit_mode": f"c={CLIENT_CONCURRENCY}", "bullmq": version(), **cost}
    return summarize("bullmq", f"3 queues chained, concurrency {concurrency}", procs, records, extra=extra)


def run_latency(url: str, n: int, procs: int = 1, concurrency: int = 8) -> Result:
    records, cost = _measure(url, "latency", n, procs, concurrency, warmup=20, min_rate=5)
    return summarize("bullmq", f"3 queues chained, concurrency {concurrency}", procs, records, mode="latency",
                     extra={"topology": f"{procs} node worker process(es); add -> QueueEvents 'completed'",
                            "bullmq": version(), **cost})


if __name__ == "__main__":
    from bench.common import start_server

    with start_server() as server:
        print(json.dumps(run_burst(server.url, int(sys.argv[1]) if len(sys.argv) > 1 else 2000, 1, 8).to_dict()))
    with start_server() as server:
        print(json.dumps(run_latency(server.url, 100).to_dict()))
