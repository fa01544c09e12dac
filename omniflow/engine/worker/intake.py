"""A worker's intake: the blocking XREADGROUP over its stages' task streams (only as many tasks as
free session slots), validation of what it delivers, hand-back while draining, the audit that
adopts tasks delivered to this worker but never received, and the trim of finished tasks."""
from __future__ import annotations

import asyncio
import logging
import time

from omniflow.engine.worker.claims import Claims, Delivered
from omniflow.engine.worker.context import WorkerContext
from omniflow.engine.worker.pool import StagePool
from omniflow.errors import MalformedEntry, RedisError
from omniflow.models import PRIORITY_ORDER, Priority
from omniflow.runtime import Backoff
from omniflow.storage import redisio
from omniflow.storage.entries import task as task_entry
from omniflow.storage.keys import TASK_GROUP
from omniflow.storage.redisio import REDIS_ERRORS, ensure_group
from omniflow.storage.schema import s
from omniflow.storage.transitions import housekeeping
from omniflow.storage.transitions.sessions import Claim
from omniflow.storage.topology import is_cluster

logger = logging.getLogger(__name__)

INTAKE_RECHECK_MS = 20      # a multi-stage worker with a full stage re-reads this often to add it back
LIVE_LOOKAHEAD = 4          # interactive tasks a full stage may still take beyond its capacity
LIVE_RECENT_S = 60.0        # ... while interactive tasks came this recently
# Tasks delivered to this worker that it never heard of (the reply of its read was lost with the
# connection: a failover, a killed client) are looked for this often, once pending this long.
ORPHAN_AUDIT_S = 5.0
ORPHAN_IDLE_MS = 3_000
ORPHAN_BATCH = 256
TRIM_S = 0.5                # how often the entries of finished tasks are deleted (`Intake.trim`)

Entries = list[tuple[str, dict[bytes, bytes]]]


class Intake:
    """Takes tasks off the stages' streams and hands them to `Claims`."""

    def __init__(self, ctx: WorkerContext, claims: Claims, *, loops: int) -> None:
        self.ctx = ctx
        self.claims = claims
        self.loops = loops              # intake loops running (one per read group)
        self.starved = 0                # intake loops waiting for a free session slot
        self.live_seen_at = -LIVE_RECENT_S      # monotonic time an interactive task was last delivered
        self.by_stream: dict[str, tuple[StagePool, int, Priority]] = {
            key: (pool, cell, prio) for pool in ctx.pools.values() for cell, keys in pool.class_streams.items()
            for prio, key in zip(PRIORITY_ORDER, keys)}

    async def run(self, cells: tuple[int, ...]) -> None:
        """One blocking XREADGROUP over the task streams of `cells` for every stage with a free slot.
        On a single server one loop reads every cell; on a cluster one loop per cell (one slot per
        read). Each stage has one stream per priority class (`Keys.tasks`), all in the read; which
        session starts first is the slots' choice (`Slots`: by class, then tenant). Each read reserves
        the slots it may fill (one COUNT per cell), so the loops together take no more tasks than the
        stages have room for, beyond one COUNT per extra class when several classes are queued."""
        ctx = self.ctx
        backoff = Backoff()
        while True:
            if ctx.draining:
                await ctx.undrained.wait()
                continue
            ready = [pool for pool in ctx.pools.values() if pool.free > 0]
            if ready:
                # COUNT applies per stream: with several classes queued at once a read may take up to one
                # COUNT per class; the reservation is one COUNT per cell, as with one stream (reserving
                # one per class would starve the loops of a cluster's cells), and what comes beyond it
                # waits for a slot like a prefetched session. A pool that serves several queues (stages
                # of several pipelines) splits its room between them.
                share = len(cells) * self.loops
                count = max(1, min(ctx.settings.read_batch, *(pool.free // (share * pool.core.routes) for pool in ready)))
                streams = {stream: ">" for pool in ready for cell in cells for stream in pool.class_streams[cell]}
                # A stage left out because it was full is not in the blocking read (nor are the slots
                # other loops wait for): come back soon to add it when its slots free up (a blocking read
                # cannot be interrupted without losing what it may already have delivered).
                block = ctx.settings.block_ms if len(ready) == len(ctx.pools) and not self.starved else \
                    min(ctx.settings.block_ms, INTAKE_RECHECK_MS)
                reserved = count * len(cells)
                lookahead = False
            else:
                # Every stage is full (its slots and its prefetch). Live traffic must not wait for a
                # session to end before it is even read: a full stage still reads its interactive
                # stream, one task at a time, up to LIVE_LOOKAHEAD over its capacity (those wait for
                # the slots, which serve them first); it polls, so a freed slot is seen soon.
                # (only while live traffic came lately: a deployment without any pays no polling)
                lately = time.monotonic() - self.live_seen_at < LIVE_RECENT_S
                ready = [pool for pool in ctx.pools.values() if lately and pool.free > -LIVE_LOOKAHEAD]
                if not ready:
                    self.starved += 1
                    try:
                        ctx.slot_free.clear()
                        await ctx.slot_free.wait()
                    finally:
                        self.starved -= 1
                    continue
                count, block, reserved, lookahead = 1, INTAKE_RECHECK_MS, len(cells), True
                streams = {pool.stream(cell, Priority.INTERACTIVE): ">" for pool in ready for cell in cells}
            for pool in ready:
                pool.core.claiming += reserved
            try:
                with redisio.boundary():
                    reply = await ctx.intake_redis.xreadgroup(TASK_GROUP, ctx.id, streams, count=count, block=block)
                backoff.reset()
            except RedisError as exc:
                if redisio.is_nogroup(exc):        # the stream was deleted (or the server lost it)
                    try:
                        for pool in ready:
                            for cell in cells:
                                for stream in pool.class_streams[cell]:
                                    await ensure_group(ctx.redis, stream, TASK_GROUP)
                        continue
                    except RedisError as again:
                        exc = again
                await backoff.wait(logger, f"worker {ctx.id}: intake read failed", exc)
                continue
            finally:
                for pool in ready:
                    pool.core.claiming -= reserved
                ctx.slot_free.set()
            # what one read delivered, every stage's tasks of one cell claimed with one call
            by_cell: dict[int, list[Delivered]] = {}
            got = {pool.core: 0 for pool in ready} if not lookahead else {}   # most entries of one stream, by pool
            for stream, entries in reply or []:
                pool, cell, prio = self.by_stream[s(stream)]
                if pool.core in got:
                    got[pool.core] = max(got[pool.core], len(entries))
                claims = self.validate(pool, cell, [(s(entry_id), fields) for entry_id, fields in entries], prio)
                if claims:
                    by_cell.setdefault(cell, []).append(Delivered(pool, cell, prio, claims))
            for core, n in got.items():       # a backlog or not: how far ahead the pool claims
                core.saw_read(count, n)
            for groups in by_cell.values():
                ctx.track(asyncio.create_task(self.claims.claim_many(groups)))
            if by_cell:
                # the claim goes out before the next read: its task queues the call on one turn of the
                # loop, the batcher's flusher writes it on the next. Read first, the claim waited behind
                # the read's write (low-load p50 -0.05-0.1 ms; bench/notes.md, round 13)
                await asyncio.sleep(0)
                await asyncio.sleep(0)

    def accept(self, pool: StagePool, cell: int, entries: Entries, prio: Priority = Priority.API) -> None:
        """Validate delivered tasks (malformed ones go to the dead-letter stream) and claim the rest in one call."""
        claims = self.validate(pool, cell, entries, prio)
        if claims:
            self.ctx.track(asyncio.create_task(self.claims.claim(pool, cell, claims, prio)))

    def validate(self, pool: StagePool, cell: int, entries: Entries, prio: Priority = Priority.API) -> list[Claim]:
        """The delivered tasks to claim (malformed ones go to the dead-letter stream; while draining,
        none: they are handed back), counted in `pool.core.claiming` until their claim is answered."""
        ctx = self.ctx
        if ctx.draining:       # read by a blocking read that began before the drain: give them back
            ctx.track(asyncio.create_task(self._hand_back(pool, cell, entries, prio)))
            return []
        stream = pool.stream(cell, prio)
        if prio is Priority.INTERACTIVE:
            self.live_seen_at = time.monotonic()
        claims: list[tuple[str, str, int]] = []
        for entry_id, fields in entries:
            try:
                entry = task_entry(fields, stage=pool.stage)
            except MalformedEntry as exc:
                ctx.dead_letter(pool.stage, cell, stream, TASK_GROUP, entry_id, fields,
                                f"malformed task entry: {exc}")
                continue
            wf_id, stage, attempt = entry.wf_id, entry.stage, entry.attempt
            if attempt > 1:
                # An older attempt of this session still running here was declared lost (our lease lapsed,
                # or we lost Redis): it is fenced anyway; stop it so it cannot hold this stage's inputs.
                # (The sessions held are scanned, not the attempts: an attempt number is only bounded.)
                prefix = f"{wf_id}|{stage}|"
                for key, (_stale, held) in list(ctx.sessions.items()):
                    if key.startswith(prefix) and int(key.rsplit("|", 1)[1]) < attempt:
                        held.cancel()
            claims.append((entry_id, wf_id, attempt))
            ctx.held.add(entry_id)
        pool.core.claiming += len(claims)
        return claims

    async def _hand_back(self, pool: StagePool, cell: int, entries: Entries, prio: Priority) -> None:
        """Re-queue unclaimed tasks as they were (same attempt: still valid for any other worker)."""
        ctx = self.ctx
        stream = pool.stream(cell, prio)
        if prio is Priority.INTERACTIVE:
            self.live_seen_at = time.monotonic()
        pipe = ctx.redis.pipeline(transaction=not is_cluster(ctx.redis))    # one stream: one slot
        for entry_id, fields in entries:
            pipe.xadd(stream, fields)
            pipe.xack(stream, TASK_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
        try:
            await pipe.execute()
            logger.info("worker %s (draining): handed back %d task(s) of %s", ctx.id, len(entries), pool.stage)
        except REDIS_ERRORS as exc:      # still pending here: re-queued when this worker stops
            logger.warning("worker %s: could not hand back %d task(s): %s", ctx.id, len(entries), exc)

    async def trim(self) -> None:
        """Every `TRIM_S`, delete the entries of this worker's task streams that every group has
        delivered and acknowledged (`trim_tasks.lua`, one call per cell): a session's finish acks its
        task and leaves the entry, one command less per session than deleting it there. Every worker
        reading a stream trims it once it closed a session since its last trim (an idle worker sends
        nothing; the last close is always followed by a trim); the calls are idempotent."""
        by_cell: dict[int, list[str]] = {}
        for stream, (_pool, cell, _prio) in self.by_stream.items():
            by_cell.setdefault(cell, []).append(stream)
        calls = [housekeeping.trim_tasks(streams) for streams in by_cell.values()]
        failing = False
        trimmed_at = -1.0          # the worker's closed sessions at its last trim
        while True:
            await asyncio.sleep(TRIM_S)
            closed = sum(self.ctx.stats[name] for name in ("done", "failed", "fenced"))
            if closed == trimmed_at and not failing:
                continue
            trimmed_at = closed
            try:
                errors: list[Exception] = [r for r in await redisio.execute(self.ctx.redis, calls)
                                           if isinstance(r, Exception)]
            except RedisError as exc:
                errors = [exc]
            if errors and not failing:
                logger.warning("worker %s: trimming its task streams failed: %s", self.ctx.id, errors[0])
            failing = bool(errors)

    async def orphans(self) -> None:
        """Claim again the tasks delivered to this worker that it never heard of.

        A task read by XREADGROUP is pending for this worker from the moment the server delivers it;
        if the reply is lost with the connection (a failover, a killed client, a restart after the
        delivery was replicated), nobody works on it and nobody re-queues it: the worker is alive
        and renews its lease. So every `ORPHAN_AUDIT_S` the worker lists its own pending tasks idle
        for `ORPHAN_IDLE_MS` that it does not hold, takes them back (XCLAIM) and claims them as if
        just read."""
        while True:
            await asyncio.sleep(ORPHAN_AUDIT_S)
            for pool in self.ctx.pools.values():
                for cell, streams in pool.class_streams.items():
                    for prio, stream in zip(PRIORITY_ORDER, streams):
                        try:
                            await self.adopt_orphans(pool, cell, stream, prio)
                        except RedisError as exc:
                            logger.warning("worker %s: looking for orphaned tasks of %s failed: %s", self.ctx.id,
                                           stream, exc)

    async def adopt_orphans(self, pool: StagePool, cell: int, stream: str, prio: Priority = Priority.API) -> int:
        ctx = self.ctx
        with redisio.boundary():
            rows = await ctx.redis.xpending_range(stream, TASK_GROUP, min="-", max="+", count=ORPHAN_BATCH,
                                                  consumername=ctx.id, idle=ORPHAN_IDLE_MS)
        ids = [s(row["message_id"]) for row in rows if s(row["message_id"]) not in ctx.held]
        if not ids:
            return 0
        with redisio.boundary():
            entries = await ctx.redis.xclaim(stream, TASK_GROUP, ctx.id, ORPHAN_IDLE_MS, ids)
        found = [(s(eid), fields) for eid, fields in entries if fields and s(eid) not in ctx.held]
        # deleted while pending (its session ended elsewhere): un-pend it (Redis 7 and Valkey drop such
        # entries from the pending list in XCLAIM itself; older servers return them without fields)
        gone = [s(eid) for eid, fields in entries if not fields]
        if gone:
            with redisio.boundary():
                await ctx.redis.xack(stream, TASK_GROUP, *gone)
        if found:
            logger.warning("worker %s: %d task(s) of %s were delivered to it but never received; claiming them",
                           ctx.id, len(found), pool.stage)
            ctx.stats["orphans"] = ctx.stats.get("orphans", 0) + len(found)
            self.accept(pool, cell, found, prio)
        return len(found)
