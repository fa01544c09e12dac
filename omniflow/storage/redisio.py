"""The Redis boundary: connections, the one error mapping, the script runner.

Every connection omniflow opens is made by `connect` (the one place a cluster or
sentinel client would plug in). Every redis-py error is translated here, and
only here, into the `omniflow.errors` tree, and every loop has one rule per class:

| what happened                                        | class              | rule                      |
|------------------------------------------------------|--------------------|---------------------------|
| connection lost, refused or timed out                | `RedisUnavailable` | retry with backoff        |
| the server refused: OOM, READONLY, BUSY, LOADING...  | `RedisRefused`     | retry with backoff (nothing was applied) |
| NOSCRIPT (server restarted, or `SCRIPT FLUSH`)       | never leaves here  | scripts loaded, call resent |
| a script or command failed (a bug, bad data)         | `ScriptError`      | dead-letter what caused it |
| bad credentials, no permission                       | `ConfigError`      | stop with one line        |

`execute` is the one script runner: it sends commands in one round trip (one
command, or a pipeline), returns each reply in place (an error as its
translated class), and reloads the scripts and resends on NOSCRIPT. Callers
that need one reply use `call` / `script`, which raise instead.
"""
from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ParamSpec, TypeVar

from redis import Redis as SyncRedis
from redis.asyncio import Redis
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
from omniflow.storage.scripts import SCRIPTS
from omniflow.storage.topology import is_cluster, open_client, open_sync_client

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
_REFUSED_CLASSES: tuple[tuple[type[BaseException], str], ...] = (
    (OutOfMemoryError, "OOM"), (ReadOnlyError, "READONLY"), (NoScriptError, "NOSCRIPT"),
    (BusyLoadingError, "LOADING"), (ExecAbortError, "EXECABORT"),
)


def connect(url: str, **kwargs: Any) -> Redis:
    """A redis-py asyncio client with the options omniflow relies on (bytes replies, C packing),
    for a standalone server, any node of a Redis Cluster, or a `redis+sentinel://` service
    (`omniflow.storage.topology`).

    Every asyncio connection of omniflow is made here."""
    try:
        return open_client(url, **kwargs)
    except ValueError as exc:
        raise ConfigError(f"OMNIFLOW_REDIS_URL: {url!r} is not a Redis URL ({exc})") from exc


def connect_sync(url: str, **kwargs: Any) -> SyncRedis:
    """The synchronous twin of `connect` (the synchronous client's submits)."""
    try:
        return open_sync_client(url, **kwargs)
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


# ---------------------------------------------------------------- the script runner
async def load_scripts(redis: Redis) -> None:
    """SCRIPT LOAD every script (cheap; idempotent). Called at start and after NOSCRIPT."""
    with boundary():
        if is_cluster(redis):       # one SCRIPT LOAD per script, sent to every primary
            for source in SCRIPTS.values():
                await redis.script_load(source.source)
            return
        pipe = redis.pipeline(transaction=False)
        for source in SCRIPTS.values():
            pipe.script_load(source.source)
        await pipe.execute()


async def execute(redis: Redis, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send `commands` in one round trip; each reply in place, an error as its translated class.

    Scripts missing on the server (NOSCRIPT) are loaded and those calls sent again. Raises
    `RedisUnavailable` (or `RedisRefused`) when the round trip itself failed: then nothing can be
    said of any command."""
    results = await _send(redis, commands)
    missing = [i for i, r in enumerate(results) if is_refused(r, "NOSCRIPT")]
    if missing:
        await load_scripts(redis)
        for i, result in zip(missing, await _send(redis, [commands[i] for i in missing])):
            results[i] = result
    return results


#: commands that write nothing: a round trip of only these needs no replication wait
READ_ONLY = frozenset({"XREAD", "XREADGROUP", "XRANGE", "XREVRANGE", "XLEN", "XPENDING", "XINFO", "GET", "MGET",
                       "HGET", "HMGET", "HGETALL", "EXISTS", "ZCARD", "ZRANGE", "ZREVRANGE", "ZRANGEBYSCORE",
                       "ZSCORE", "TTL", "PTTL", "PING", "INFO", "SCAN", "TYPE"})


_HEARTBEAT_SHA = SCRIPTS["heartbeat"].sha


def require_replicas(client: Redis, replicas: int, timeout_ms: int) -> None:
    """Make every round trip of `client` that writes wait until `replicas` replicas have its writes
    (`WAIT`, in the same pipeline: one wait per round trip, whatever it carries; on a cluster one
    per primary the round trip touched). A round trip not replicated in time counts as lost
    (`RedisUnavailable`): its writes may or may not survive a failover, and every transition is
    idempotent, so the caller's retry is safe. 0 replicas: no wait (asynchronous replication)."""
    client.omniflow_wait = (replicas, timeout_ms) if replicas > 0 else None


def _first_key(cmd: tuple[Any, ...]) -> Any:
    return cmd[3] if str(cmd[0]).upper() in ("EVALSHA", "EVAL") else cmd[1]


def _needs_replicas(cmd: tuple[Any, ...]) -> bool:
    name = str(cmd[0]).split(" ", 1)[0].upper()
    # a lease renewal is not state to keep: waiting on it would let leases lapse while a replica is away
    return name not in READ_ONLY and not (name == "EVALSHA" and cmd[1] == _HEARTBEAT_SHA)


async def _send(redis: Redis, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    wait = getattr(redis, "omniflow_wait", None)
    if wait is not None and any(_needs_replicas(c) for c in commands):
        return await _send_replicated(redis, commands, *wait)
    try:
        if len(commands) == 1:
            try:
                return [await redis.execute_command(*commands[0])]
            except ResponseError as exc:         # in place, like a pipeline
                return [translate(exc)]
        pipe = redis.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*cmd)
        results = await pipe.execute(raise_on_error=False)
    except CLIENT_ERRORS as exc:
        raise translate(exc) from exc
    return [translate(r) if isinstance(r, Exception) else r for r in results]


async def _send_replicated(redis: Redis, commands: Sequence[tuple[Any, ...]], replicas: int,
                           timeout_ms: int) -> list[Any]:
    """`_send` followed by WAIT on every primary it wrote to, in the same round trip."""
    cluster = is_cluster(redis)
    try:
        pipe = redis.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*cmd)
        nodes = {}
        if cluster:
            await redis.initialize()        # the slot map (a no-op once the client knows it)
            for cmd in commands:
                node = redis.get_node_from_key(_first_key(cmd))
                nodes[node.name] = node
            for node in nodes.values():
                pipe.execute_command("WAIT", replicas, timeout_ms, target_nodes=node)
        else:
            pipe.execute_command("WAIT", replicas, timeout_ms)
        results = await pipe.execute(raise_on_error=False)
    except CLIENT_ERRORS as exc:
        raise translate(exc) from exc
    replies, acks = results[:len(commands)], results[len(commands):]
    if any(isinstance(a, Exception) or int(a) < replicas for a in acks):
        lost = RedisUnavailable(f"writes not confirmed by {replicas} replica(s) within {timeout_ms} ms "
                                f"(WAIT answered {[a if isinstance(a, int) else str(a) for a in acks]})")
        return [lost] * len(commands)
    return [translate(r) if isinstance(r, Exception) else r for r in replies]


async def call(redis: Redis, *command: Any) -> Any:
    """One command (NOSCRIPT handled); its reply, or its translated error raised."""
    (result,) = await execute(redis, [command])
    if isinstance(result, Exception):
        raise result
    return result


async def script(redis: Redis, name: str, keys: list[str], args: list[Any]) -> Any:
    """Call one registered script by name with hand-built KEYS (tests and debugging only: library
    code builds its calls in `omniflow.storage.transitions`)."""
    return await call(redis, *SCRIPTS[name].evalsha(keys, args))


def call_sync(redis: SyncRedis, command: tuple[Any, ...]) -> Any:
    """`call` for a synchronous client: one command (a script's call reloaded after a NOSCRIPT)."""
    try:
        try:
            return redis.execute_command(*command)
        except NoScriptError:
            pipe = redis.pipeline(transaction=False)
            for source in SCRIPTS.values():
                pipe.script_load(source.source)
            pipe.execute()
            return redis.execute_command(*command)
    except CLIENT_ERRORS as exc:
        raise translate(exc) from exc


# ---------------------------------------------------------------- streams and groups
async def ensure_group(redis: Redis, stream: str, group: str) -> None:
    """Create `group` on `stream` (and the stream) unless it exists."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise translate(exc) from exc
    except CLIENT_ERRORS as exc:
        raise translate(exc) from exc
