"""Finding out what a Redis URL points at, and the client for it (real servers)."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from omniflow.ops.embedded_ha import EmbeddedCluster, EmbeddedSentinelGroup
from omniflow.errors import ConfigError
from omniflow.storage.topology import ServerKind, is_cluster, open_client, parse_sentinel_url, server_kind


def test_parse_sentinel_urls() -> None:
    spec = parse_sentinel_url("redis+sentinel://u:p%40ss@s1:26380,s2,[::1]:5/svc/3")
    assert spec.sentinels == (("s1", 26380), ("s2", 26379), ("::1", 5))
    assert (spec.service, spec.db, spec.username, spec.password, spec.ssl) == ("svc", 3, "u", "p@ss", False)
    assert parse_sentinel_url("rediss+sentinel://h/svc").ssl
    for bad in ("redis+sentinel://h:1", "redis+sentinel://h:x/svc", "redis+sentinel://h/svc/x", "redis://h/0"):
        with pytest.raises(ConfigError):
            parse_sentinel_url(bad)


async def test_cluster_detected_from_any_node(valkey_cluster: EmbeddedCluster) -> None:
    for node in (valkey_cluster.primary_nodes()[1], valkey_cluster.replicas_of(valkey_cluster.primary_nodes()[0])[0]):
        url = f"redis://127.0.0.1:{node.port}/0"
        assert server_kind(url) is ServerKind.CLUSTER
        client = open_client(url)
        try:
            assert is_cluster(client)
            # scripts reach every primary; a pipeline of script calls spreads over them
            sha = await client.script_load("return redis.call('INCR', KEYS[1])")
            pipe = client.pipeline(transaction=False)
            for i in range(30):
                pipe.execute_command("EVALSHA", sha, 1, f"topo:{{{i}}}")
            assert await pipe.execute() == [1] * 30
            # a blocking group read is routed by its stream keys (no server round trip to find them)
            await client.xgroup_create("topo:{s}:a", "g", id="0", mkstream=True)
            await client.xgroup_create("topo:{s}:b", "g", id="0", mkstream=True)
            await client.xadd("topo:{s}:b", {"x": 1})
            reply = await client.xreadgroup("g", "c", {"topo:{s}:a": ">", "topo:{s}:b": ">"}, count=5, block=50)
            assert [k for k, _ in reply] == [b"topo:{s}:b"]
            with pytest.raises(ConfigError, match="several slots"):
                await client.xread({"topo:{s}:a": "0", "topo:{t}:a": "0"}, block=10)
            await client.delete("topo:{s}:a", "topo:{s}:b", *(f"topo:{{{i}}}" for i in range(30)))
        finally:
            await client.aclose()


@pytest.mark.slow
async def test_sentinel_client_follows_a_failover(sentinel_factory: Callable[..., EmbeddedSentinelGroup]) -> None:
    import asyncio

    group = sentinel_factory()
    client = open_client(group.url)
    try:
        assert not is_cluster(client)
        await client.set("k", "before")
        assert await client.execute_command("WAIT", 1, 5000) == 1
        await asyncio.to_thread(group.kill_primary)
        for _ in range(100):        # the first calls may still find the old primary gone
            try:
                await client.set("k2", "after")
                break
            except Exception:  # noqa: BLE001 - ConnectionError until the pool finds the new primary
                await asyncio.sleep(0.1)
        assert await client.get("k") == b"before" and await client.get("k2") == b"after"
    finally:
        await client.aclose()
