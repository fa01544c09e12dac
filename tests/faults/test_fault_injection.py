"""When Redis says no (issue 9): under a steady load of workflows, the server refuses in every way it
can (out of memory, read-only, busy, paused, every connection killed, scripts flushed) and poison
is written into every stream the engine reads; each fault injected, then cleared. Nothing is lost,
nothing hangs, no process dies (`faultkit.py` says how each fault is made and what is checked).

Real processes (`omniflow worker|reconciler|jobs`), a private Valkey, and a spare Valkey for the
read-only fault. `OMNIFLOW_FAULTS_REPORT_DIR` keeps the table (docs/reliability.md has one)."""
from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from faultkit import FAULTS, FaultRun
from omniflow.ops.embedded import EmbeddedServer
from tests.chaos.driver import ChaosConfig, Cluster

pytestmark = [pytest.mark.slow]

REPORT_DIR = os.environ.get("OMNIFLOW_FAULTS_REPORT_DIR")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedServer, EmbeddedServer]]:
    main = EmbeddedServer(data_dir=tmp_path_factory.mktemp("faults-valkey"), appendonly=True,
                          appendfsync="everysec").start()
    spare = EmbeddedServer(data_dir=tmp_path_factory.mktemp("faults-spare"), appendonly=False).start()
    yield main, spare
    spare.stop()
    main.stop()


@pytest.mark.timeout(420)
async def test_faults_lose_nothing_hang_nothing_and_kill_no_process(servers, tmp_path: Path) -> None:
    server, spare = servers
    # about a second per workflow: every fault finds several in flight
    cfg = ChaosConfig(replicas=1, max_sessions=32, max_words=8, token_delay_s=0.1, chunk_delay_s=0.02,
                      max_attempts=5)
    cluster = Cluster(tmp_path, server.url, f"f{uuid.uuid4().hex[:8]}", cfg)
    cluster.start(reconcilers=1)
    cluster.spawn("jobs")
    try:
        from tests.chaos.driver import ChaosRun

        await ChaosRun(cluster, server.url).wait_ready()
        run = FaultRun(cluster, server, spare, submit_rate=6.0, hold_s=2.0, gap_s=2.0)
        rep = await run.run(FAULTS)
    finally:
        cluster.stop()
    print()
    print(rep.table())
    print(f"accepted {rep.accepted}, completed {rep.completed}, refused {dict(rep.refused)}, "
          f"wall {rep.duration_s:.0f}s")
    for line in rep.problems[:20]:
        print(line)
    if REPORT_DIR:
        Path(REPORT_DIR).mkdir(parents=True, exist_ok=True)
        (Path(REPORT_DIR) / "faults.json").write_text(json.dumps(asdict(rep), indent=2, default=str))
        (Path(REPORT_DIR) / "faults.md").write_text(rep.table() + "\n")
    assert [w.fault for w in rep.windows] == list(FAULTS)
    assert not rep.crashed, rep.crashed
    assert rep.accepted > 0
    assert rep.not_terminal == 0, rep.problems[:10]
    assert rep.missing == 0 and rep.duplicated == 0, rep.problems[:10]
    assert rep.completed == rep.accepted, rep.problems[:10]
    assert all(len(reasons) >= 1 for reasons in rep.dead_letters.values()), rep.dead_letters
    assert not rep.leftovers, rep.leftovers
    assert not rep.grown, rep.grown
    assert not rep.problems, rep.problems[:10]
