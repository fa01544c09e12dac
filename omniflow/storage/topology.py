"""Which kind of Redis deployment a URL names, and the redis-py client for it.

- `redis://host:port/db` (or `rediss://`) of a standalone server: redis-py's `Redis`.
- the same URL of any node of a Redis/Valkey Cluster: detected (`INFO cluster`), and the
  client is redis-py's asyncio `RedisCluster` (it learns every node from that one).
- `redis+sentinel://[user:password@]host:port[,host:port…]/service[/db]` (or
  `rediss+sentinel://`): redis-py's Sentinel; the client follows the primary the sentinels name,
  through every failover.

Nothing else in omniflow asks which kind it has, except where Redis Cluster forbids something
a single server allows (one slot per multi-key command): `is_cluster(client)` says so, and
those places (blocking reads over several cells, pub/sub) split their work by cell.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import hiredis
from redis import Redis as SyncRedis
from redis.asyncio import Connection, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.sentinel import Sentinel as SyncSentinel
from redis._parsers.hiredis import _AsyncHiredisParser
from redis.exceptions import ConnectionError as RedisConnectionError, RedisError, ResponseError

from omniflow.errors import ConfigError, RedisUnavailable

logger = logging.getLogger(__name__)

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
DETECT_TIMEOUT_S = 5.0


class ServerKind(str, enum.Enum):
    """What is behind a Redis URL."""

    STANDALONE = "standalone"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


def pack_one(args: tuple[Any, ...]) -> bytes:
    """One command in RESP, packed by hiredis in C (redis-py's asyncio client packs in Python)."""
    if isinstance(args[0], str) and " " in args[0]:      # "XGROUP CREATE", "SCRIPT LOAD", ...
        args = (*args[0].split(), *args[1:])
    packed: bytes = hiredis.pack_command(args)
    return packed


def pack(args: tuple[Any, ...]) -> list[bytes]:
    """`pack_one` as redis-py's connections return it."""
    return [pack_one(args)]


class FastPacking:
    """Mixin for redis-py asyncio connections: hiredis command packing, and the pool's check of a
    connection it hands out made without a loop turn."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return pack(args)

    def pack_commands(self, commands: Any) -> list[bytes]:
        return [b"".join(pack_one(tuple(cmd)) for cmd in commands)]

    async def can_read_destructive(self) -> bool:
        """Is something waiting on this connection that no command asked for (a reply, or the
        server's EOF)? The pool asks before every command it sends. redis-py's hiredis parser answers
        by awaiting a read under a zero timeout: one whole event-loop turn (an epoll call and a timer)
        per command, ~35 µs of a 170 µs PING round trip on this machine (bench/notes.md, round 7).
        Asked here without awaiting: the loop has already moved whatever the socket held into the
        stream's buffer (or marked its EOF), so what redis-py's read would find is there to see; a
        parser that is not hiredis is asked redis-py's way."""
        parser = cast(Any, self)._parser
        stream, reader = getattr(parser, "_stream", None), getattr(parser, "_reader", None)
        if isinstance(parser, _AsyncHiredisParser) and stream is not None and reader is not None:
            if not parser._connected:
                raise RedisConnectionError("Connection closed by server.")
            return bool(reader.has_data() or stream._buffer or stream._eof)
        return bool(await cast(Any, super()).can_read_destructive())


class FastConnection(FastPacking, Connection):
    """redis-py's asyncio connection packs commands in pure Python (its sync twin uses
    hiredis); packing was the largest single cost per workflow. hiredis packs in C."""


class FastSentinelConnection(FastPacking, SentinelManagedConnection):
    """A sentinel-managed connection (it finds the current primary) with hiredis packing."""


class FastSentinelSSLConnection(FastPacking, SentinelManagedSSLConnection):
    """The TLS twin of `FastSentinelConnection`."""


# ---------------------------------------------------------------- sentinel URLs
@dataclass(frozen=True)
class SentinelURL:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def parse_sentinel_url(url: str) -> SentinelURL:
    """`redis+sentinel://[user:password@]h1:p1,h2:p2/service[/db]` -> its parts (ConfigError if bad)."""
    parts = urlsplit(url)
    if parts.scheme not in SENTINEL_SCHEMES:
        raise ConfigError(f"{url!r} is not a redis+sentinel:// URL")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":") if userinfo else ("", "", "")
    sentinels = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":") if ":" in item else (item.strip(), "", "")
        if not host:
            raise ConfigError(f"OMNIFLOW_REDIS_URL: no sentinel host in {url!r}")
        try:
            sentinels.append((host.strip("[]"), int(port) if port else DEFAULT_SENTINEL_PORT))
        except ValueError:
            raise ConfigError(f"OMNIFLOW_REDIS_URL: bad sentinel port {port!r} in {url!r}") from None
    path = [p for p in parts.path.split("/") if p]
    if not path:
        raise ConfigError(f"OMNIFLOW_REDIS_URL: {url!r} names no service (…/<service>[/<db>])")
    try:
        db = int(path[1]) if len(path) > 1 else 0
    except ValueError:
        raise ConfigError(f"OMNIFLOW_REDIS_URL: bad database {path[1]!r} in {url!r}") from None
    return SentinelURL(sentinels=tuple(sentinels), service=unquote(path[0]), db=db,
                       username=unquote(username) or None, password=unquote(password) or None,
                       ssl=parts.scheme.startswith("rediss"))


# ---------------------------------------------------------------- detection
_kinds: dict[str, ServerKind] = {}


def server_kind(url: str) -> ServerKind:
    """What `url` points at; asked once per URL and process (a short synchronous INFO), then cached.
    `RedisUnavailable` when the server cannot be asked now (daemons connect inside their retry
    loop, so they wait for it)."""
    if urlsplit(url).scheme in SENTINEL_SCHEMES:
        return ServerKind.SENTINEL
    kind = _kinds.get(url)
    if kind is not None:
        return kind
    try:
        with SyncRedis.from_url(url, socket_timeout=DETECT_TIMEOUT_S,
                                socket_connect_timeout=DETECT_TIMEOUT_S) as probe:
            info: dict[str, Any] = probe.info("cluster")
    except ValueError as exc:
        raise ConfigError(f"OMNIFLOW_REDIS_URL: {url!r} is not a Redis URL ({exc})") from exc
    except ResponseError:          # INFO refused (managed Redis, ACL): not a cluster we can use
        info = {}
    except (RedisError, OSError) as exc:
        # never guess: a standalone client on a cluster would fail on every other slot's keys
        raise RedisUnavailable(f"Redis unreachable: {exc}") from exc
    kind = ServerKind.CLUSTER if int(info.get("cluster_enabled", 0) or 0) else ServerKind.STANDALONE
    _kinds[url] = kind
    return kind


# ---------------------------------------------------------------- clients
class ClusterClient(RedisCluster):
    """redis-py's asyncio cluster client, with the three things omniflow needs added:

    - XREAD/XREADGROUP are routed by the keys after STREAMS; redis-py would ask a server
      (`COMMAND GETKEYS`) before every such read, a round trip per blocking read;
    - its connections pack commands with hiredis, like the standalone client's;
    - a default node always exists: redis-py 5.3 drops it when that node fails over and its
      pipeline then dies on `None.name` (an AttributeError, not a Redis error) until the slot
      map is reloaded; any primary it knows serves as the default meanwhile."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fast = type("FastClusterConnection", (FastPacking, self.nodes_manager.connection_kwargs["connection_class"]),
                    {})
        self.nodes_manager.connection_kwargs["connection_class"] = fast
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = fast

    def get_default_node(self) -> Any:
        node = self.nodes_manager.default_node
        if node is None:
            primaries = self.get_primaries()
            if primaries:
                node = self.nodes_manager.default_node = primaries[0]
        return node

    async def _determine_slot(self, command: str, *args: Any) -> int:
        if command.upper() in ("XREAD", "XREADGROUP"):
            upper = [a.upper() if isinstance(a, str) else a for a in args]
            at = upper.index("STREAMS") if "STREAMS" in upper else upper.index(b"STREAMS")
            streams = args[at + 1:]
            slots = {self.keyslot(key) for key in streams[: len(streams) // 2]}
            if len(slots) != 1:
                raise ConfigError(f"{command} over keys of several slots (one read per cell in a cluster)")
            return int(slots.pop())
        return int(await super()._determine_slot(command, *args))


def is_cluster(client: Any) -> bool:
    """Is this client (redis-py's, or a `RedisClient` around one) a cluster client (one slot per
    multi-key command, no pub/sub)?"""
    return isinstance(getattr(client, "raw", client), RedisCluster)


def _sentinel(cls: Any, spec: SentinelURL) -> Any:
    """redis-py's `Sentinel` (asyncio or synchronous: `cls`) for the sentinels of `spec`, with its credentials."""
    auth = {"username": spec.username, "password": spec.password}
    return cls(list(spec.sentinels), sentinel_kwargs={**auth, "socket_timeout": DETECT_TIMEOUT_S}, **auth)


def open_client(url: str, **kwargs: Any) -> Redis:
    """An asyncio client for whatever `url` points at (see the module docstring), replies as
    bytes, commands packed by hiredis. Cluster clients are typed as `Redis`: omniflow uses the
    command surface both share. Raises ValueError for a URL redis-py cannot parse."""
    kind = server_kind(url)
    options = {"decode_responses": False, "socket_keepalive": True, **kwargs}
    if kind is ServerKind.SENTINEL:
        spec = parse_sentinel_url(url)
        return cast(Redis, _sentinel(Sentinel, spec).master_for(
            spec.service, db=spec.db, ssl=spec.ssl,
            connection_class=FastSentinelSSLConnection if spec.ssl else FastSentinelConnection, **options))
    if kind is ServerKind.CLUSTER:
        for unsupported in ("single_connection_client", "health_check_interval"):
            options.pop(unsupported, None)
        client = cast(Redis, ClusterClient.from_url(url, **options))   # the command surface both share
        return client
    standalone: Redis = Redis.from_url(url, connection_class=FastConnection, **options)
    return standalone


SyncConnection = SyncRedis       # what `open_sync_client` returns (named for the modules without redis-py)


def open_sync_client(url: str, **kwargs: Any) -> SyncRedis:
    """The synchronous twin of `open_client` (the synchronous client's submits)."""
    kind = server_kind(url)
    options = {"decode_responses": False, "socket_keepalive": True, **kwargs}
    if kind is ServerKind.SENTINEL:
        spec = parse_sentinel_url(url)
        return cast(SyncRedis, _sentinel(SyncSentinel, spec).master_for(spec.service, db=spec.db, ssl=spec.ssl,
                                                                         **options))
    if kind is ServerKind.CLUSTER:
        client: SyncRedis = SyncRedisCluster.from_url(url, **options)
        return client
    standalone: SyncRedis = SyncRedis.from_url(url, **options)
    return standalone


def read_groups(client: Any, cells: int) -> list[tuple[int, ...]]:
    """How to split a blocking read over the streams of every cell: one read over all of them on
    a single server; one read per cell on a cluster (each cell is its own slot, and a multi-key
    command must stay in one slot)."""
    if is_cluster(client):
        return [(cell,) for cell in range(cells)]
    return [tuple(range(cells))]


def pubsub_client(client: Redis) -> Redis:
    """A client whose `pubsub()` receives every PUBLISH: the client itself, or on a cluster a
    standalone connection to one of its nodes (a classic PUBLISH reaches every node of a
    cluster; redis-py's asyncio cluster client has no pub/sub). Close it after use when it is not
    `client`."""
    if not is_cluster(client):
        return client
    node = cast(RedisCluster, client).get_random_node()
    kwargs = {k: v for k, v in node.connection_kwargs.items()
              if k in ("username", "password", "socket_timeout", "socket_connect_timeout")}
    standalone: Redis = Redis(host=node.host, port=int(node.port), decode_responses=False, **kwargs)
    return standalone
