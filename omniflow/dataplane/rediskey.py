"""Redis-key transport: the payload in its own key with a TTL, the entry holds a reference.

For medium payloads and every cross-host case. The key carries the workflow's cell hash tag
(`<cell>:wf:<id>:blob:<src>:<dst>:<attempt>:<seq>`, see `omniflow.storage.keys`) and is listed in
the workflow's `<cell>:wf:<id>:blobs` set, so the workflow's terminal releases it; its TTL is
at least the longest workflow deadline, so a retry can replay it while the workflow lives.

Compared with an inline payload, Redis holds the bytes once (the edge entry and the inbox copy
hold only the reference) and the AOF logs them once.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.dataplane import codec
from omniflow.dataplane.base import ForeignReference, PayloadMissing, PutContext, Ref, Transport, TransportKind
from omniflow.storage.keys import Keys
from omniflow.storage.redisio import boundary

Command = tuple[Any, ...]


class RedisTransport(Transport):
    """Payload frames in TTL'd Redis keys under the workflow's hash tag."""

    kind = TransportKind.REDIS

    def __init__(self, redis: RedisClient, keys: Keys, *, full_checksum: bool = False) -> None:
        self.redis = redis
        self.keys = keys
        self.full_checksum = full_checksum

    def put_commands(self, payload: Any, ctx: PutContext) -> tuple[Ref, list[Command]]:
        """The reference, and the commands that store the payload (send them before the entry that
        holds the reference, on the same connection: e.g. queued on the worker's batcher)."""
        ttl_ms = max(1, int(ctx.ttl_s * 1000))
        frame = codec.encode_frame(payload, owner=[ctx.wf_id, ctx.src, ctx.dst, ctx.attempt, ctx.seq, ctx.worker_id],
                                   expiry_ms=int(time.time() * 1000) + ttl_ms, full_checksum=self.full_checksum)
        key = self.keys.blob(ctx.wf_id, ctx.src, ctx.dst, ctx.attempt, ctx.seq)
        registry = self.keys.blobs(ctx.wf_id)
        commands: list[Command] = [("SET", key, frame.tobytes(), "PX", ttl_ms), ("SADD", registry, key),
                                   ("PEXPIRE", registry, ttl_ms)]
        return Ref(TransportKind.REDIS, key, frame.nbytes, frame.checksum), commands

    def put_op(self, payload: Any, ctx: PutContext) -> tuple[Ref, list[Any]]:
        """The reference, and the `emit.lua` op that stores the payload in the same atomic step as
        the entry that references it (`'B', key, {payload, ttl_ms}`: `transitions.emit.emit` declares the key)."""
        ref, commands = self.put_commands(payload, ctx)
        _set, key, blob, _px, ttl_ms = commands[0]
        return ref, ["B", key, [blob, ttl_ms]]

    async def put(self, payload: Any, ctx: PutContext) -> Ref:
        ref, commands = self.put_commands(payload, ctx)
        with boundary():
            pipe = self.redis.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            await pipe.execute()
        return ref

    def check(self, ref: Ref, wf_id: str | None) -> None:
        """Refuse a key outside our prefix (or outside workflow `wf_id`)."""
        if not self.keys.is_blob_of(ref.location, wf_id):
            raise ForeignReference(f"payload key {ref.location!r} is outside "
                                   f"{self.keys.blob_pattern(wf_id)}")

    async def get(self, ref: Ref, *, wf_id: str | None = None) -> Any:
        self.check(ref, wf_id)
        with boundary():
            blob = await self.redis.get(ref.location)
        if blob is None:
            raise PayloadMissing(f"payload key {ref.location} is gone (released, or expired after its TTL)")
        return codec.decode_frame(blob, nbytes=ref.nbytes, checksum=ref.checksum, what=f"payload key {ref.location}")

    async def release(self, refs: Sequence[Ref]) -> int:
        mine = [ref.location for ref in refs if ref.kind is TransportKind.REDIS]
        if not mine:
            return 0
        with boundary():
            pipe = self.redis.pipeline(transaction=False)
            for key in mine:        # one key per command: payloads of several cells are several slots
                pipe.unlink(key)
                pipe.srem(self.keys.registry_of_blob(key), key)
            replies = await pipe.execute()
        return sum(int(n) for n in replies[::2])

    async def release_workflow(self, wf_id: str) -> int:
        registry = self.keys.blobs(wf_id)
        with boundary():
            members = await self.redis.smembers(registry)
            pipe = self.redis.pipeline(transaction=False)
            if members:
                pipe.unlink(*members)
            pipe.unlink(registry)
            replies = await pipe.execute()
        return int(replies[0]) if members else 0
