"""The reconciler's event consumption: stage reports read from each cell's `events` stream (group
`reconciler`) in batches and applied with `stage_event.lua`, which acks and deletes each event in
the same atomic step; an event that does not decode, or that its script fails on, goes to the
cell's `dlq:events` with the reason."""
from __future__ import annotations

import logging
import random
import time
from typing import Any

from omniflow.engine.reconciler.context import ReconcilerContext
from omniflow.errors import MalformedEntry, RedisError, RedisUnavailable
from omniflow.runtime import Backoff
from omniflow.storage import redisio
from omniflow.storage.entries import EventKind, event
from omniflow.storage.keys import DLQ_EVENTS, EVENT_GROUP, TASK_GROUP
from omniflow.storage.redisio import ensure_group
from omniflow.storage.schema import now_ms, s
from omniflow.storage.scripts import evalsha_args

logger = logging.getLogger(__name__)

EVENT_BATCH = 256
PENDING = "pending"                     # an event Redis refused or lost: it stays pending, applied later
MAX_BACKOFF_DOUBLINGS = 60              # 2**60 x any base is past every cap: no overflow, whatever the attempt


def backoff_ms(attempt: int, *, base_s: float, cap_s: float, jitter: float, rng: random.Random) -> int:
    """Exponential backoff with jitter and a cap, for the retry after `attempt` failed."""
    delay = min(cap_s, base_s * (2 ** min(MAX_BACKOFF_DOUBLINGS, max(0, attempt - 1))))
    return int(delay * (1 + rng.uniform(-jitter, jitter)) * 1000)


class Events:
    """Reads and applies the stage events of the cells."""

    def __init__(self, ctx: ReconcilerContext) -> None:
        self.ctx = ctx

    async def consume(self, cells: tuple[int, ...] = (0,)) -> None:
        """Read the events of `cells` (one read for all of them on a single server, one loop per cell
        on a cluster) and apply them. After an event could not be applied (Redis refused or was
        lost), this reconciler's own pending entries are read again first (XREADGROUP from 0)."""
        ctx = self.ctx
        backoff = Backoff()
        backlog = True                  # our pending entries first: at start, and after a failure
        streams = {ctx.keys.events(cell): cell for cell in cells}
        while True:
            try:
                with redisio.boundary():
                    reply = await ctx.blocking.xreadgroup(
                        EVENT_GROUP, ctx.id, dict.fromkeys(streams, "0" if backlog else ">"), count=EVENT_BATCH,
                        block=None if backlog else ctx.settings.block_ms)
                ctx.redis_ok_at = time.monotonic()
                got = [(streams[s(stream)], entries) for stream, entries in reply or [] if entries]
                if backlog and not got:
                    backlog = False
                    continue
                codes = [code for cell, entries in got for code in await self.apply(entries, cell)]
                if PENDING in codes:
                    backlog = True
                    await backoff.wait(logger, f"reconciler {ctx.id}: events not applied", RedisUnavailable(
                        "Redis refused or lost some stage_event calls"))
                    continue
                backoff.reset()
            except RedisError as exc:
                backlog = True
                if redisio.is_nogroup(exc):
                    try:
                        for stream in streams:
                            await ensure_group(ctx.redis, stream, EVENT_GROUP)
                        continue
                    except RedisError as again:
                        exc = again
                await backoff.wait(logger, f"reconciler {ctx.id}: reading events failed", exc)

    def stage_event_keys(self, wf_id: str, stage: str) -> list[str]:
        """KEYS of a `stage_event.lua` call (see its header): all of `wf_id`'s cell."""
        keys = self.ctx.keys
        wf, cell = keys.wf(wf_id), keys.cell_of(wf_id)
        return [wf, keys.inflight(cell), keys.retries(cell), keys.events(cell), keys.dlq(stage, cell),
                *(k for st in self.ctx.pipeline.order for k in keys.task_streams(st, cell)),
                *keys.finalize_keys(wf_id, self.ctx.final_suffixes)]

    def _event_call(self, entry_id: bytes | str, fields: dict[bytes, bytes] | None, now: int,
                    cell: int) -> tuple[Any, ...]:
        """The `stage_event.lua` call of one event entry of `cell`; `MalformedEntry` when it does not
        decode (or names a workflow of another cell)."""
        ctx = self.ctx
        ev = event(fields, stages=ctx.pipeline.stages)
        if ctx.keys.cell_of(ev.wf_id) != cell:
            raise MalformedEntry(f"workflow {ev.wf_id} is not in cell {cell}")
        retry = ctx.pipeline.stages[ev.stage].retry
        due, task = now, ("", "")
        if ev.kind is EventKind.FAILED:   # only a failure waits before its retry
            due += backoff_ms(ev.attempt, base_s=retry.backoff_s, cap_s=retry.backoff_max_s,
                              jitter=retry.jitter, rng=ctx.rng)
        elif ev.kind is EventKind.LOST:   # a live worker lost Redis mid-session: ack its task, retry it at once
            task = (ctx.keys.tasks(ev.stage, cell, ev.priority), ev.task_entry)
        return self.stage_event_call(ev.wf_id, ev.stage, ev.kind.value, ev.attempt, now, ev.detail,
                                     retryable=ev.retryable, due_ms=due, task=task, event_id=entry_id)

    def stage_event_call(self, wf_id: str, stage: str, kind: str, attempt: int, now: int, detail: str, *,
                         retryable: bool, due_ms: int, task: tuple[str, bytes | str] = ("", ""),
                         event_id: bytes | str = "") -> tuple[Any, ...]:
        """A `stage_event.lua` call (ARGV: see its header): `task` is the (stream, entry) a `lost`
        session's task is acknowledged in, `event_id` the event entry it applies ('' for a sweep's)."""
        settings = self.ctx.settings
        stream, entry = task
        return evalsha_args(
            "stage_event", self.stage_event_keys(wf_id, stage),
            [settings.prefix, kind, stage, attempt, now, detail, "1" if retryable else "0",
             self.ctx.pipeline.stages[stage].retry.max_attempts, due_ms, settings.tombstone_ttl_s,
             settings.result_ttl_s, stream, entry, TASK_GROUP if stream else "", EVENT_GROUP, event_id,
             settings.dlq_max_len])

    def _dead_letter_call(self, entry_id: bytes | str, fields: dict[bytes, bytes] | None, reason: str,
                          cell: int) -> tuple[Any, ...]:
        keys = self.ctx.keys
        return redisio.dead_letter_call(keys.dlq(DLQ_EVENTS, cell), keys.events(cell), EVENT_GROUP, entry_id,
                                        fields, reason, max_len=self.ctx.settings.dlq_max_len)

    async def apply(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]], cell: int = 0) -> list[str]:
        """Apply a batch of events in one round trip; returns each result code.

        Each event is acked by its own script call, so only applied events are acked. Codes: the
        script's ('advanced', 'completed', 'retry', 'failed', 'ignored'), 'dead_letter' (malformed,
        or its script failed: moved to the cell's `dlq:events` with the reason), or `PENDING` (Redis refused
        or lost the call: the event stays pending and is applied later)."""
        ctx = self.ctx
        now = now_ms()
        calls: list[tuple[Any, ...]] = []
        codes: list[str | None] = []
        for entry_id, fields in entries:
            if not fields:                 # deleted while pending (an old reconciler's XDEL): just un-pend it
                calls.append(("XACK", ctx.keys.events(cell), EVENT_GROUP, entry_id))
                codes.append("ignored")
                continue
            try:
                calls.append(self._event_call(entry_id, fields, now, cell))
                codes.append(None)
            except MalformedEntry as exc:
                calls.append(self._dead_letter_call(entry_id, fields, f"malformed event: {exc}", cell))
                codes.append("dead_letter")
        try:
            results = await redisio.execute(ctx.redis, calls)
        except RedisUnavailable as exc:
            logger.warning("reconciler %s: applying %d event(s) failed: %s", ctx.id, len(entries), exc)
            return [PENDING] * len(entries)
        out: list[str] = []
        poison: list[tuple[Any, ...]] = []
        for (entry_id, fields), code, result in zip(entries, codes, results):
            if isinstance(result, RedisUnavailable):
                code = PENDING
            elif isinstance(result, Exception):      # the script failed on this event: poison
                logger.error("reconciler %s: event %s failed: %s", ctx.id, s(entry_id), result)
                poison.append(self._dead_letter_call(entry_id, fields, f"stage_event failed: {result}", cell))
                code = "dead_letter"
            elif code is None:
                code = s(result[0])
            ctx.counts[code] = ctx.counts.get(code, 0) + 1
            out.append(code)
        ctx.counts["events"] += len(entries)
        if poison:
            try:
                failed = [r for r in await redisio.execute(ctx.redis, poison) if isinstance(r, Exception)]
            except RedisUnavailable as exc:
                failed = [exc]
            if failed:        # they stay pending: the next pass tries again
                logger.warning("reconciler %s: could not dead-letter %d event(s): %s", ctx.id, len(failed), failed[0])
                out = [PENDING if c == "dead_letter" else c for c in out]
        return out
