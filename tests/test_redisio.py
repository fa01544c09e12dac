"""The Redis boundary: the one error mapping (pure), the script runner and the group commit's
handling of refusals (against the session's real server)."""
from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ConnectionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    ResponseError,
    TimeoutError,
)

from omniflow.storage import redisio
from omniflow.storage.batcher import Batcher
from omniflow.storage.transitions.reconcile import dead_letter
from omniflow.errors import AdmissionRefused, ConfigError, RedisRefused, RedisUnavailable, ScriptError
from omniflow.client.store import Store

from helpers import eventually, request


@pytest.mark.parametrize(("raised", "cls", "refusal"), [
    (ConnectionError("Connection reset by peer"), RedisUnavailable, None),
    (TimeoutError("Timeout reading from socket"), RedisUnavailable, None),
    (ConnectionRefusedError(111, "Connection refused"), RedisUnavailable, None),
    (OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), RedisRefused, "OOM"),
    (ReadOnlyError("You can't write against a read only replica."), RedisRefused, "READONLY"),
    (BusyLoadingError("Valkey is loading the dataset in memory"), RedisRefused, "LOADING"),
    (ResponseError("BUSY Valkey is busy running a script."), RedisRefused, "BUSY"),
    (ResponseError("MASTERDOWN Link with MASTER is down"), RedisRefused, "MASTERDOWN"),
    (NoScriptError("No matching script."), RedisRefused, "NOSCRIPT"),
    (ResponseError("Function not found"), RedisRefused, "NOSCRIPT"),       # an FCALL before the library's load
    (ResponseError("emit: unknown op Z (nothing written)"), ScriptError, None),
    (ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), ScriptError, None),
    (AuthenticationError("invalid password"), ConfigError, None),
])
def test_one_error_mapping(raised: BaseException, cls: type, refusal: str | None) -> None:
    err = redisio.translate(raised)
    assert type(err) is cls
    if refusal is not None:
        assert isinstance(err, RedisRefused) and err.refusal == refusal
    assert isinstance(err, RedisRefused) == (refusal is not None)


def test_a_bad_url_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="OMNIFLOW_REDIS_URL: 'notaurl'"):
        redisio.connect("notaurl")


async def test_a_pooled_connection_with_an_unasked_reply_or_closed_is_replaced(valkey_url) -> None:
    """The pool's check of a connection it hands out is made without a loop turn
    (`topology.FastPacking.can_read_destructive`): a connection holding a reply nobody read, or one
    the server closed, is still never handed to the next command."""
    redis, admin = redisio.connect(valkey_url), redisio.connect(valkey_url)
    raw = redis.raw
    try:
        await raw.ping()
        pool = raw.connection_pool
        conn = await pool.get_connection()
        await conn.send_command("ECHO", "stale")          # its reply is never read
        await eventually(lambda: conn._parser._stream._buffer or conn._parser._reader.has_data())
        assert await conn.can_read_destructive()
        await pool.release(conn)
        assert await raw.echo("fresh") == b"fresh"
        conn = await pool.get_connection()
        assert not await conn.can_read_destructive()
        await conn.send_command("CLIENT", "ID")
        conn_id = await conn.read_response()
        await pool.release(conn)
        await admin.raw.execute_command("CLIENT", "KILL", "ID", conn_id)       # the server closes it
        await eventually(lambda: conn._parser._stream._eof)
        assert await raw.echo("again") == b"again"
    finally:
        await redis.aclose()
        await admin.aclose()


async def test_the_script_runner_reloads_after_a_flush_and_returns_errors_in_place(valkey_url) -> None:
    redis = redisio.connect(valkey_url)
    try:
        await redis.set("t-redisio:str", "v")
        await redis.script_flush()
        call = dead_letter("t-redisio:dlq", "t-redisio:src", "", "0-1", {b"a": b"1"}, "why", max_len=10)
        results = await redisio.execute(redis, [call, ("HGET", "t-redisio:str", "x")])
        assert results[0] == 1                                        # loaded and sent again
        assert isinstance(results[1], ScriptError)                    # WRONGTYPE, in place
        (_, entry), = await redis.xrange("t-redisio:dlq")
        assert entry[b"reason"] == b"why" and entry[b"a"] == b"1"
    finally:
        await redis.delete("t-redisio:dlq", "t-redisio:src", "t-redisio:str")
        await redis.aclose()


async def test_a_refused_write_waits_in_the_group_commit_and_a_refused_submit_is_busy(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        batcher = Batcher(eng.redis, refused_retry_s=30)
        store = Store(eng.redis, eng.settings, eng.pipeline, batcher=batcher)
        key = f"{eng.settings.prefix}:held"
        await eng.redis.config_set("maxmemory", 1)
        try:
            held = batcher.send("XADD", key, "*", "f", "v")
            await eventually(lambda: batcher.refusals >= 1, timeout_s=10, what="the held write sent again")
            with pytest.raises(AdmissionRefused, match="out of memory"):
                # refused at once, never held, nor queued behind the held write (its own round trip)
                await asyncio.wait_for(store.submit(request("no room")), batcher.refused_retry_s / 2)
            # the held write was sent again and refused again (twice): it outlived refusals, still waiting
            await eventually(lambda: batcher.refusals >= 3, timeout_s=10, what="two resends of the held write refused")
            assert not held.done()                                    # still waiting, not failed
        finally:
            await eng.redis.config_set("maxmemory", 0)
        assert await asyncio.wait_for(held, 10)                       # written once the server takes it
        assert await eng.redis.xlen(key) == 1
        assert batcher.refusals > 0


async def test_a_refusal_outlasting_the_patience_fails_the_write(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        batcher = Batcher(eng.redis, refused_retry_s=0.2)
        await eng.redis.config_set("maxmemory", 1)
        try:
            with pytest.raises(RedisRefused):
                await batcher.call("XADD", f"{eng.settings.prefix}:never", "*", "f", "v")
        finally:
            await eng.redis.config_set("maxmemory", 0)


async def test_the_client_translates_errors_of_commands_and_pipelines(valkey_url) -> None:
    """`RedisClient` is the boundary: a command or a pipeline that fails raises `omniflow.errors`,
    never a redis-py error; a server that is not there is `RedisUnavailable` already at `connect`."""
    redis = redisio.connect(valkey_url)
    try:
        await redis.set("t-client:str", "v")
        with pytest.raises(ScriptError, match="WRONGTYPE"):
            await redis.hget("t-client:str", "f")
        pipe = redis.pipeline()
        pipe.hget("t-client:str", "f")
        with pytest.raises(ScriptError, match="WRONGTYPE"):
            await pipe.execute()
        pipe = redis.pipeline()
        pipe.get("t-client:str").hget("t-client:str", "f")
        got, err = await pipe.execute(raise_on_error=False)
        assert got == b"v" and "WRONGTYPE" in str(err)
    finally:
        await redis.delete("t-client:str")
        await redis.aclose()
    with pytest.raises(RedisUnavailable):
        redisio.connect("redis://127.0.0.1:1/0")


async def test_the_leader_lease_is_taken_renewed_and_held_in_one_step(valkey_url) -> None:
    from omniflow.storage.keys import Keys
    from omniflow.storage.transitions.housekeeping import LeaseResult, lease_code, leader_lease

    redis, keys = redisio.connect(valkey_url), Keys("t-lease")
    try:
        await redis.delete(keys.leader)
        assert lease_code(await redisio.call(redis, *leader_lease(keys, "a", ttl_ms=60_000))) is LeaseResult.TAKEN
        await redis.pexpire(keys.leader, 1_000)
        assert lease_code(await redisio.call(redis, *leader_lease(keys, "a", ttl_ms=60_000))) is LeaseResult.RENEWED
        assert await redis.pttl(keys.leader) > 1_000              # renewed: the new ttl
        assert lease_code(await redisio.call(redis, *leader_lease(keys, "b", ttl_ms=60_000))) is LeaseResult.HELD
        assert await redis.get(keys.leader) == b"a"
    finally:
        await redis.delete(keys.leader)
        await redis.aclose()
