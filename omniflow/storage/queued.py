"""Commands queued for one round trip (`RedisClient.pipeline`), with redis-py's signatures: the
queue itself, without redis-py (the client that makes it sends it and translates its errors)."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


def _queues(name: str) -> Callable[..., Pipeline]:
    """A `Pipeline` method that queues redis-py's `name` command and returns the pipeline."""
    def queue(self: Pipeline, *args: Any, **kwargs: Any) -> Pipeline:
        getattr(self._pipe, name)(*args, **kwargs)
        return self

    queue.__name__ = queue.__qualname__ = name
    return queue


class Pipeline:
    """Commands queued for one round trip (`RedisClient.pipeline`): each method queues one command
    (redis-py's signature) and returns the pipeline; `execute` sends them, errors translated."""

    __slots__ = ("_execute", "_pipe")

    def __init__(self, pipe: Any, execute: Callable[[Any, bool], Awaitable[list[Any]]]) -> None:
        self._pipe = pipe            # redis-py's pipeline
        self._execute = execute      # the client's: sends it, errors translated

    async def execute(self, *, raise_on_error: bool = True) -> list[Any]:
        return await self._execute(self._pipe, raise_on_error)

    # each queues redis-py's command of the same name (its signature) and returns the pipeline
    execute_command = _queues("execute_command")
    hmget = _queues("hmget")
    echo = _queues("echo")
    hset = _queues("hset")
    hget = _queues("hget")
    hgetall = _queues("hgetall")
    xread = _queues("xread")
    hincrby = _queues("hincrby")
    hsetnx = _queues("hsetnx")
    hkeys = _queues("hkeys")
    hdel = _queues("hdel")
    xlen = _queues("xlen")
    xrange = _queues("xrange")
    xrevrange = _queues("xrevrange")
    xadd = _queues("xadd")
    xdel = _queues("xdel")
    xack = _queues("xack")
    xpending = _queues("xpending")
    xinfo_groups = _queues("xinfo_groups")
    xautoclaim = _queues("xautoclaim")
    xtrim = _queues("xtrim")
    expire = _queues("expire")
    pexpire = _queues("pexpire")
    zrem = _queues("zrem")
    zrangebyscore = _queues("zrangebyscore")
    zrevrangebyscore = _queues("zrevrangebyscore")
    zremrangebyscore = _queues("zremrangebyscore")
    zrange = _queues("zrange")
    zrevrange = _queues("zrevrange")
    zcount = _queues("zcount")
    zcard = _queues("zcard")
    zscore = _queues("zscore")
    zadd = _queues("zadd")
    unlink = _queues("unlink")
    delete = _queues("delete")
    smembers = _queues("smembers")
    srem = _queues("srem")
    sadd = _queues("sadd")
    rpush = _queues("rpush")
    ltrim = _queues("ltrim")
    lrange = _queues("lrange")
    exists = _queues("exists")
    get = _queues("get")
    set = _queues("set")
    mget = _queues("mget")
    incr = _queues("incr")
