"""Local Valkey Cluster and Sentinel groups from the embedded `valkey-server` binary.

Used by the test session (contract and chaos tests on a real cluster, failover
tests) and by the benchmarks; no `valkey-cli` is needed: the cluster is formed
with plain commands (`CLUSTER SET-CONFIG-EPOCH`, `ADDSLOTSRANGE`, `MEET`,
`REPLICATE`), as `valkey-cli --cluster create` does.

- `EmbeddedCluster`: N primaries with R replicas each, slots split evenly; kill
  a primary and wait for its replica to be promoted (automatic failover, or a
  forced `CLUSTER FAILOVER TAKEOVER`), graceful `CLUSTER FAILOVER`, restart a
  killed node (it rejoins as a replica).
- `EmbeddedSentinelGroup`: one primary, its replicas and S sentinels watching
  it; kill the primary and wait for a sentinel failover.

Every process is a child in its own process group; `stop()` ends all of them
(idempotent), and both classes are context managers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, cast

from redis import Redis

from omniflow.storage.cells import CLUSTER_SLOTS
from omniflow.ops.embedded import DEFAULT_START_TIMEOUT_S, EmbeddedServer, free_port, valkey_binary
from omniflow.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_NODE_TIMEOUT_MS = 2_000
DEFAULT_FORM_TIMEOUT_S = 30.0
DEFAULT_FAILOVER_TIMEOUT_S = 30.0
DEFAULT_SENTINEL_DOWN_AFTER_MS = 1_000
DEFAULT_MASTER_NAME = "omniflow"
POLL_S = 0.05
# a replica's first sync starts at once (the server default waits 5 s for more replicas to join)
FAST_SYNC_ARGS = ["--repl-diskless-sync-delay", "0"]


def wait_for(check: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
    """Poll `check` until it returns a truthy value; ConfigError naming `what` on timeout."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception as exc:  # noqa: BLE001 - a node still starting answers with errors
            last_error, value = exc, None
        if value:
            return value
        time.sleep(POLL_S)
    raise ConfigError(f"timed out after {timeout_s:g}s waiting for {what}"
                      + (f" (last error: {last_error})" if last_error else ""))


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """16384 slots split into `primaries` contiguous ranges, as `--cluster create` does."""
    per = CLUSTER_SLOTS / primaries
    bounds = [round(per * i) for i in range(primaries + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(primaries)]


def _info(client: Redis, section: str) -> dict[str, Any]:
    reply = cast("dict[str, Any]", client.info(section))
    return reply


@dataclass
class ClusterNode:
    """One `valkey-server` of the cluster (its role changes at a failover)."""

    server: EmbeddedServer
    bus_port: int
    node_id: str = ""

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def alive(self) -> bool:
        return self.server.process is not None and self.server.process.poll() is None

    def client(self) -> Redis:
        return Redis(host=self.server.host, port=self.server.port, socket_timeout=5)

    def nodes(self) -> list[dict[str, Any]]:
        """This node's view of the cluster (`CLUSTER NODES`, parsed)."""
        with self.client() as client:
            raw = client.execute_command("CLUSTER", "NODES")  # raw text, not redis-py's parse
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        view = []
        for line in text.strip().splitlines():
            parts = line.split()
            view.append({"id": parts[0], "port": int(parts[1].split("@")[0].rsplit(":", 1)[1]),
                         "flags": set(parts[2].split(",")), "primary": parts[3], "link": parts[7],
                         "slots": parts[8:]})
        return view


@dataclass
class EmbeddedCluster:
    """A local Valkey Cluster: `primaries` shards with `replicas` replicas each."""

    data_dir: Path
    primaries: int = 3
    replicas: int = 1
    host: str = "127.0.0.1"
    node_timeout_ms: int = DEFAULT_NODE_TIMEOUT_MS
    appendfsync: str = "everysec"
    binary: str | None = None
    nodes: list[ClusterNode] = field(default_factory=list)

    # ------------------------------------------------------------ lifecycle
    def start(self, *, timeout_s: float = DEFAULT_FORM_TIMEOUT_S) -> Self:
        if self.primaries < 1 or self.replicas < 0:
            raise ConfigError("a cluster needs at least one primary")
        try:
            for i in range(self.primaries * (1 + self.replicas)):
                bus_port = free_port(self.host)
                self.nodes.append(ClusterNode(self._server(i, bus_port).start(), bus_port))
            self._form(timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("embedded cluster up: %s", self.url)
        return self

    def _server(self, index: int, bus_port: int) -> EmbeddedServer:
        # explicit bus ports: the default (port + 10000) overflows for ephemeral ports
        return EmbeddedServer(
            data_dir=self.data_dir / f"node-{index}", host=self.host, appendonly=True,
            appendfsync=self.appendfsync, binary=self.binary,
            extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                        "--cluster-port", str(bus_port),
                        "--cluster-node-timeout", str(self.node_timeout_ms),
                        # a replica may always take over, however long it was cut off (tests kill nodes)
                        "--cluster-replica-validity-factor", "0",
                        # the shards that are up keep serving while one fails over
                        "--cluster-require-full-coverage", "no", *FAST_SYNC_ARGS],
        )

    def _form(self, timeout_s: float) -> None:
        for epoch, node in enumerate(self.nodes, start=1):
            with node.client() as client:
                node.node_id = client.execute_command("CLUSTER", "MYID").decode()
                client.execute_command("CLUSTER SET-CONFIG-EPOCH", epoch)
        for node, (first, last) in zip(self.nodes, slot_ranges(self.primaries)):
            with node.client() as client:
                client.execute_command("CLUSTER ADDSLOTSRANGE", first, last)
        with self.nodes[0].client() as client:
            for node in self.nodes[1:]:
                client.execute_command("CLUSTER MEET", self.host, node.port, node.bus_port)
        wait_for(lambda: all(len(n.nodes()) == len(self.nodes) for n in self.nodes),
                 timeout_s=timeout_s, what="every cluster node to know every other")
        for index, node in enumerate(self.nodes[self.primaries:]):
            primary = self.nodes[index % self.primaries]
            with node.client() as client:
                client.execute_command("CLUSTER REPLICATE", primary.node_id)
        self.wait_healthy(timeout_s=timeout_s)

    def stop(self) -> None:
        """Stop every node (idempotent)."""
        for node in self.nodes:
            node.server.stop()

    def __enter__(self) -> Self:
        return self.start() if not self.nodes else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ views
    @property
    def url(self) -> str:
        """A URL of one live node: any node serves as the entry point of a cluster client."""
        node = next(n for n in self.nodes if n.alive)
        return f"redis://{self.host}:{node.port}/0"

    def _view(self) -> list[dict[str, Any]]:
        return next(n for n in self.nodes if n.alive).nodes()

    def primary_nodes(self) -> list[ClusterNode]:
        """The live nodes that are primaries now, in slot order."""
        view = [e for e in self._view() if "master" in e["flags"] and "fail" not in e["flags"] and e["slots"]]
        view.sort(key=lambda e: int(e["slots"][0].split("-")[0]))
        by_id = {n.node_id: n for n in self.nodes}
        return [by_id[e["id"]] for e in view if by_id[e["id"]].alive]

    def replicas_of(self, primary: ClusterNode) -> list[ClusterNode]:
        by_id = {n.node_id: n for n in self.nodes}
        return [by_id[e["id"]] for e in primary.nodes()
                if e["primary"] == primary.node_id and by_id[e["id"]].alive]

    def wait_healthy(self, *, timeout_s: float = DEFAULT_FORM_TIMEOUT_S) -> None:
        """Every live node says `cluster_state:ok`, covers all slots, every live replica is in sync,
        and every live node's `CLUSTER NODES` agrees on every live node's role (`_agreed`): a node
        learns of a change by gossip, so the node a question goes to may lag the one that changed."""
        def healthy() -> bool:
            for node in self.nodes:
                if not node.alive:
                    continue
                with node.client() as client:
                    info = _info(client, "replication")
                    state = client.execute_command("CLUSTER", "INFO").decode()
                if "cluster_state:ok" not in state or f"cluster_slots_ok:{CLUSTER_SLOTS}" not in state:
                    return False
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
            return self._agreed() and len(self.primary_nodes()) == self.primaries
        wait_for(healthy, timeout_s=timeout_s, what="the cluster to be healthy")

    def _agreed(self) -> bool:
        """Every live node's view shows every live node as that node sees itself: primary or replica,
        of the same primary, not failing. (A restarted old primary says it is a replica before the
        promoted one's view lists it as its replica.)"""
        live = [n for n in self.nodes if n.alive]
        views = {n.node_id: {e["id"]: e for e in n.nodes()} for n in live}
        for node in live:
            own = views[node.node_id][node.node_id]
            role = "master" in own["flags"]
            for view in views.values():
                seen = view.get(node.node_id)
                if seen is None or ("master" in seen["flags"]) != role or seen["primary"] != own["primary"] \
                        or seen["flags"] & {"fail", "fail?", "handshake", "noaddr"}:
                    return False
        return True

    # ------------------------------------------------------------ faults
    def kill_primary(self, index: int = 0, *, takeover: bool = False,
                     timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S) -> tuple[ClusterNode, ClusterNode]:
        """SIGKILL the primary of shard `index` (slot order); wait until one of its replicas is
        promoted — by the cluster's own failure detection, or at once with `takeover` (a replica's
        `CLUSTER FAILOVER TAKEOVER`). Returns (killed node, promoted node)."""
        primary = self.primary_nodes()[index]
        replicas = self.replicas_of(primary)
        if not replicas:
            raise ConfigError(f"shard {index} has no live replica to promote")
        primary.server.kill()
        if takeover:
            with replicas[0].client() as client:
                client.execute_command("CLUSTER FAILOVER", "TAKEOVER")
        promoted = wait_for(lambda: self._promoted(replicas), timeout_s=timeout_s,
                            what=f"a replica of shard {index} to be promoted")
        self._wait_agreed(promoted, timeout_s)
        return primary, promoted

    def failover(self, index: int = 0, *, timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S) -> ClusterNode:
        """A graceful manual failover of shard `index` (`CLUSTER FAILOVER` on its replica: the
        replica catches up first, nothing acknowledged is lost). Returns the new primary."""
        primary = self.primary_nodes()[index]
        replica = self.replicas_of(primary)[0]
        with replica.client() as client:
            client.execute_command("CLUSTER FAILOVER")
        promoted: ClusterNode = wait_for(lambda: self._promoted([replica]), timeout_s=timeout_s,
                                         what=f"the manual failover of shard {index}")
        self._wait_agreed(promoted, timeout_s)
        return promoted

    def _wait_agreed(self, promoted: ClusterNode, timeout_s: float) -> None:
        """Every live node sees `promoted` as a primary owning slots (clients may ask any of them)."""
        def agreed() -> bool:
            return all(any(e["id"] == promoted.node_id and "master" in e["flags"] and e["slots"]
                           for e in node.nodes()) for node in self.nodes if node.alive)
        wait_for(agreed, timeout_s=timeout_s, what="every node to agree on the promoted primary")

    def _promoted(self, candidates: list[ClusterNode]) -> ClusterNode | None:
        for node in candidates:
            with node.client() as client:
                if _info(client, "replication").get("role") == "master":
                    return node
        return None

    def restart(self, node: ClusterNode, *, timeout_s: float = DEFAULT_FORM_TIMEOUT_S) -> None:
        """Start a killed node again on its port and data; it rejoins as a replica of its successor.
        Returns once every live node's view shows it so (`wait_healthy`)."""
        if node.alive:
            return
        node.server.start()
        self.wait_healthy(timeout_s=timeout_s)

    def command_counts(self) -> dict[int, int]:
        """Commands each live primary has executed (INFO commandstats, summed), by port."""
        counts = {}
        for node in self.primary_nodes():
            with node.client() as client:
                stats = _info(client, "commandstats")
            counts[node.port] = sum(int(v["calls"]) for v in stats.values())
        return counts

    def reset_stats(self) -> None:
        for node in self.nodes:
            if node.alive:
                with node.client() as client:
                    client.execute_command("CONFIG RESETSTAT")


class SentinelServer(EmbeddedServer):
    """`valkey-server <conf> --sentinel`: a sentinel needs a writable config file of its own."""

    def __init__(self, data_dir: Path, *, primary_host: str, primary_port: int, master_name: str,
                 down_after_ms: int, host: str = "127.0.0.1", binary: str | None = None) -> None:
        super().__init__(data_dir=data_dir, host=host, appendonly=False, binary=binary)
        self.primary_host, self.primary_port = primary_host, primary_port
        self.master_name, self.down_after_ms = master_name, down_after_ms

    def command(self) -> list[str]:
        conf = self.data_dir / "sentinel.conf"
        if not conf.exists():      # a restarted sentinel keeps what it learnt (it rewrites the file)
            conf.write_text("\n".join([
                f"sentinel monitor {self.master_name} {self.primary_host} {self.primary_port} 1",
                f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}",
                f"sentinel failover-timeout {self.master_name} 10000",
                f"sentinel parallel-syncs {self.master_name} 1", "",
            ]))
        return [self.binary or valkey_binary(), str(conf), "--sentinel", "--port", str(self.port), "--bind", self.host,
                "--dir", str(self.data_dir), "--logfile", str(self.data_dir / "server.log")]


@dataclass
class EmbeddedSentinelGroup:
    """One primary, `replicas` replicas and `sentinels` sentinels (quorum 1) monitoring it."""

    data_dir: Path
    replicas: int = 1
    sentinels: int = 1
    host: str = "127.0.0.1"
    master_name: str = DEFAULT_MASTER_NAME
    down_after_ms: int = DEFAULT_SENTINEL_DOWN_AFTER_MS
    appendfsync: str = "everysec"
    binary: str | None = None
    servers: list[EmbeddedServer] = field(default_factory=list)
    sentinel_servers: list[EmbeddedServer] = field(default_factory=list)

    def start(self, *, timeout_s: float = DEFAULT_START_TIMEOUT_S * 3) -> Self:
        try:
            primary = EmbeddedServer(data_dir=self.data_dir / "data-0", host=self.host,
                                     appendfsync=self.appendfsync, binary=self.binary,
                                     extra_args=list(FAST_SYNC_ARGS)).start()
            self.servers.append(primary)
            for i in range(1, self.replicas + 1):
                self.servers.append(EmbeddedServer(
                    data_dir=self.data_dir / f"data-{i}", host=self.host, appendfsync=self.appendfsync,
                    binary=self.binary,
                    extra_args=[*FAST_SYNC_ARGS, "--replicaof", self.host, str(primary.port)]).start())
            for i in range(self.sentinels):
                self.sentinel_servers.append(SentinelServer(
                    self.data_dir / f"sentinel-{i}", primary_host=self.host, primary_port=primary.port,
                    master_name=self.master_name, down_after_ms=self.down_after_ms, host=self.host,
                    binary=self.binary).start())
            wait_for(self._synced, timeout_s=timeout_s, what="replicas in sync and known to every sentinel")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop sentinels first (so none fails over while the data nodes stop), then the servers."""
        for server in (*self.sentinel_servers, *self.servers):
            server.stop()

    def __enter__(self) -> Self:
        return self.start() if not self.servers else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """`redis+sentinel://` URL naming every sentinel and the monitored service."""
        hosts = ",".join(f"{s.host}:{s.port}" for s in self.sentinel_servers)
        return f"redis+sentinel://{hosts}/{self.master_name}/0"

    def primary(self) -> EmbeddedServer:
        """The server the sentinels name as primary now."""
        host, port = self._sentinel_view()
        return next(srv for srv in self.servers if srv.port == port and srv.host == host)

    def _sentinel_view(self) -> tuple[str, int]:
        sentinel = next(s for s in self.sentinel_servers if s.process is not None)
        with Redis(host=sentinel.host, port=sentinel.port, socket_timeout=5) as client:
            host, port = client.sentinel_get_master_addr_by_name(self.master_name)
        return (host.decode() if isinstance(host, bytes) else host), int(port)

    def _synced(self) -> bool:
        primary = self.servers[0]
        with Redis(host=primary.host, port=primary.port, socket_timeout=5) as client:
            if int(_info(client, "replication").get("connected_slaves", 0)) < self.replicas:
                return False
        for sentinel in self.sentinel_servers:
            with Redis(host=sentinel.host, port=sentinel.port, socket_timeout=5) as client:
                fields = client.sentinel_master(self.master_name)
                if int(fields.get("num-slaves", 0)) < self.replicas or \
                        int(fields.get("num-other-sentinels", 0)) < self.sentinels - 1:
                    return False
        return True

    def kill_primary(self, *, timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S) -> tuple[EmbeddedServer, EmbeddedServer]:
        """SIGKILL the primary and wait until every sentinel has finished promoting a replica (the
        state a sentinel client acts on: a primary not down, no failover in progress) and the
        replica accepts writes. Returns (killed, promoted)."""
        old = self.primary()
        old.kill()

        def promoted() -> EmbeddedServer | None:
            for sentinel in self.sentinel_servers:
                with Redis(host=sentinel.host, port=sentinel.port, socket_timeout=5) as client:
                    state = client.sentinel_master(self.master_name)
                flags = set(str(state.get("flags", "")).split(","))
                if int(state["port"]) == old.port or flags & {"s_down", "o_down", "failover_in_progress"}:
                    return None
            new = next(srv for srv in self.servers if srv.port == int(state["port"]))
            with Redis(host=new.host, port=new.port, socket_timeout=5) as client:
                return new if _info(client, "replication").get("role") == "master" else None
        return old, wait_for(promoted, timeout_s=timeout_s, what="the sentinel failover")

    def restart(self, server: EmbeddedServer, *, timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S) -> None:
        """Start a killed server again as a replica of the current primary (what the sentinels would
        reconfigure it to, only sooner) and wait until it is in sync."""
        if server.process is not None and server.process.poll() is None:
            return
        host, port = self._sentinel_view()
        server.extra_args = [*FAST_SYNC_ARGS, "--replicaof", host, str(port)]
        server.start()

        def replicating() -> bool:
            with Redis(host=server.host, port=server.port, socket_timeout=5) as client:
                info = _info(client, "replication")
            return info.get("role") == "slave" and info.get("master_link_status") == "up"
        wait_for(replicating, timeout_s=timeout_s, what="the old primary to rejoin as a replica")
