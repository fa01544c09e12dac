"""The cluster and sentinel fixtures themselves: formed as specified, fail over as asked, and
leave no process behind."""
from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import pytest
from redis import Redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from omniflow.ops.embedded_ha import CLUSTER_SLOTS, EmbeddedCluster, EmbeddedSentinelGroup, slot_ranges


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too: our fixtures reap their children, so this means a leak
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"


def test_slot_ranges_cover_every_slot_once() -> None:
    for n in (1, 3, 5, 7):
        ranges = slot_ranges(n)
        assert ranges[0][0] == 0 and ranges[-1][1] == CLUSTER_SLOTS - 1
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(ranges))
        assert max(r[1] - r[0] for r in ranges) - min(r[1] - r[0] for r in ranges) <= 1


def test_cluster_three_primaries_one_replica_each(valkey_cluster: EmbeddedCluster) -> None:
    primaries = valkey_cluster.primary_nodes()
    assert len(primaries) == 3
    assert all(len(valkey_cluster.replicas_of(p)) == 1 for p in primaries)
    # a cluster client entering through a replica finds every shard; keys spread over all three
    replica = valkey_cluster.replicas_of(primaries[0])[0]
    client = RedisCluster(host="127.0.0.1", port=replica.port)
    try:
        for i in range(60):
            client.set(f"fixture:{{t{i}}}", i)
        assert [int(client.get(f"fixture:{{t{i}}}")) for i in range(60)] == list(range(60))
        for primary in primaries:
            with primary.client() as direct:
                assert direct.dbsize() > 0
        client.delete(*(f"fixture:{{t{i}}}" for i in range(60)))
    finally:
        client.close()


@pytest.mark.slow
def test_cluster_failovers_and_cleanup(cluster_factory: Callable[..., EmbeddedCluster]) -> None:
    cluster = cluster_factory()
    client = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    pids = [n.server.process.pid for n in cluster.nodes if n.server.process]
    try:
        # keys of shard 0, replicated before the kill (WAIT), are on the promoted replica
        shard0 = cluster.primary_nodes()[0]
        keys = [k for k in (f"k:{{{i}}}" for i in range(200))
                if shard0.port == client.get_node_from_key(k).port][:10]
        for key in keys:
            client.set(key, "v")
        with shard0.client() as direct:
            assert direct.execute_command("WAIT", 1, 5000) == 1
        killed, promoted = cluster.kill_primary(0)                  # automatic failure detection
        assert promoted in cluster.primary_nodes() and killed not in cluster.primary_nodes()
        with promoted.client() as direct:
            assert [direct.get(k) for k in keys] == [b"v"] * len(keys)
        client.set(keys[0], "after")                                 # the client follows the move
        assert client.get(keys[0]) == b"after"
        cluster.restart(killed)
        assert killed in cluster.replicas_of(promoted)               # the old primary rejoined as a replica

        killed, promoted = cluster.kill_primary(1, takeover=True)   # forced, without waiting for detection
        assert killed not in cluster.primary_nodes()
        cluster.restart(killed)
        new = cluster.failover(2)                                    # graceful manual failover
        assert new in cluster.primary_nodes()
        cluster.wait_healthy()
        assert len(cluster.primary_nodes()) == 3
    finally:
        client.close()
        cluster.stop()
    assert not [pid for pid in pids if _pid_alive(pid)]


@pytest.mark.slow
def test_sentinel_failover_and_cleanup(sentinel_factory: Callable[..., EmbeddedSentinelGroup]) -> None:
    group = sentinel_factory()
    pids = [srv.process.pid for srv in (*group.servers, *group.sentinel_servers) if srv.process]
    host, port = group.url.removeprefix("redis+sentinel://").split("/")[0].split(":")
    sentinel = Sentinel([(host, int(port))], socket_timeout=2)
    try:
        primary = sentinel.master_for(group.master_name, socket_timeout=2)
        primary.set("k", "v")
        assert primary.execute_command("WAIT", 1, 5000) == 1
        killed, promoted = group.kill_primary()
        assert group.primary() is promoted and promoted is not killed
        with Redis(host=promoted.host, port=promoted.port) as direct:
            assert direct.get("k") == b"v"
        primary.set("k", "after")                                    # the sentinel client follows
        assert primary.get("k") == b"after"
        group.restart(killed)
        with Redis(host=killed.host, port=killed.port) as direct:
            assert direct.info("replication")["role"] == "slave"
        primary.close()
    finally:
        group.stop()
    assert not [pid for pid in pids if _pid_alive(pid)]
