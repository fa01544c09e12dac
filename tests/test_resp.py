"""The lean transport (`omniflow.storage.resp`) against a real server: its replies and errors are
redis-py's, a lost connection fails what waits on it and the next command connects again, and a
caller cancelled mid-command never makes another read the wrong reply."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import BusyLoadingError, NoScriptError, OutOfMemoryError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from omniflow.errors import ConfigError, RedisRefused, RedisUnavailable, ScriptError
from omniflow.ops.embedded import EmbeddedServer, free_port
from omniflow.storage import redisio, runner
from omniflow.storage.client import RedisClient
from omniflow.storage.resp import Transport, _checked, _Conn
from omniflow.storage.topology import FastConnection

from helpers import eventually

LIB = """#!lua name=t_resp
redis.register_function('t_resp_table', function(keys, args)
  return {1, 'two', {3, 'four', {}}, redis.call('HGETALL', keys[1]), false}
end)
redis.register_function('t_resp_error', function() return redis.error_reply('ERR t_resp: no') end)
redis.register_function('t_resp_nested_error', function() return {1, redis.error_reply('OOM inside')} end)
"""


@pytest.fixture
async def lean(valkey_url: str) -> Any:
    client = redisio.connect(valkey_url)
    assert client.lean is not None                 # a standalone server: the lean transport
    await client.raw.function_load(LIB, replace=True)
    try:
        yield client
    finally:
        await client.raw.function_delete("t_resp")
        await client.aclose()


async def _both(client: RedisClient, commands: list[tuple[Any, ...]]) -> tuple[list[Any], list[Any]]:
    """The same commands through the lean transport and through redis-py's pipeline."""
    assert client.lean is not None
    mine = await client.lean.send(commands)
    pipe = client.raw.pipeline(transaction=False)
    for cmd in commands:
        pipe.execute_command(*cmd)
    theirs = await pipe.execute(raise_on_error=False)
    return mine, theirs


def _plain(reply: Any) -> Any:
    """A reply with each error (nested ones too) as its class and message, comparable with =="""
    if isinstance(reply, Exception):
        return type(reply), str(reply)
    if isinstance(reply, list):
        return [_plain(r) for r in reply]
    return type(reply), reply


def _same(mine: list[Any], theirs: list[Any]) -> None:
    assert [_plain(r) for r in mine] == [_plain(r) for r in theirs]


async def test_replies_are_redis_pys(lean: RedisClient) -> None:
    k = "t-resp:reply"
    await lean.delete(f"{k}:h", f"{k}:s", f"{k}:z", f"{k}:str")
    await lean.hset(f"{k}:h", mapping={"a": "1", "b": "2"})
    await lean.xadd(f"{k}:s", {"f": "v", "g": "w"})
    await lean.zadd(f"{k}:z", {"m": 1.5, "n": 2})
    await lean.set(f"{k}:str", "v")
    reads = [("FCALL", "t_resp_table", 1, f"{k}:h"), ("FCALL", "t_resp_error", 0), ("FCALL", "t_resp_nested_error", 0),
             ("HGETALL", f"{k}:h"), ("HGETALL", f"{k}:missing"), ("HMGET", f"{k}:h", "a", "zz"), ("GET", f"{k}:str"),
             ("GET", f"{k}:missing"), ("PING",), ("XRANGE", f"{k}:s", "-", "+"), ("XREAD", "STREAMS", f"{k}:s", "0-0"),
             ("XREAD", "COUNT", 1, "STREAMS", f"{k}:s", f"{k}:missing", "0-0", "0-0"), ("ZSCORE", f"{k}:z", "m"),
             ("ZRANGE", f"{k}:z", 0, -1, "WITHSCORES"), ("HGET", f"{k}:str", "f"), ("EXISTS", f"{k}:h", f"{k}:str"),
             ("TTL", f"{k}:h"), ("SMEMBERS", f"{k}:missing"), ("xrange", f"{k}:s", "-", "+"), (b"HGETALL", f"{k}:h")]
    mine, theirs = await _both(lean, reads)
    _same(mine, theirs)
    assert mine[0] == [1, b"two", [3, b"four", []], [b"a", b"1", b"b", b"2"], None]
    assert isinstance(mine[1], ResponseError) and isinstance(mine[14], ResponseError)      # in place
    assert isinstance(mine[2][1], OutOfMemoryError)         # an error inside a reply: redis-py's class, in place
    assert mine[3] == {b"a": b"1", b"b": b"2"} and mine[8] is True                          # the callbacks
    # writes, each on its own fresh key, so both clients see the same state
    for w in ("a", "b"):
        await lean.delete(f"{k}:w{w}", f"{k}:ws{w}")
    writes = [[("SET", f"{k}:w{w}", "1"), ("SET", f"{k}:w{w}", "1", "NX"), ("HSET", f"{k}:ws{w}", "f", "v"),
               ("EXPIRE", f"{k}:ws{w}", 100), ("INCR", f"{k}:w{w}"), ("DEL", f"{k}:w{w}"), ("XGROUP CREATE", f"{k}:ws{w}", "g", "0")]
              for w in ("a", "b")]
    transport = lean.lean
    assert transport is not None
    mine = await transport.send(writes[0])
    pipe = lean.raw.pipeline(transaction=False)
    for cmd in writes[1]:
        pipe.execute_command(*cmd)
    _same(mine, await pipe.execute(raise_on_error=False))
    await lean.delete(f"{k}:h", f"{k}:s", f"{k}:z", f"{k}:str", f"{k}:wsa", f"{k}:wsb")


async def test_stream_reads_are_redis_pys_blocking_or_not(lean: RedisClient) -> None:
    k = "t-resp:xread"
    await lean.delete(f"{k}:a", f"{k}:b")
    raw = lean.raw
    # nothing there: XREAD BLOCK times out (nil), which redis-py makes []
    assert await lean.xread({f"{k}:a": "$"}, count=1, block=30) == await raw.xread({f"{k}:a": "$"}, count=1, block=30) == []
    assert await lean.xread({f"{k}:a": "0-0"}) == await raw.xread({f"{k}:a": "0-0"}) == []
    first = await lean.xadd(f"{k}:a", {"f": "v"})
    await lean.xadd(f"{k}:b", {"g": "w"})
    streams = {f"{k}:a": "0-0", f"{k}:b": "0-0"}
    assert await lean.xread(streams, count=10, block=100) == await raw.xread(streams, count=10, block=100)
    assert await lean.xread(streams) == await raw.xread(streams) == [
        [f"{k}:a".encode(), [(first, {b"f": b"v"})]], [f"{k}:b".encode(), [(ANY, {b"g": b"w"})]]]
    # groups (one per client on the same stream): a new entry, then nothing (BLOCK times out), then it again
    await lean.xgroup_create(f"{k}:a", "mine", id="0")
    await raw.xgroup_create(f"{k}:a", "theirs", id="0")
    got = await lean.xreadgroup("mine", "c", {f"{k}:a": ">"}, count=5, block=50)
    assert got == await raw.xreadgroup("theirs", "c", {f"{k}:a": ">"}, count=5, block=50)
    assert got == [[f"{k}:a".encode(), [(first, {b"f": b"v"})]]]
    assert await lean.xreadgroup("mine", "c", {f"{k}:a": ">"}, count=5, block=30) == \
        await raw.xreadgroup("theirs", "c", {f"{k}:a": ">"}, count=5, block=30) == []
    assert await lean.xreadgroup("mine", "c", {f"{k}:a": "0"}, noack=True) == \
        await raw.xreadgroup("theirs", "c", {f"{k}:a": "0"}, noack=True) == got
    with pytest.raises(ScriptError, match="NOGROUP"):
        await lean.xreadgroup("nogroup", "c", {f"{k}:a": ">"}, block=10)
    with pytest.raises(ScriptError, match="bad command arguments"):     # redis-py's own checks
        await lean.xread({}, block=10)
    await lean.delete(f"{k}:a", f"{k}:b")


class _Any:
    def __eq__(self, other: object) -> bool:
        return True


ANY = _Any()


async def test_a_pipeline_that_blocks_holds_a_connection_of_its_own(lean: RedisClient) -> None:
    """`pipeline(blocking=True)`: a blocking XREAD and the reads queued after it, answered together
    once the XREAD is served (what `Store.wait` does: the document in the same round trip as the
    end it waited for); meanwhile the client's other commands go on, on the shared connection."""
    k = "t_resp:blocking"
    await lean.raw.delete(f"{k}:done", f"{k}:rec")
    pipe = lean.pipeline(blocking=True)
    pipe.xread({f"{k}:done": "0-0"}, count=1, block=5_000)
    pipe.hgetall(f"{k}:rec")
    waiting = asyncio.ensure_future(pipe.execute())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    # the shared connection is free: a script call and a pipeline go through while the read blocks
    assert await runner.call(lean, "HSET", f"{k}:rec", "state", "completed") == 1
    assert await lean.pipeline().hget(f"{k}:rec", "state").execute() == [b"completed"]
    await runner.call(lean, "XADD", f"{k}:done", "*", "state", "completed")
    ended, rec = await asyncio.wait_for(waiting, 5)
    assert ended[0][0] == f"{k}:done".encode() and ended[0][1][0][1] == {b"state": b"completed"}
    assert rec == {b"state": b"completed"}
    # a block that times out: the empty read, and the reads after it all the same
    pipe = lean.pipeline(blocking=True)
    pipe.xread({f"{k}:never": "0-0"}, count=1, block=20)
    pipe.hgetall(f"{k}:rec")
    assert await pipe.execute() == [[], {b"state": b"completed"}]
    await lean.raw.delete(f"{k}:done", f"{k}:rec")


async def test_an_error_in_a_pipeline_stays_in_place_and_is_translated(lean: RedisClient) -> None:
    k = "t-resp:pipe"
    await lean.set(f"{k}:str", "v")
    results = await runner.execute(lean, [("SET", f"{k}:a", "1"), ("HGET", f"{k}:str", "f"), ("FCALL", "t_resp_error", 0),
                                          ("GET", f"{k}:a")])
    assert results[0] is True and results[3] == b"1"
    assert isinstance(results[1], ScriptError) and "WRONGTYPE" in str(results[1])
    assert isinstance(results[2], ScriptError) and "t_resp: no" in str(results[2])
    with pytest.raises(ScriptError, match="t_resp: no"):
        await runner.call(lean, "FCALL", "t_resp_error", 0)
    # RedisClient.pipeline(): redis-py's callbacks with their options, and its first error's wording
    await lean.zadd(f"{k}:z", {"m": 1.5})
    pipe = lean.pipeline()
    pipe.zrange(f"{k}:z", 0, -1, withscores=True).hget(f"{k}:str", "f").xrevrange(f"{k}:none", count=1).hgetall(f"{k}:no")
    mine = await pipe.execute(raise_on_error=False)
    theirs = await lean.raw.pipeline().zrange(f"{k}:z", 0, -1, withscores=True).hget(f"{k}:str", "f") \
        .xrevrange(f"{k}:none", count=1).hgetall(f"{k}:no").execute(raise_on_error=False)
    _same(mine, theirs)
    assert mine[0] == [(b"m", 1.5)] and mine[2] == [] and mine[3] == {}
    with pytest.raises(ScriptError) as caught:
        await lean.pipeline().get(f"{k}:a").hget(f"{k}:str", "f").execute()
    with pytest.raises(ResponseError) as raw_caught:
        await lean.raw.pipeline().get(f"{k}:a").hget(f"{k}:str", "f").execute()
    assert str(caught.value) == str(redisio.translate(raw_caught.value))
    assert "Command # 2 (HGET t-resp:pipe:str f) of pipeline caused error" in str(caught.value)
    assert await lean.pipeline().execute() == []
    await lean.delete(f"{k}:str", f"{k}:a", f"{k}:z")


async def test_concurrent_callers_share_the_connection_in_order(lean: RedisClient) -> None:
    replies = await asyncio.gather(*(runner.execute(lean, [("ECHO", f"m{i}")] * (1 + i % 3)) for i in range(200)))
    assert replies == [[f"m{i}".encode()] * (1 + i % 3) for i in range(200)]


async def _client_id(client: RedisClient) -> int:
    assert client.lean is not None
    (conn_id,) = await client.lean.send([("CLIENT", "ID")])
    return int(conn_id)


async def test_a_killed_connection_fails_what_waits_and_the_next_command_reconnects(lean: RedisClient,
                                                                                     valkey_url: str) -> None:
    admin = redisio.connect(valkey_url)
    try:
        conn_id = await _client_id(lean)
        assert lean.lean is not None
        blocked = asyncio.ensure_future(lean.lean.send([("BLPOP", "t-resp:never", 10)]))   # holds the connection
        behind = asyncio.ensure_future(runner.execute(lean, [("PING",)]))                   # waits behind it
        await eventually(lambda: _blocked_clients(admin), what="the BLPOP blocked")
        await admin.execute_command("CLIENT", "KILL", "ID", conn_id)
        with pytest.raises(RedisConnectionError):
            await blocked
        with pytest.raises(RedisUnavailable):
            await behind
        assert await runner.execute(lean, [("PING",)]) == [True]           # connected again
        assert await _client_id(lean) != conn_id
    finally:
        await admin.aclose()


async def _blocked_clients(admin: RedisClient) -> bool:
    return int((await admin.info("clients"))["blocked_clients"]) > 0


async def test_a_server_restart_is_unavailable_then_served_again(tmp_path: Path) -> None:
    server = EmbeddedServer(data_dir=tmp_path, appendonly=False).start()
    client = redisio.connect(server.url)
    try:
        assert await runner.execute(client, [("SET", "k", "v")]) == [True]
        await asyncio.to_thread(server.kill)
        with pytest.raises(RedisUnavailable):           # the EOF, or refused when it connects again
            await runner.execute(client, [("GET", "k")])
        with pytest.raises(RedisUnavailable, match="Connection refused|connecting to"):
            await runner.execute(client, [("GET", "k")])
        with pytest.raises(RedisUnavailable):
            await client.xread({"s": "0-0"}, block=10)
        await asyncio.to_thread(server.start)
        assert await runner.execute(client, [("GET", "k")]) == [None]         # no persistence: gone, but served
        assert await client.xread({"s": "0-0"}, block=10) == []
    finally:
        await client.aclose()
        server.stop()


async def test_a_cancelled_command_never_shifts_the_replies(lean: RedisClient, valkey_url: str) -> None:
    k = "t-resp:cancel"
    await lean.delete(k, f"{k}:list")
    # a blocking read cancelled (a shutdown): its connection is closed, the next reads are right
    reading = asyncio.ensure_future(lean.xread({k: "$"}, count=1, block=5000))
    admin = redisio.connect(valkey_url)
    try:
        await eventually(lambda: _blocked_clients(admin), what="the XREAD blocked")
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        await eventually(lambda: _no_blocked_clients(admin), what="the cancelled XREAD's connection closed")
        entry = await lean.xadd(k, {"f": "v"})
        assert await lean.xread({k: "0-0"}, count=1, block=100) == [[k.encode(), [(entry, {b"f": b"v"})]]]
        assert await lean.get(k + ":missing") is None
        # a caller cancelled on the shared connection: its reply is read and dropped
        assert lean.lean is not None
        waiting = asyncio.ensure_future(lean.lean.send([("BLPOP", f"{k}:list", 0.3)]))
        await eventually(lambda: _blocked_clients(admin), what="the BLPOP blocked")
        waiting.cancel()
        assert await runner.execute(lean, [("ECHO", "after")]) == [b"after"]
        await lean.raw.rpush(f"{k}:list", "x")
        assert await runner.execute(lean, [("LPOP", f"{k}:list")]) == [b"x"]
    finally:
        await admin.aclose()
        await lean.delete(k, f"{k}:list")


async def _no_blocked_clients(admin: RedisClient) -> bool:
    return int((await admin.info("clients"))["blocked_clients"]) == 0


async def test_credentials_and_database_come_from_the_url(lean: RedisClient, valkey_url: str) -> None:
    host = valkey_url.split("//")[1].split("/")[0]
    await lean.execute_command("ACL", "SETUSER", "t_resp_user", "on", ">s3cret", "~*", "+@all")
    client = RedisClient(Redis.from_url(f"redis://t_resp_user:s3cret@{host}/3", connection_class=FastConnection))
    wrong = RedisClient(Redis.from_url(f"redis://t_resp_user:nope@{host}/0", connection_class=FastConnection))
    try:
        assert client.lean is not None
        assert await runner.execute(client, [("SET", "t-resp:db3", "v"), ("ACL", "WHOAMI")]) == [True, b"t_resp_user"]
        assert await lean.get("t-resp:db3") is None                          # not in db 0
        assert await client.raw.get("t-resp:db3") == b"v"                   # where redis-py finds it
        info = (await runner.execute(client, [("CLIENT", "INFO")]))[0]
        assert b"lib-name=redis-py" in info and b"db=3" in info
        with pytest.raises(ConfigError):
            await runner.execute(wrong, [("PING",)])
        with pytest.raises(ConfigError):                                   # the same as redis-py's own
            await wrong.get("x")
    finally:
        await client.raw.delete("t-resp:db3")
        await client.aclose()
        await wrong.aclose()
        await lean.execute_command("ACL", "DELUSER", "t_resp_user")


async def test_writes_wait_for_replicas_on_a_connection_of_their_own(lean: RedisClient) -> None:
    runner.require_replicas(lean, 1, 20)          # the session's server has no replica: never confirmed
    try:
        results = await runner.execute(lean, [("SET", "t-resp:wait", "v"), ("GET", "t-resp:wait")])
        assert all(isinstance(r, RedisUnavailable) and "not confirmed by 1 replica" in str(r) for r in results)
        assert await runner.execute(lean, [("GET", "t-resp:wait")]) == [b"v"]      # reads never wait
    finally:
        runner.require_replicas(lean, 0, 0)
        await lean.delete("t-resp:wait")


@pytest.mark.skipif(not shutil.which("openssl") or not shutil.which("redis-server"), reason="needs openssl and redis-server")
async def test_a_rediss_url_is_served_over_tls(tmp_path: Path) -> None:
    """rediss://: the lean connections speak TLS with redis-py's context (its CA, its hostname check)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    tls_port = free_port()
    server = EmbeddedServer(data_dir=tmp_path / "data", appendonly=False, binary=shutil.which("redis-server"),
                            extra_args=["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file",
                                        str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"])
    try:
        await asyncio.to_thread(server.start)
    except Exception as exc:  # noqa: BLE001 - a redis-server built without TLS
        pytest.skip(f"redis-server without TLS: {exc}")
    client = redisio.connect(f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}")
    try:
        assert client.lean is not None
        assert await runner.execute(client, [("SET", "k", "v"), ("GET", "k")]) == [True, b"v"]
        await client.xadd("s", {"f": "v"})
        assert (await client.xread({"s": "0-0"}, block=50))[0][0] == b"s"
        assert await client.pipeline().get("k").hgetall("none").execute() == [b"v", {}]
        plain = RedisClient(Redis.from_url(f"redis://127.0.0.1:{tls_port}/0", connection_class=FastConnection))
        with pytest.raises(RedisUnavailable):           # TLS only on that port
            await runner.execute(plain, [("PING",)])
        await plain.aclose()
    finally:
        await client.aclose()
        server.stop()


def test_cluster_and_sentinel_clients_stay_on_redis_py() -> None:
    assert Transport.for_client(Redis.from_url("redis://127.0.0.1:1/0", connection_class=FastConnection)) is not None
    assert Transport.for_client(Redis.from_url("rediss://127.0.0.1:1/0", connection_class=FastConnection)) is not None
    assert Transport.for_client(Redis.from_url("unix:///tmp/none.sock")) is None
    assert Transport.for_client(Redis.from_url("redis://127.0.0.1:1/0?socket_timeout=1",
                                               connection_class=FastConnection)) is None
    assert Transport.for_client(Redis.from_url("redis://127.0.0.1:1/0", protocol=3, connection_class=FastConnection)) is None
    assert Transport.for_client(object()) is None


class _Wire:
    """A transport that takes writes and is never closing (replies are fed by hand)."""

    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        return None


@pytest.mark.parametrize(("line", "cls", "raised"), [
    (b"-OOM command not allowed when used memory > 'maxmemory'.", OutOfMemoryError, False),
    (b"-READONLY You can't write against a read only replica.", ReadOnlyError, False),
    (b"-NOSCRIPT No matching script.", NoScriptError, False),
    (b"-BUSYGROUP Consumer Group name already exists", ResponseError, False),
    (b"-LOADING Valkey is loading the dataset in memory", BusyLoadingError, True),      # redis-py raises it
    (b"-ERR max number of clients reached", RedisConnectionError, True),
])
async def test_error_replies_are_redis_pys_classes(line: bytes, cls: type, raised: bool) -> None:
    conn = _Conn(asyncio.get_running_loop(), "nowhere:0")
    conn.connection_made(_Wire())             # type: ignore[arg-type]
    future = conn.send(b"*1\r\n$4\r\nPING\r\n", 2)
    conn.data_received(b"+OK\r\n" + line + b"\r\n")
    replies = await future
    assert type(replies[1]) is cls and replies[0] == b"OK"
    if raised:
        with pytest.raises(cls):
            _checked(replies)
    else:
        assert _checked(replies) is replies
        assert isinstance(redisio.translate(replies[1]), RedisRefused | ScriptError)
