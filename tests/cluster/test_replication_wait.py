"""`OMNIFLOW_WAIT_REPLICAS`: a round trip that changes state is confirmed by the replicas before it
is acknowledged, or it counts as lost (real primary and replica)."""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from omniflow.storage import redisio
from omniflow.ops.embedded import EmbeddedServer
from omniflow.ops.embedded_ha import wait_for
from omniflow.errors import RedisUnavailable
from omniflow.storage.scripts import script_args


@pytest.fixture
def primary_and_replica(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, EmbeddedServer]]:
    primary = EmbeddedServer(data_dir=tmp_path / "p", extra_args=["--repl-diskless-sync-delay", "0"]).start()
    replica = EmbeddedServer(data_dir=tmp_path / "r", extra_args=["--replicaof", "127.0.0.1", str(primary.port)]).start()
    try:
        from redis import Redis

        with Redis(port=replica.port) as r:
            wait_for(lambda: r.info("replication")["master_link_status"] == "up", timeout_s=10, what="sync")
        yield primary, replica
    finally:
        if replica.process is not None:
            os.kill(replica.process.pid, signal.SIGCONT)
        replica.stop()
        primary.stop()


async def test_writes_wait_for_the_replica_and_fail_without_it(primary_and_replica) -> None:
    primary, replica = primary_and_replica
    client = redisio.connect(primary.url)
    redisio.require_replicas(client, 1, 300)
    try:
        assert await redisio.execute(client, [("SET", "k", "v"), ("GET", "k")]) == [True, b"v"]
        replica_client = redisio.connect(replica.url)
        assert await replica_client.get("k") == b"v"        # there when the write was acknowledged
        await replica_client.aclose()
        waits = (await client.info("commandstats"))["cmdstat_wait"]["calls"]
        assert await redisio.execute(client, [("GET", "k")]) == [b"v"]          # reads never wait
        assert (await client.info("commandstats"))["cmdstat_wait"]["calls"] == waits
        os.kill(replica.process.pid, signal.SIGSTOP)        # the replica stops acknowledging
        results = await redisio.execute(client, [("SET", "k", "w")])
        assert isinstance(results[0], RedisUnavailable) and "not confirmed by 1 replica" in str(results[0])
        # a lease renewal never waits: a replica away must not make every worker lose its lease
        await redisio.load_scripts(client)
        beat = script_args("heartbeat", ["t:{workers}", "t:{workers}:w1"], ["w1", 1, 60, "stage", "x"])
        (renewed,) = await redisio.execute(client, [beat])
        assert not isinstance(renewed, Exception), renewed        # (its reply: the drain flag, none here)
    finally:
        os.kill(replica.process.pid, signal.SIGCONT)
        await client.aclose()
