"""Scaling out: omniflow on a local Valkey Cluster (3 primaries, 1 replica each) beside one server.

    .venv/bin/python bench/cluster.py [--n 600] [--only spread,wait,failover] [--json out.json]

Prints, for docs/operations.md:
- spread: how the commands of a throughput run fall on the primaries (INFO commandstats per
  node) and commands per workflow, on the cluster (16 cells) and on one server (1 cell);
- wait: the cost of `OMNIFLOW_WAIT_REPLICAS=1` (every transition confirmed by a replica) in
  workflows/s and p50 under load, on one server with a replica and on the cluster, and in latency
  one workflow at a time on the server;
- failover: what a failover loses. Under a steady submit rate, shard 0's replica is cut off from
  its primary for `--lag-s` (SIGSTOP, and its replication link killed), then the primary is
  SIGKILLed and the stale replica promoted (TAKEOVER): every write the primary acknowledged in
  between is gone. Counted with asynchronous replication and
  with WAIT 1: accepted workflows lost (no record), hung (not terminal), failed.

Everything runs on this machine; processes are real (`omniflow reconciler|worker`). The figures
are one run's, on a 2-core VM shared with other work: ratios within a run are what to read.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import BenchError, bench_env, check_alive, percentile, running  # noqa: E402
from bench.omniflow_bench import pipeline_yaml  # noqa: E402
from omniflow.ops.embedded import EmbeddedServer  # noqa: E402
from omniflow.ops.embedded_ha import EmbeddedCluster, wait_for  # noqa: E402
from omniflow.storage.keys import Keys  # noqa: E402
from omniflow.storage.topology import open_sync_client  # noqa: E402

STAGES = ("thinker", "talker", "code2wav")


class Engine:
    """A reconciler and one worker per stage (real processes) against `url`."""

    def __init__(self, url: str, *, wait_replicas: int = 0, procs: int = 1) -> None:
        import uuid

        import yaml

        self.url, self.prefix = url, f"c{uuid.uuid4().hex[:6]}"
        self.tmp = Path(tempfile.mkdtemp(prefix="omniflow-cluster-bench-"))
        self.yaml = self.tmp / "pipeline.yaml"
        self.yaml.write_text(yaml.safe_dump(pipeline_yaml(procs), sort_keys=False))
        self.env = bench_env(OMNIFLOW_REDIS_URL=url, OMNIFLOW_PREFIX=self.prefix, OMNIFLOW_PIPELINE=str(self.yaml),
                             OMNIFLOW_LOG_LEVEL="WARNING", OMNIFLOW_MAX_IN_FLIGHT="1000000",
                             OMNIFLOW_BLOCK_MS="1000", OMNIFLOW_READ_BATCH="256",
                             OMNIFLOW_WAIT_REPLICAS=str(wait_replicas), OMNIFLOW_WAIT_TIMEOUT_MS="1000",
                             OMNIFLOW_LEASE_TIMEOUT_S="3", OMNIFLOW_HEARTBEAT_INTERVAL_S="0.5")
        self.wait_replicas = wait_replicas
        exe = [sys.executable, "-m", "omniflow.cli"]
        self.commands = [("cl-reconciler", [*exe, "reconciler"])] + [
            (f"cl-{st}-{i}", [*exe, "worker", "--stage", st]) for st in STAGES for i in range(procs)]
        self.expected_workers = len(STAGES) * procs

    def settings(self) -> Any:
        from omniflow.config import Settings

        return Settings(redis_url=self.url, prefix=self.prefix, max_in_flight=1_000_000,
                        wait_replicas=self.wait_replicas, wait_timeout_ms=1000)

    def wait_ready(self, procs: list[Any], timeout_s: float = 90) -> None:
        r = open_sync_client(self.url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            check_alive(procs)
            if r.zcount(Keys(self.prefix).workers, int(time.time() * 1000), "+inf") >= self.expected_workers:
                r.close()
                return
            time.sleep(0.1)
        raise BenchError("workers did not come up")


def command_counts(nodes: list[tuple[str, int]]) -> dict[str, int]:
    """Commands executed so far on each (name, port) node, from INFO commandstats."""
    from redis import Redis

    out = {}
    for name, port in nodes:
        with Redis(port=port) as r:
            out[name] = sum(int(v["calls"]) for v in r.info("commandstats").values())
    return out


async def submit_and_finish(engine: Engine, n: int, *, concurrency: int = 256) -> dict[str, Any]:
    """Submit n workflows (group-committed), wait for all of them: wf/s, p50/p99 ms."""
    from omniflow.storage.batcher import Batcher
    from omniflow.models import SubmitRequest, WorkflowInput
    from omniflow.pipeline import load_pipeline
    from omniflow.client.store import Store, connect

    redis = connect(engine.url)
    store = Store(redis, engine.settings(), load_pipeline(engine.yaml), batcher=Batcher(redis))
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> str:
        async with sem:
            return (await store.submit(SubmitRequest(input=WorkflowInput(text=f"p{i}")))).id

    try:
        t0 = time.monotonic()
        ids = list(await asyncio.gather(*(one(i) for i in range(n))))
        keys = store.keys
        while sum([await redis.zcard(keys.inflight(c)) for c in keys.all_cells]):
            await asyncio.sleep(0.02)
        wall = time.monotonic() - t0
        pipe = redis.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hmget(keys.wf(wf_id), "created_ms", "finished_ms", "state")
        rows = await pipe.execute()
    finally:
        await redis.aclose()
    states = [s.decode() if s else None for _, _, s in rows]
    if states.count("completed") != n:
        raise BenchError(f"not every workflow completed: {states.count('completed')}/{n}")
    lat = [int(f) - int(c) for c, f, _ in rows]
    return {"n": n, "wf_s": round(n / wall, 1), "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99)}


async def one_at_a_time(engine: Engine, n: int) -> dict[str, Any]:
    """Latency with nothing else going on: submit, wait for the terminal, next (p50/p99 ms)."""
    from omniflow.models import SubmitRequest, WorkflowInput
    from omniflow.pipeline import load_pipeline
    from omniflow.client.store import Store, connect

    redis = connect(engine.url)
    store = Store(redis, engine.settings(), load_pipeline(engine.yaml))
    lat = []
    try:
        for i in range(n):
            t = time.perf_counter()
            sub = await store.submit(SubmitRequest(input=WorkflowInput(text=f"l{i}")))
            doc = await store.wait(sub.id, timeout_s=30)
            if doc["state"] != "completed":
                raise BenchError(f"workflow {sub.id} ended {doc['state']}")
            lat.append((time.perf_counter() - t) * 1000)
    finally:
        await redis.aclose()
    return {"n": n, "p50_ms": round(percentile(lat[5:], 50), 2), "p99_ms": round(percentile(lat[5:], 99), 2)}


def latency_run(url: str, n: int, *, wait_replicas: int = 0) -> dict[str, Any]:
    engine = Engine(url, wait_replicas=wait_replicas)
    with running(engine.commands, env=engine.env) as procs:
        engine.wait_ready(procs)
        result = asyncio.run(one_at_a_time(engine, n))
    shutil.rmtree(engine.tmp, ignore_errors=True)
    return result


def spread_run(url: str, nodes: list[tuple[str, int]], n: int, *, wait_replicas: int = 0) -> dict[str, Any]:
    engine = Engine(url, wait_replicas=wait_replicas)
    with running(engine.commands, env=engine.env) as procs:
        engine.wait_ready(procs)
        before = command_counts(nodes)
        result = asyncio.run(submit_and_finish(engine, n))
        after = command_counts(nodes)
    shutil.rmtree(engine.tmp, ignore_errors=True)
    per_node = {name: after[name] - before[name] for name, _ in nodes}
    total = sum(per_node.values())
    result.update(cmds_per_wf=round(total / n, 1),
                  share={name: round(v / total, 3) for name, v in per_node.items()},
                  max_share=round(max(per_node.values()) / total, 3))
    return result


# ---------------------------------------------------------------- failover loss
async def failover_run(cluster: EmbeddedCluster, *, wait_replicas: int, rate: float, before_s: float,
                       lag_s: float, after_s: float) -> dict[str, Any]:
    from omniflow.errors import OmniflowError
    from omniflow.models import SubmitRequest, WorkflowInput
    from omniflow.pipeline import load_pipeline
    from omniflow.client.store import Store, connect

    engine = Engine(cluster.url, wait_replicas=wait_replicas)
    accepted: list[str] = []
    refused = 0
    with running(engine.commands, env=engine.env) as procs:
        engine.wait_ready(procs)
        redis = connect(engine.url)
        store = Store(redis, engine.settings(), load_pipeline(engine.yaml))
        primary = cluster.primary_nodes()[0]
        replica = cluster.replicas_of(primary)[0]
        assert replica.server.process is not None

        async def submitter(until: float) -> None:
            nonlocal refused
            i = 0
            while time.monotonic() < until:
                t = time.monotonic()
                try:
                    sub = await asyncio.wait_for(store.submit(SubmitRequest(input=WorkflowInput(text=f"f{i}"))), 5)
                    accepted.append(sub.id)
                except (OmniflowError, TimeoutError, OSError):
                    refused += 1
                i += 1
                await asyncio.sleep(max(0.0, 1 / rate - (time.monotonic() - t)))

        total_s = before_s + lag_s + after_s
        task = asyncio.create_task(submitter(time.monotonic() + total_s))
        await asyncio.sleep(before_s)
        # a partition between shard 0's primary and its replica: the replica stops, its link is cut
        # (what the primary had sent before still reaches it), the primary goes on acknowledging
        os.kill(replica.server.process.pid, signal.SIGSTOP)
        with primary.client() as c:
            c.execute_command("CLIENT", "KILL", "TYPE", "replica")
        await asyncio.sleep(lag_s)
        primary.server.kill()                                       # and its primary dies
        os.kill(replica.server.process.pid, signal.SIGCONT)
        with replica.client() as c:
            c.execute_command("CLUSTER FAILOVER", "TAKEOVER")      # the stale replica takes over
        await asyncio.to_thread(cluster._wait_agreed, replica, 30)
        await asyncio.to_thread(cluster.restart, primary)           # back as a replica (its newer writes go)
        await task
        # quiescence: every accepted workflow terminal, or 90 s
        keys = store.keys
        deadline = time.monotonic() + 90
        states: list[Any] = []
        while time.monotonic() < deadline:
            pipe = redis.pipeline(transaction=False)
            for wf_id in accepted:
                pipe.hget(keys.wf(wf_id), "state")
            states = [s.decode() if s else None for s in await pipe.execute()]
            if all(s in (None, "completed", "failed", "aborted") for s in states):
                break
            await asyncio.sleep(0.5)
        await redis.aclose()
    shutil.rmtree(engine.tmp, ignore_errors=True)
    return {"wait_replicas": wait_replicas, "accepted": len(accepted), "refused": refused,
            "lost": states.count(None), "hung": sum(s in ("pending", "running") for s in states),
            "failed": states.count("failed"), "completed": states.count("completed")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--only", default="spread,wait,failover")
    ap.add_argument("--lag-s", type=float, default=2.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    only = set(args.only.split(","))
    out: dict[str, Any] = {}
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-cluster-bench-"))
    try:
        if only & {"spread", "wait"}:
            single = EmbeddedServer(data_dir=tmp / "single", extra_args=["--repl-diskless-sync-delay", "0"]).start()
            replica = EmbeddedServer(data_dir=tmp / "single-r",
                                     extra_args=["--replicaof", "127.0.0.1", str(single.port)]).start()
            try:
                from redis import Redis

                with Redis(port=replica.port) as r:
                    wait_for(lambda: r.info("replication")["master_link_status"] == "up", timeout_s=10, what="sync")
                out["single"] = spread_run(single.url, [("primary", single.port)], args.n)
                print("single server:", json.dumps(out["single"]), flush=True)
                if "wait" in only:
                    out["single_wait1"] = spread_run(single.url, [("primary", single.port)], args.n, wait_replicas=1)
                    print("single server, WAIT 1:", json.dumps(out["single_wait1"]), flush=True)
                    for w in (0, 1):
                        out[f"single_latency_wait{w}"] = latency_run(single.url, 60, wait_replicas=w)
                        print(f"single server, one at a time, WAIT {w}:", json.dumps(out[f"single_latency_wait{w}"]),
                              flush=True)
            finally:
                replica.stop()
                single.stop()
            with EmbeddedCluster(tmp / "cluster") as cluster:
                nodes = [(f"primary-{i}", n.port) for i, n in enumerate(cluster.primary_nodes())]
                out["cluster"] = spread_run(cluster.url, nodes, args.n)
                print("cluster (16 cells):", json.dumps(out["cluster"]), flush=True)
                if "wait" in only:
                    out["cluster_wait1"] = spread_run(cluster.url, nodes, args.n, wait_replicas=1)
                    print("cluster, WAIT 1:", json.dumps(out["cluster_wait1"]), flush=True)
        if "failover" in only:
            for wait_replicas in (0, 1):
                with EmbeddedCluster(tmp / f"failover-{wait_replicas}") as cluster:
                    res = asyncio.run(failover_run(cluster, wait_replicas=wait_replicas, rate=40.0, before_s=2.0,
                                                   lag_s=args.lag_s, after_s=3.0))
                out[f"failover_wait{wait_replicas}"] = res
                print(f"failover, replica {args.lag_s:g} s behind, WAIT {wait_replicas}:", json.dumps(res), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
