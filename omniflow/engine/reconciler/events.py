"""The reconciler's event consumption: stage reports read from each cell's `events` stream (group
`reconciler`) in batches and applied with `stage_event.lua`, which acks and deletes each event in
the same atomic step; an event that does not decode, or that its script fails on, goes to the
cell's `dlq:events` with the reason."""
from __future__ import annotations

import logging
import random
import time
from typing import Any

from omniflow import tracing
from omniflow.engine.reconciler.context import ReconcilerContext
from omniflow.errors import MalformedEntry, RedisError, RedisUnavailable
from omniflow.runtime import Backoff
from omniflow.storage import redisio
from omniflow.storage.entries import EventKind, event
from omniflow.pipeline import Pipeline
from omniflow.storage.keys import DLQ_EVENTS, EVENT_GROUP, finalize_plan
from omniflow.storage.redisio import ensure_group
from omniflow.storage.schema import now_ms, s
from omniflow.storage.transitions import reconcile

logger = logging.getLogger(__name__)

EVENT_BATCH = 256
PENDING = "pending"                     # an event Redis refused or lost: it stays pending, applied later
MAX_BACKOFF_DOUBLINGS = 60              # 2**60 x any base is past every cap: no overflow, whatever the attempt


def backoff_ms(attempt: int, *, base_s: float, cap_s: float, jitter: float, rng: random.Random) -> int:
    """Exponential backoff with jitter and a cap, for the retry after `attempt` failed."""
    delay = min(cap_s, base_s * (2 ** min(MAX_BACKOFF_DOUBLINGS, max(0, attempt - 1))))
    return int(delay * (1 + rng.uniform(-jitter, jitter)) * 1000)


TRACED = frozenset({"completed", "retry", "failed"})


def trace_decision(result: Any, begun_ns: int, *, reconciler: str, wf_id: str, stage: str, attempt: int, kind: str,
                   detail: str) -> None:
    """One `stage_event.lua` reply as a decision span (completed, retry, failed: the stage's DLQ;
    see its header: the last item is the workflow's traceparent), or as an error span when the
    script failed on it."""
    attrs: dict[str, Any] = {"workflow.id": wf_id, "stage": stage, "attempt": attempt, "event": kind,
                             "reconciler": reconciler}
    if isinstance(result, Exception):
        tracing.decision("dead_letter", traceparent="", start_ns=begun_ns, error=f"stage_event failed: {result}", **attrs)
        return
    code = s(result[0]) if isinstance(result, list) and result else ""
    if code not in TRACED:
        return
    if code == "retry":
        attrs.update(next_attempt=int(s(result[1])), reason=detail[:200])
    elif code == "failed":
        attrs["dlq"] = True         # stage_event.lua dead-lettered the stage's task
    tracing.decision(code, traceparent=s(result[-1]), start_ns=begun_ns, error=detail[:200] if code == "failed" else "",
                     **attrs)


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

    def stage_event_keys(self, wf_id: str, stage: str, pipeline: Pipeline | None = None) -> list[str]:
        """KEYS of a `stage_event.lua` call (see its header): all of `wf_id`'s cell."""
        pipe = pipeline or self.ctx.pipeline
        plan = self.ctx.finalize_plan if pipe is self.ctx.pipeline else finalize_plan(pipe)
        return reconcile.stage_event_keys(self.ctx.keys, plan, [pipe.queue(st) for st in pipe.order], wf_id, stage)

    def _event_call(self, entry_id: bytes | str, fields: dict[bytes, bytes] | None, now: int,
                    cell: int) -> tuple[Any, ...]:
        """The `stage_event.lua` call of one event entry of `cell`; `MalformedEntry` when it does not
        decode (or names a workflow of another cell)."""
        ctx = self.ctx
        ev = event(fields)
        if ctx.keys.cell_of(ev.wf_id) != cell:
            raise MalformedEntry(f"workflow {ev.wf_id} is not in cell {cell}")
        pipe = ctx.pipeline_of(ev.version)
        if pipe is None:
            raise MalformedEntry(f"pipeline version {ev.version!r} is not registered")
        if ev.stage not in pipe.stages:
            raise MalformedEntry(f"stage {ev.stage!r} is not a stage of pipeline {pipe.name}@{pipe.digest}")
        retry = pipe.stages[ev.stage].retry
        due, task = now, ("", "")
        if ev.kind is EventKind.FAILED:   # only a failure waits before its retry
            due += backoff_ms(ev.attempt, base_s=retry.backoff_s, cap_s=retry.backoff_max_s,
                              jitter=retry.jitter, rng=ctx.rng)
        elif ev.kind is EventKind.LOST:   # a live worker lost Redis mid-session: ack its task, retry it at once
            task = (ctx.keys.tasks(pipe.queue(ev.stage), cell, ev.priority), ev.task_entry)
        return self.stage_event_call(ev.wf_id, ev.stage, ev.kind.value, ev.attempt, now, ev.detail,
                                     retryable=ev.retryable, due_ms=due, task=task, event_id=entry_id,
                                     pipeline=pipe, priority=ev.priority if ev.classed else None)

    def stage_event_call(self, wf_id: str, stage: str, kind: str, attempt: int, now: int, detail: str, *,
                         retryable: bool, due_ms: int, task: tuple[str, bytes | str] = ("", ""),
                         event_id: bytes | str = "", pipeline: Pipeline | None = None,
                         priority: str | None = None) -> tuple[Any, ...]:
        """A `stage_event.lua` call (ARGV: see its header): `task` is the (stream, entry) a `lost`
        session's task is acknowledged in, `event_id` the event entry it applies ('' for a sweep's);
        `priority`: the workflow's class, when the event said it (only its task streams are declared)."""
        settings = self.ctx.settings
        pipe = pipeline or self.ctx.pipeline
        plan = self.ctx.finalize_plan if pipe is self.ctx.pipeline else finalize_plan(pipe)
        return reconcile.stage_event(
            self.ctx.keys, plan, [pipe.queue(st) for st in pipe.order], wf_id, stage, kind, attempt, now_ms=now,
            detail=detail, retryable=retryable, max_attempts=pipe.stages[stage].retry.max_attempts,
            due_ms=due_ms, tombstone_ttl_s=settings.tombstone_ttl_s, result_ttl_s=settings.result_ttl_s,
            dlq_max_len=settings.dlq_max_len, task=task, event_id=event_id, priority=priority)

    def _dead_letter_call(self, entry_id: bytes | str, fields: dict[bytes, bytes] | None, reason: str,
                          cell: int) -> tuple[Any, ...]:
        keys = self.ctx.keys
        return reconcile.dead_letter(keys.dlq(DLQ_EVENTS, cell), keys.events(cell), EVENT_GROUP, entry_id,
                                        fields, reason, max_len=self.ctx.settings.dlq_max_len)

    def trace_decisions(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]], results: list[Any],
                        begun_ns: int) -> None:
        """The decisions `stage_event.lua` took on these events (retry, failed: the DLQ, completed) and
        the events dead-lettered, as spans of their workflows' traces (tracing on only)."""
        for (_entry_id, fields), result in zip(entries, results):
            if not fields:
                continue
            try:
                ev = event(fields, stages=self.ctx.pipeline.stages)
            except MalformedEntry as exc:
                tracing.decision("dead_letter", traceparent="", start_ns=begun_ns, error=f"malformed event: {exc}",
                                 reconciler=self.ctx.id)
                continue
            trace_decision(result, begun_ns, reconciler=self.ctx.id, wf_id=ev.wf_id, stage=ev.stage,
                           attempt=ev.attempt, kind=ev.kind.value, detail=ev.detail)

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
        unknown = {s(fields.get(b"p", b"")) for _, fields in entries if fields} - set(ctx.catalog.versions)
        if unknown - {""}:
            try:
                await ctx.learn(unknown)
            except RedisError as exc:
                logger.warning("reconciler %s: looking up pipeline versions failed: %s", ctx.id, exc)
                return [PENDING] * len(entries)
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
        begun = tracing.now_ns() if tracing.tracer is not None else 0
        try:
            results = await redisio.execute(ctx.redis, calls)
        except RedisUnavailable as exc:
            logger.warning("reconciler %s: applying %d event(s) failed: %s", ctx.id, len(entries), exc)
            return [PENDING] * len(entries)
        if begun:
            self.trace_decisions(entries, results, begun)
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
                code = reconcile.event_code(result).value
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
