"""The Redis boundary: the one client, the one error mapping, the script runner.

Every connection omniflow opens is made by `connect` (the one place a cluster or sentinel client
plugs in) and is a `RedisClient` (`connect_sync` and `SyncRedisClient`, in `sync_client`, for the
synchronous client's submits): it owns the redis-py connection and offers the reads and writes omniflow uses, each with its errors
translated inside (its `pipeline()` queues commands in an `omniflow.storage.queued.Pipeline`).
On a standalone server the hot path (the script runner, `xread`/`xreadgroup`, `pipeline()`) goes
through the lean transport, `omniflow.storage.resp` (it raises redis-py's errors, translated here).
Besides this module only `topology` (which kind of server a URL names), `resp` and
`omniflow.ops.embedded*` (the servers omniflow starts) import redis-py.
Every redis-py error is translated here, and only here, into the `omniflow.errors` tree, and
every loop has one rule per class:

| what happened                                        | class              | rule                      |
|------------------------------------------------------|--------------------|---------------------------|
| connection lost, refused or timed out                | `RedisUnavailable` | retry with backoff        |
| the server refused: OOM, READONLY, BUSY, LOADING...  | `RedisRefused`     | retry with backoff (nothing was applied) |
| a function missing (restart, `FUNCTION FLUSH`)      | never leaves here  | library loaded, call resent |
| a script or command failed (a bug, bad data)         | `ScriptError`      | dead-letter what caused it |
| bad credentials, no permission                       | `ConfigError`      | stop with one line        |

`execute` is the one script runner: it sends commands in one round trip (one
command, or a pipeline), returns each reply in place (an error as its
translated class), and reloads the library and resends when a function is missing. Callers
that need one reply use `call` / `script`, which raise instead.
"""
from __future__ import annotations

import asyncio
import builtins
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline as RawPipeline
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    DataError,
    ExecAbortError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    RedisClusterException,
    ReadOnlyError,
    ResponseError,
)
from redis.exceptions import RedisError as ClientError


from omniflow.errors import (
    ConfigError,
    OmniflowError,
    RedisError,
    RedisRefused,
    RedisUnavailable,
    ScriptError,
)
from omniflow.storage.queued import Pipeline
from omniflow.storage.resp import Transport, xread_command, xreadgroup_command
from omniflow.storage.topology import is_cluster, open_client, pubsub_client

# the redis-py error `omniflow.storage.runner` catches (redis-py is imported here, not there)
ReplyError = ResponseError


P = ParamSpec("P")
T = TypeVar("T")

#: what a redis-py call raises (its own errors, and socket errors it lets through)
#: (a cluster client's own errors are not redis-py's RedisError: a slot without a primary during
#: a failover, a command it cannot route)
CLIENT_ERRORS: tuple[type[BaseException], ...] = (ClientError, RedisClusterException, OSError)
#: what a Redis call raises before or after translation: catch it only around Redis calls
#: (an executor's own OSError is a stage failure, never a Redis loss)
REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, *CLIENT_ERRORS)

#: error codes of a server that refuses for now: nothing of the command was applied
REFUSALS = frozenset({"OOM", "READONLY", "BUSY", "LOADING", "MASTERDOWN", "MISCONF", "TRYAGAIN", "CLUSTERDOWN",
                      "NOREPLICAS", "NOSCRIPT", "EXECABORT", "UNBLOCKED"})
#: how Redis and Valkey answer an FCALL of a function they do not have (no error code of its own)
FUNCTION_MISSING = "Function not found"
_REFUSED_CLASSES: tuple[tuple[type[BaseException], str], ...] = (
    (OutOfMemoryError, "OOM"), (ReadOnlyError, "READONLY"), (NoScriptError, "NOSCRIPT"),
    (BusyLoadingError, "LOADING"), (ExecAbortError, "EXECABORT"),
)


def connect(url: str, **kwargs: Any) -> RedisClient:
    """A client with the options omniflow relies on (bytes replies, C packing), for a standalone
    server, any node of a Redis Cluster, or a `redis+sentinel://` service (`omniflow.storage.topology`).

    Every asyncio connection of omniflow is made here."""
    try:
        return RedisClient(open_client(url, **kwargs))
    except ValueError as exc:
        raise ConfigError(f"OMNIFLOW_REDIS_URL: {url!r} is not a Redis URL ({exc})") from exc


# ---------------------------------------------------------------- the error mapping
def translate(exc: BaseException) -> OmniflowError:
    """The omniflow error a redis-py (or socket) error means."""
    if isinstance(exc, OmniflowError):
        return exc
    if isinstance(exc, (AuthenticationError, NoPermissionError)):
        return ConfigError(f"Redis refused our credentials or permissions: {exc} (check OMNIFLOW_REDIS_URL)")
    if isinstance(exc, RedisClusterException):
        if "same key slot" in str(exc) or "several slots" in str(exc):    # a command built wrong: a bug
            return ScriptError(f"Redis Cluster: {exc}")
        return RedisUnavailable(f"Redis Cluster is changing (a failover?): {exc}")
    for cls, code in _REFUSED_CLASSES:
        if isinstance(exc, cls):
            return RedisRefused(f"Redis refused the command ({code}): {exc}", refusal=code)
    if isinstance(exc, ResponseError):
        if str(exc).startswith(FUNCTION_MISSING):     # the library is not loaded: as NOSCRIPT was
            return RedisRefused(f"Redis refused the command (NOSCRIPT): {exc}", refusal="NOSCRIPT")
        code = str(exc).split(" ", 1)[0]
        if code in REFUSALS:
            return RedisRefused(f"Redis refused the command: {exc}", refusal=code)
        return ScriptError(f"Redis error: {exc}")
    if isinstance(exc, DataError):
        return ScriptError(f"bad command arguments: {exc}")
    return RedisUnavailable(f"Redis unreachable: {exc}")


def is_refused(result: Any, code: str) -> bool:
    return isinstance(result, RedisRefused) and result.refusal == code


def is_nogroup(exc: BaseException) -> bool:
    """The stream or its consumer group does not exist (deleted, or the server lost it)."""
    return isinstance(exc, ScriptError) and "NOGROUP" in str(exc)


@contextmanager
def boundary() -> Iterator[None]:
    """Translate redis-py errors raised inside the block: `with boundary(): await redis.xlen(k)`."""
    try:
        yield
    except CLIENT_ERRORS as exc:
        raise translate(exc) from exc


def translated(fn: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Decorator: an async function whose redis-py errors come out translated."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(*args, **kwargs)
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    return wrapper


# ---------------------------------------------------------------- streams and groups
async def _execute_pipe(pipe: RawPipeline, raise_on_error: bool) -> list[Any]:
    """Send a queued `Pipeline`'s commands (its executor), errors translated."""
    try:
        return await pipe.execute(raise_on_error=raise_on_error)
    except CLIENT_ERRORS as exc:
        raise translate(exc) from exc


# ---------------------------------------------------------------- the client
KeyT = str | bytes
Entries = list[tuple[bytes, dict[bytes, bytes]]]


class RedisClient:
    """omniflow's asyncio Redis client: owns one redis-py client (a standalone server's, a
    cluster's or a sentinel service's) and offers the commands omniflow uses, each returning
    redis-py's reply (bytes) with its errors translated (`omniflow.errors`)."""

    def __init__(self, raw: Redis) -> None:
        self._raw = raw
        self._lean = Transport.for_client(raw)
        self._lean_pipes = None if self._lean is None else tuple(      # pipeline()'s executors: (shared, blocking)
            translated(functools.partial(self._lean.execute_pipeline, exclusive=e)) for e in (False, True))
        #: (replicas, timeout ms) every writing round trip waits for (`require_replicas`)
        self.omniflow_wait: tuple[int, int] | None = None

    @property
    def raw(self) -> Redis:
        """The redis-py client (this boundary's, and `omniflow.storage.topology`'s; tests)."""
        return self._raw

    @property
    def lean(self) -> Transport | None:
        """The hot path's transport on a standalone server (`omniflow.storage.resp`; None: redis-py's)."""
        return self._lean

    @property
    def cluster(self) -> bool:
        """Is this a cluster client (one slot per multi-key command, no pub/sub)?"""
        return is_cluster(self._raw)

    async def _do(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self._raw, name)(*args, **kwargs)
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    def pipeline(self, *, transaction: bool = False, blocking: bool = False) -> Pipeline:
        """Commands queued with redis-py's signatures, sent in one round trip (the lean transport's but
        for MULTI/EXEC). `blocking`: it holds a blocking read (on a connection of its own)."""
        if self._lean_pipes is not None and not transaction:
            return Pipeline(self._raw.pipeline(transaction=False), self._lean_pipes[blocking])
        return Pipeline(self._raw.pipeline(transaction=transaction), _execute_pipe)

    async def aclose(self) -> None:
        if self._lean is not None:
            await self._lean.aclose()
        await self._raw.aclose()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await self._do("execute_command", *args, **kwargs)

    async def ping(self) -> bool:
        return bool(await self._do("ping"))

    async def info(self, section: str | None = None) -> dict[str, Any]:
        return cast("dict[str, Any]", await self._do("info", section) if section else await self._do("info"))

    async def config_get(self, pattern: str) -> dict[Any, Any] | None:
        """CONFIG GET; None when the server forbids CONFIG (managed Redis, an ACL)."""
        try:
            return cast("dict[Any, Any]", await self._raw.config_get(pattern))
        except ResponseError:
            return None
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    async def config_set(self, name: str, value: Any) -> bool:
        return bool(await self._do("config_set", name, value))

    async def function_list(self, pattern: str) -> list[Any]:
        """FUNCTION LIST LIBRARYNAME `pattern`: each library a flat list of name/value pairs."""
        return cast("list[Any]", await self._do("function_list", library=pattern))

    async def function_delete(self, library: str) -> bool:
        return bool(await self._do("function_delete", library))

    async def script_flush(self) -> bool:
        """Drop every function the server has, omniflow's script library with them (a fault to
        recover from: tests only)."""
        return bool(await self._do("function_flush"))

    async def dbsize(self) -> int:
        return int(await self._do("dbsize"))

    async def scan_iter(self, *, match: str, count: int = 1000) -> AsyncIterator[bytes]:
        try:
            async for key in self._raw.scan_iter(match=match, count=count):
                yield key
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc

    # strings and keys
    async def get(self, key: KeyT) -> bytes | None:
        return cast("bytes | None", await self._do("get", key))

    async def mget(self, keys: Sequence[KeyT]) -> list[bytes | None]:
        return cast("list[bytes | None]", await self._do("mget", keys))

    async def set(self, key: KeyT, value: Any, **kwargs: Any) -> Any:
        return await self._do("set", key, value, **kwargs)

    async def incr(self, key: KeyT, amount: int = 1) -> int:
        return int(await self._do("incr", key, amount))

    async def exists(self, *keys: KeyT) -> int:
        return int(await self._do("exists", *keys))

    async def delete(self, *keys: KeyT) -> int:
        return int(await self._do("delete", *keys))

    async def unlink(self, *keys: KeyT) -> int:
        return int(await self._do("unlink", *keys))

    async def expire(self, key: KeyT, seconds: int) -> bool:
        return bool(await self._do("expire", key, seconds))

    async def pexpire(self, key: KeyT, ms: int) -> bool:
        return bool(await self._do("pexpire", key, ms))

    async def ttl(self, key: KeyT) -> int:
        return int(await self._do("ttl", key))

    async def pttl(self, key: KeyT) -> int:
        return int(await self._do("pttl", key))

    async def publish(self, channel: str, message: Any) -> int:
        return int(await self._do("publish", channel, message))

    # hashes
    async def hget(self, key: KeyT, field: KeyT) -> bytes | None:
        return cast("bytes | None", await self._do("hget", key, field))

    async def hmget(self, key: KeyT, fields: KeyT | Sequence[KeyT], *more: KeyT) -> list[bytes | None]:
        return cast("list[bytes | None]", await self._do("hmget", key, fields, *more))

    async def hgetall(self, key: KeyT) -> dict[bytes, bytes]:
        return cast("dict[bytes, bytes]", await self._do("hgetall", key))

    async def hset(self, key: KeyT, field: KeyT | None = None, value: Any = None, *,
                   mapping: Mapping[Any, Any] | None = None) -> int:
        return int(await self._do("hset", key, field, value, mapping=mapping))

    async def hdel(self, key: KeyT, *fields: KeyT) -> int:
        return int(await self._do("hdel", key, *fields))

    async def hsetnx(self, key: KeyT, field: KeyT, value: Any) -> bool:
        return bool(await self._do("hsetnx", key, field, value))

    async def hexists(self, key: KeyT, field: KeyT) -> bool:
        return bool(await self._do("hexists", key, field))

    async def hincrby(self, key: KeyT, field: KeyT, amount: int = 1) -> int:
        return int(await self._do("hincrby", key, field, amount))

    # sets and lists
    async def smembers(self, key: KeyT) -> builtins.set[bytes]:
        return cast("builtins.set[bytes]", await self._do("smembers", key))

    async def sismember(self, key: KeyT, member: Any) -> bool:
        return bool(await self._do("sismember", key, member))

    async def lrange(self, key: KeyT, start: int, end: int) -> list[bytes]:
        return cast("list[bytes]", await self._do("lrange", key, start, end))

    # sorted sets
    async def zadd(self, key: KeyT, mapping: Mapping[Any, float], **kwargs: Any) -> int:
        return int(await self._do("zadd", key, mapping, **kwargs))

    async def zrem(self, key: KeyT, *members: Any) -> int:
        return int(await self._do("zrem", key, *members))

    async def zscore(self, key: KeyT, member: Any) -> float | None:
        return cast("float | None", await self._do("zscore", key, member))

    async def zmscore(self, key: KeyT, members: Sequence[Any]) -> list[float | None]:
        return cast("list[float | None]", await self._do("zmscore", key, members))

    async def zcard(self, key: KeyT) -> int:
        return int(await self._do("zcard", key))

    async def zcount(self, key: KeyT, low: Any, high: Any) -> int:
        return int(await self._do("zcount", key, low, high))

    async def zrange(self, key: KeyT, start: int, end: int, **kwargs: Any) -> list[Any]:
        return cast("list[Any]", await self._do("zrange", key, start, end, **kwargs))

    async def zrevrange(self, key: KeyT, start: int, end: int, **kwargs: Any) -> list[Any]:
        return cast("list[Any]", await self._do("zrevrange", key, start, end, **kwargs))

    async def zrangebyscore(self, key: KeyT, low: Any, high: Any, **kwargs: Any) -> list[Any]:
        return cast("list[Any]", await self._do("zrangebyscore", key, low, high, **kwargs))

    async def zrevrangebyscore(self, key: KeyT, high: Any, low: Any, **kwargs: Any) -> list[Any]:
        return cast("list[Any]", await self._do("zrevrangebyscore", key, high, low, **kwargs))

    # streams
    async def xadd(self, key: KeyT, fields: Mapping[Any, Any], **kwargs: Any) -> bytes:
        return cast("bytes", await self._do("xadd", key, fields, **kwargs))

    async def xlen(self, key: KeyT) -> int:
        return int(await self._do("xlen", key))

    async def xrange(self, key: KeyT, min: Any = "-", max: Any = "+", count: int | None = None) -> Entries:
        return cast("Entries", await self._do("xrange", key, min, max, count))

    async def xrevrange(self, key: KeyT, max: Any = "+", min: Any = "-", count: int | None = None) -> Entries:
        return cast("Entries", await self._do("xrevrange", key, max, min, count))

    async def xread(self, streams: Mapping[Any, Any], count: int | None = None, block: int | None = None) -> list[Any]:
        """XREAD (a blocking one on a connection of its own: `omniflow.storage.resp`)."""
        if self._lean is None:
            return cast("list[Any]", await self._do("xread", streams, count=count, block=block))
        return await self._lean_read(lambda: xread_command(streams, count, block), block)

    async def xreadgroup(self, group: str, consumer: str, streams: Mapping[Any, Any], count: int | None = None,
                         block: int | None = None, **kwargs: Any) -> list[Any]:
        """XREADGROUP (a blocking one on a connection of its own)."""
        if self._lean is None:
            return cast("list[Any]", await self._do("xreadgroup", group, consumer, streams, count=count, block=block,
                                                    **kwargs))
        return await self._lean_read(lambda: xreadgroup_command(group, consumer, streams, count, block, **kwargs), block)

    async def _lean_read(self, build: Callable[[], tuple[Any, ...]], block: int | None) -> list[Any]:
        assert self._lean is not None
        with boundary():        # (redis-py's checks of the arguments raise in `build`)
            return cast("list[Any]", await self._lean.request(*build(), exclusive=block is not None))

    async def xack(self, key: KeyT, group: str, *ids: Any) -> int:
        return int(await self._do("xack", key, group, *ids))

    async def xdel(self, key: KeyT, *ids: Any) -> int:
        return int(await self._do("xdel", key, *ids))

    async def xpending(self, key: KeyT, group: str) -> dict[str, Any]:
        return cast("dict[str, Any]", await self._do("xpending", key, group))

    async def xpending_range(self, key: KeyT, group: str, **kwargs: Any) -> list[dict[str, Any]]:
        return cast("list[dict[str, Any]]", await self._do("xpending_range", key, group, **kwargs))

    async def xclaim(self, key: KeyT, group: str, consumer: str, min_idle_time: int, message_ids: Sequence[Any],
                     **kwargs: Any) -> Any:
        return await self._do("xclaim", key, group, consumer, min_idle_time, message_ids, **kwargs)

    async def xautoclaim(self, key: KeyT, group: str, consumer: str, min_idle_time: int, **kwargs: Any) -> Any:
        return await self._do("xautoclaim", key, group, consumer, min_idle_time, **kwargs)

    async def xinfo_consumers(self, key: KeyT, group: str) -> list[dict[str, Any]]:
        return cast("list[dict[str, Any]]", await self._do("xinfo_consumers", key, group))

    async def xinfo_groups(self, key: KeyT) -> list[dict[str, Any]]:
        return cast("list[dict[str, Any]]", await self._do("xinfo_groups", key))

    async def xinfo_stream(self, key: KeyT) -> dict[str, Any]:
        return cast("dict[str, Any]", await self._do("xinfo_stream", key))

    async def xgroup_create(self, key: KeyT, group: str, **kwargs: Any) -> bool:
        return bool(await self._do("xgroup_create", key, group, **kwargs))

    # pub/sub
    async def listen(self, channel: str, *, subscribed: asyncio.Event | None = None) -> AsyncIterator[bytes]:
        """The messages published on `channel` (on a cluster, through a connection to one of its
        nodes: a PUBLISH reaches every node), until cancelled; a lost connection raises (translated).
        `subscribed` is set once the server confirmed the subscription: from then on every PUBLISH to
        `channel` reaches this listener (one processed before it is not delivered to it)."""
        client = pubsub_client(self._raw)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(channel)
            async for message in pubsub.listen():
                kind = message.get("type")
                if kind == "message":
                    yield message["data"]
                elif kind == "subscribe" and subscribed is not None:
                    subscribed.set()
        except CLIENT_ERRORS as exc:
            raise translate(exc) from exc
        finally:
            await cast(Any, pubsub).aclose()
            if client is not self._raw:
                await client.aclose()
