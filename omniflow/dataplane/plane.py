"""The data plane of one process: its transports, the per-chunk choice, ownership and the sweep.

    plane = DataPlane(redis, settings, worker_id=worker.id)
    ref = await plane.put(tensor, plane.context(wf, "thinker", "talker", attempt, seq),
                          consumer_domain=replica_domain)
    field, value = ref_field(ref)                 # ("d", payload) inline, ("r", reference) otherwise
    ...
    payload = await plane.resolve(fields, wf_id=wf)   # consumer side, from the entry's fields
    await plane.release(consumed_refs)            # when the consuming session is done

A consumer's replica advertises its shared-memory domain (`plane.domain`); a producer that sees
the same domain may hand it segments, anything else goes through Redis.

A clean stop (`aclose`) frees what no one will read again and keeps the payloads of live workflows
in shared memory, for the next processes on this host (docs/architecture.md, "Clean stop").
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.config import ChecksumMode, DataPlaneMode, Settings
from omniflow.dataplane import codec
from omniflow.dataplane.base import PutContext, Ref, SharedMemoryRefused, TransportKind, UndecodablePayload, WrongHost
from omniflow.dataplane.inline import InlineTransport
from omniflow.dataplane.policy import choose_transport
from omniflow.dataplane.rediskey import Command, RedisTransport
from omniflow.dataplane.shm import shm_domain, ShmTransport, SweepReason, name_part, shm_available
from omniflow.dataplane.traffic import Traffic
from omniflow.storage.keys import Keys
from omniflow.storage.redisio import REDIS_ERRORS, translated

logger = logging.getLogger(__name__)

LIVE_STATES = frozenset({b"pending", b"running"})
STOP_SWEEP_TIMEOUT_S = 5.0      # a clean stop waits at most this long for its last sweep (Redis away: skipped)
INLINE_FIELD = "d"
REF_FIELD = "r"


def ref_field(ref: Ref) -> tuple[str, bytes]:
    """The chunk field that carries `ref` in an entry: `d` = the payload inline, `r` = a reference."""
    return (INLINE_FIELD, ref.data) if ref.kind is TransportKind.INLINE else (REF_FIELD, ref.pack())


class DataPlane:
    """The transports of one process and the policy that picks one for each chunk."""

    def __init__(self, redis: RedisClient, settings: Settings, *, worker_id: str = "") -> None:
        self.settings = settings
        self.keys = Keys(settings.prefix)
        self.redis = redis
        self.worker_id = worker_id
        full = settings.dataplane_checksum is ChecksumMode.FULL
        self.inline = InlineTransport()
        self.rediskey = RedisTransport(redis, self.keys, full_checksum=full)
        directory = settings.dataplane_shm_dir
        self.shm = ShmTransport(settings.prefix, directory=directory, full_checksum=full, worker_id=worker_id,
                                pool_bytes=settings.dataplane_shm_pool_bytes,
                                domain=shm_domain(directory, settings.host_id)) if shm_available(directory) else None
        self.domain = self.shm.domain if self.shm else ""
        self.ttl_s = settings.dataplane_ttl_s()
        # payloads of at most this many bytes go inline without asking `choose` (the common case)
        self.inline_upto = {DataPlaneMode.AUTO: settings.dataplane_inline_max_bytes,
                            DataPlaneMode.INLINE: sys.maxsize}.get(settings.dataplane_mode, -1)
        self.traffic = Traffic()        # what the producers of this process sent, by stage and transport
        # a consumer reports how far it read an edge every quarter of the producer's bound, in chunks
        # and in bytes (0: that bound is off); asked per chunk read (`SessionInputs._note_read`)
        max_chunks, max_bytes = settings.dataplane_edge_max_chunks, settings.dataplane_edge_max_bytes
        self.read_report_every = (max(1, max_chunks // 4) if max_chunks > 0 else 0,
                                  max(1, max_bytes // 4) if max_bytes > 0 else 0)

    def context(self, wf_id: str, src: str, dst: str, attempt: int, seq: int) -> PutContext:
        return PutContext(self.settings.prefix, wf_id, src, dst, attempt, seq, self.worker_id, self.ttl_s)

    def choose(self, payload: Any, *, consumer_domain: str | None, nbytes: int | None = None) -> TransportKind:
        """The transport for `payload` (of `nbytes`, when the caller measured it), for a consumer whose
        replica has shared-memory domain `consumer_domain` (None: not known yet, e.g. not claimed)."""
        s = self.settings
        if nbytes is None:
            nbytes = codec.payload_nbytes(payload, max(s.dataplane_inline_max_bytes, s.dataplane_shm_min_bytes))
        return choose_transport(nbytes, mode=s.dataplane_mode,
                                inline_max_bytes=s.dataplane_inline_max_bytes,
                                shm_min_bytes=s.dataplane_shm_min_bytes,
                                same_host=bool(consumer_domain) and consumer_domain == self.domain,
                                shm_available=self.shm is not None)

    def prepare(self, payload: Any, ctx: PutContext, *, consumer_domain: str | None = None,
                kind: TransportKind | None = None) -> tuple[Ref, list[Command]]:
        """Put `payload` without a round trip of its own: a segment is written now; a Redis payload
        comes back as commands to send before the entry that references it (same connection). A payload
        shared memory cannot take (a full /dev/shm) goes to a Redis key instead."""
        kind = kind or self.choose(payload, consumer_domain=consumer_domain)
        if kind is TransportKind.INLINE:
            return InlineTransport.encode(payload), []
        if kind is TransportKind.SHM and (ref := self._put_shm(payload, ctx)) is not None:
            return ref, []
        return self.rediskey.put_commands(payload, ctx)

    def put_op(self, payload: Any, ctx: PutContext, kind: TransportKind) -> tuple[Ref, list[Any]]:
        """A producing session's payload by reference (`kind` shared memory or Redis): the reference,
        and the `emit.lua` op that stores it with the entry (none when it went to shared memory, written
        now). A payload shared memory cannot take (a full /dev/shm) goes to a Redis key instead."""
        if kind is TransportKind.SHM and (ref := self._put_shm(payload, ctx)) is not None:
            return ref, []
        return self.rediskey.put_op(payload, ctx)

    def _put_shm(self, payload: Any, ctx: PutContext) -> Ref | None:
        """The payload in this host's shared memory; None when it cannot take it (nothing is left of it
        there, and the caller puts it in a Redis key: the consumer reads those from any host)."""
        if self.shm is None:
            return None
        try:
            return self.shm.put_sync(payload, ctx)
        except SharedMemoryRefused:
            return None

    async def put(self, payload: Any, ctx: PutContext, *, consumer_domain: str | None = None,
                  kind: TransportKind | None = None) -> Ref:
        """Store `payload` through the transport `choose` picks (or `kind`); returns its reference (a
        Redis key's when shared memory was asked for and could not take it)."""
        kind = kind or self.choose(payload, consumer_domain=consumer_domain)
        if kind is TransportKind.SHM and self.shm is not None:
            try:
                return await self.shm.put(payload, ctx)
            except SharedMemoryRefused:
                kind = TransportKind.REDIS
        if kind is TransportKind.INLINE:
            return await self.inline.put(payload, ctx)
        return await self.rediskey.put(payload, ctx)

    async def get(self, ref: Ref, *, wf_id: str | None = None) -> Any:
        """The payload `ref` points at; a `DataPlaneError` says why not."""
        if ref.kind is TransportKind.INLINE:
            return await self.inline.get(ref)
        if ref.kind is TransportKind.REDIS:
            return await self.rediskey.get(ref, wf_id=wf_id)
        if self.shm is None:
            raise WrongHost(f"segment {ref.location}: this host has no shared memory")
        return await self.shm.get(ref, wf_id=wf_id)

    async def resolve(self, fields: Mapping[bytes, bytes], *, wf_id: str | None = None) -> tuple[Any, Ref | None]:
        """The payload of one chunk's fields (inline `d` or reference `r`), and the reference to
        release once the consuming session is done (None for an inline payload)."""
        inline = fields.get(INLINE_FIELD.encode())
        if inline is not None:
            return codec.loads(inline), None
        raw = fields.get(REF_FIELD.encode())
        if raw is None:
            raise UndecodablePayload("chunk has neither a payload nor a reference")
        ref = Ref.unpack(raw)
        return await self.get(ref, wf_id=wf_id), ref

    def close(self) -> None:
        """At shutdown: unmap our arenas and unlink those nothing in use is left in."""
        if self.shm is not None:
            self.shm.close()

    async def aclose(self) -> dict[SweepReason, int]:
        """A clean stop: free this process's payloads no one will read again (of workflows that ended or
        expired since the last sweep, half-written ones), then `close`. The payloads of live workflows
        stay in shared memory for the next processes on this host: a consumer's retry there reads them,
        one elsewhere has its producer run again; a sweep on this host frees them once their workflow
        ends or expires. Without Redis (or past `STOP_SWEEP_TIMEOUT_S`): `close` only."""
        freed = {reason: 0 for reason in SweepReason}
        try:
            if self.shm is not None and self.worker_id:
                freed = await asyncio.wait_for(self.sweep(worker=self.worker_id), STOP_SWEEP_TIMEOUT_S)
        except REDIS_ERRORS as exc:             # (TimeoutError is an OSError: one of them)
            logger.warning("data plane of %s: no last sweep at its stop (%s); the next one on this host frees "
                           "what ended", self.worker_id, exc)
        finally:
            self.close()                        # also when cancelled
        return freed

    # ------------------------------------------------------------ ownership
    async def release(self, refs: Sequence[Ref]) -> int:
        """Free what `refs` point at (the consumer, when its session is done)."""
        freed = await self.rediskey.release(refs)
        if self.shm is not None:
            freed += await self.shm.release(refs)
        return freed

    async def release_workflow(self, wf_id: str) -> int:
        """Free every payload of one workflow: its Redis keys, and its segments on this host."""
        freed = await self.rediskey.release_workflow(wf_id)
        if self.shm is not None:
            freed += await self.shm.release_workflow(wf_id)
        return freed

    @translated
    async def live_workflows(self, wf_ids: Iterable[str]) -> set[str]:
        """Those of `wf_ids` whose record says pending or running."""
        ids = sorted(set(wf_ids))
        if not ids:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hget(self.keys.wf(wf_id), "state")
        states = await pipe.execute()
        return {wf_id for wf_id, state in zip(ids, states, strict=True) if state in LIVE_STATES}

    @translated
    async def live_workers(self) -> set[str]:
        """Ids of the workers whose lease has not lapsed."""
        now = int(time.time() * 1000)
        return {m.decode() if isinstance(m, bytes) else str(m)
                for m in await self.redis.zrangebyscore(self.keys.workers, now, "+inf")}

    async def sweep(self, *, worker: str | None = None) -> dict[SweepReason, int]:
        """Free this host's segments of ended workflows, expired ones, and half-written ones of dead
        workers (all, or those attributed to `worker`). A live workflow's segments stay, even if their
        producer died: the consumer replays them. Redis payload keys need no sweep (TTL, terminal)."""
        if self.shm is None:
            return {reason: 0 for reason in SweepReason}
        found = self.shm.inventory()
        if worker is not None:
            found = [f for f in found if f.segment.worker == name_part(worker)]
        live = await self.live_workflows(f.wf_id for f in found if f.wf_id)
        return self.shm.sweep(found, live_wfs=live, live_workers=await self.live_workers())
