"""Soak (issue 20 §5): workflows on a 3-primary Valkey Cluster with a replica each, while a primary
is SIGKILLed (its replica promoted, the old primary back as a replica) and workers are SIGKILLed
every few seconds: every accepted workflow completes once, with exactly the fault-free outputs
(0 lost, 0 duplicate outputs), and nothing is left behind.

The default run is small (`make test`); `OMNIFLOW_SOAK=1` (`make soak`) runs 10,000 workflows
(`OMNIFLOW_SOAK_WORKFLOWS`, `OMNIFLOW_SOAK_RATE` workflows/s to change them). Every transition is
confirmed by a replica (`OMNIFLOW_WAIT_REPLICAS=1`): what asynchronous replication loses at a
failover is measured by bench/cluster.py (docs/operations.md)."""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from omniflow.ops.embedded_ha import EmbeddedCluster
from tests.chaos.driver import ChaosConfig, ChaosRun, Cluster
from tests.chaos.test_chaos import _assert_clean, _report

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

SOAK = os.environ.get("OMNIFLOW_SOAK", "").lower() in {"1", "true", "yes"}
WORKFLOWS = int(os.environ.get("OMNIFLOW_SOAK_WORKFLOWS", "10000")) if SOAK else 60
RATE = float(os.environ.get("OMNIFLOW_SOAK_RATE", "50")) if SOAK else 6.0


def soak_config() -> ChaosConfig:
    return ChaosConfig(workflows=WORKFLOWS, submit_rate=RATE, max_words=8 if SOAK else 16,
                       token_delay_s=0.01 if SOAK else 0.03, replicas=2, max_sessions=64,
                       min_worker_kills=20 if SOAK else 3, kill_every_s=4.0 if SOAK else 2.0,
                       quiesce_timeout_s=max(180.0, WORKFLOWS / 20))


@pytest.mark.timeout(int(WORKFLOWS / RATE * 4) + 600)
async def test_soak_cluster_failover_and_worker_kills_lose_and_duplicate_nothing(
        cluster_factory: Callable[..., EmbeddedCluster], tmp_path: Path) -> None:
    valkeys = cluster_factory(appendfsync="always")
    cfg = soak_config()
    procs = Cluster(tmp_path, valkeys.url, f"s{uuid.uuid4().hex[:8]}", cfg)
    procs.env.update(OMNIFLOW_WAIT_REPLICAS="1", OMNIFLOW_WAIT_TIMEOUT_MS="2000")
    procs.settings = procs.settings.model_copy(update={"wait_replicas": 1, "wait_timeout_ms": 2000})
    procs.start(reconcilers=2)
    killed_ports: list[int] = []
    try:
        run = ChaosRun(procs, valkeys.url, scenario="cluster-soak")

        async def fail_over_a_primary() -> None:
            await run.accepted_at_least(cfg.workflows // 3, timeout_s=cfg.workflows / cfg.submit_rate * 3 + 60)
            fault = run._fault("kill-redis", None)
            killed, _promoted = await asyncio.to_thread(valkeys.kill_primary, 0)
            killed_ports.append(killed.port)
            fault.until_ms = int(time.time() * 1000)
            await asyncio.to_thread(valkeys.restart, killed)      # back, as a replica of the promoted node

        async def faults() -> None:
            await asyncio.gather(run.chaos_processes(kill_reconciler=True, kill_api=False, sigstop=False),
                                 fail_over_a_primary())

        rep = await run.run(faults())
    finally:
        procs.stop()
    _report(rep, tmp_path)
    assert killed_ports and killed_ports[0] not in [n.port for n in valkeys.primary_nodes()]
    assert rep.faults["kill-worker"] >= cfg.min_worker_kills and rep.faults["kill-redis"] == 1
    assert rep.accepted >= cfg.workflows // 2, f"only {rep.accepted} of {cfg.workflows} accepted"  # refused while it fails over
    assert not rep.crashed, rep.crashed
    _assert_clean(rep)
