"""The one script runner (over `RedisClient`): every Lua call and pipelined command list goes out
through `execute` (a call whose function the server lacks, NOSCRIPT here, answered by loading the
library and sending those calls again; a replication `WAIT` where `require_replicas` asks for it),
`call`/`script` for one, `call_sync` from sync code. Split from `omniflow.storage.client`, which
owns the connection and the error mapping."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from omniflow.errors import RedisUnavailable, ScriptError
from omniflow.storage.client import CLIENT_ERRORS, RedisClient, ReplyError, boundary, is_refused, translate
from omniflow.storage.sync_client import SyncRedisClient
from omniflow.storage.scripts import LIBRARY, SCRIPTS
from omniflow.storage.topology import is_cluster


async def ensure_group(redis: RedisClient, stream: str, group: str) -> None:
    """Create `group` on `stream` (and the stream) unless it exists."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ScriptError as exc:          # (a reply error of any other kind is raised as it is)
        if "BUSYGROUP" not in str(exc):
            raise


# ---------------------------------------------------------------- the script runner
async def load_scripts(client: RedisClient) -> None:
    """FUNCTION LOAD REPLACE the library (idempotent; on a cluster, every primary). Called at start
    and after a call found its function missing (a restart without persistence, FUNCTION FLUSH)."""
    with boundary():
        await cast(Any, client.raw).function_load(LIBRARY, replace=True)


async def execute(redis: RedisClient, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Send `commands` in one round trip; each reply in place, an error as its translated class.

    Functions missing on the server (NOSCRIPT) are loaded and those calls sent again. Raises
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


_HEARTBEAT = SCRIPTS["heartbeat"].function


def require_replicas(client: RedisClient, replicas: int, timeout_ms: int) -> None:
    """Make every round trip of `client` that writes wait until `replicas` replicas have its writes
    (`WAIT`, in the same pipeline: one wait per round trip, whatever it carries; on a cluster one
    per primary the round trip touched). A round trip not replicated in time counts as lost
    (`RedisUnavailable`): its writes may or may not survive a failover, and every transition is
    idempotent, so the caller's retry is safe. 0 replicas: no wait (asynchronous replication)."""
    client.omniflow_wait = (replicas, timeout_ms) if replicas > 0 else None


def _first_key(cmd: tuple[Any, ...]) -> Any:
    return cmd[3] if str(cmd[0]).upper() in ("FCALL", "FCALL_RO", "EVALSHA", "EVAL") else cmd[1]


def _needs_replicas(cmd: tuple[Any, ...]) -> bool:
    name = str(cmd[0]).split(" ", 1)[0].upper()
    # a lease renewal is not state to keep: waiting on it would let leases lapse while a replica is away
    return name not in READ_ONLY and not (name == "FCALL" and cmd[1] == _HEARTBEAT)


async def _send(client: RedisClient, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    wait = client.omniflow_wait
    if wait is not None and any(_needs_replicas(c) for c in commands):
        return await _send_replicated(client, commands, *wait)
    lean = client.lean
    try:
        if lean is not None:                # a standalone server: `omniflow.storage.resp`, replies as redis-py's
            results = await lean.send(commands)
        elif len(commands) == 1:
            try:
                return [await cast(Any, client.raw).execute_command(*commands[0])]
            except ReplyError as exc:         # in place, like a pipeline
                return [translate(exc)]
        else:
            pipe = client.raw.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            results = await pipe.execute(raise_on_error=False)
    except CLIENT_ERRORS as exc:
        raise translate(exc) from exc
    return [translate(r) if isinstance(r, Exception) else r for r in results]


async def _send_replicated(client: RedisClient, commands: Sequence[tuple[Any, ...]], replicas: int,
                           timeout_ms: int) -> list[Any]:
    """`_send` followed by WAIT on every primary it wrote to, in the same round trip (on a
    connection of its own: WAIT holds the connection until the replicas answer)."""
    redis: Any = client.raw
    lean = client.lean
    try:
        if lean is not None:
            results = await lean.send([*commands, ("WAIT", replicas, timeout_ms)], exclusive=True)
        else:
            pipe = redis.pipeline(transaction=False)
            for cmd in commands:
                pipe.execute_command(*cmd)
            if is_cluster(redis):
                await redis.initialize()        # the slot map (a no-op once the client knows it)
                nodes = {}
                for cmd in commands:
                    node = redis.get_node_from_key(_first_key(cmd))
                    if node is not None:        # a slot without a primary: the round trip fails on its own
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


async def call(redis: RedisClient, *command: Any) -> Any:
    """One command (a missing function loaded); its reply, or its translated error raised."""
    (result,) = await execute(redis, [command])
    if isinstance(result, Exception):
        raise result
    return result


async def script(redis: RedisClient, name: str, keys: list[str], args: list[Any]) -> Any:
    """Call one registered script by name with hand-built KEYS (tests and debugging only: library
    code builds its calls in `omniflow.storage.transitions`)."""
    return await call(redis, *SCRIPTS[name].fcall(keys, args))


def call_sync(client: SyncRedisClient, command: tuple[Any, ...]) -> Any:
    """`call` for a synchronous client: one command (sent again after loading the library when its
    function was missing)."""
    redis = client.raw
    try:
        try:
            return cast(Any, redis).execute_command(*command)
        except ReplyError as exc:
            if not is_refused(translate(exc), "NOSCRIPT"):
                raise
            redis.function_load(LIBRARY, replace=True)
            return cast(Any, redis).execute_command(*command)
    except CLIENT_ERRORS as exc:
        raise translate(exc) from exc


