"""A worker's liveness: the announcement of a worker still loading its models, the heartbeat that
renews its lease (and reads an operator's drain), the readiness it reports, and the watchdog that
ends sessions waiting too long for input.

A worker is *live* (counted by `/readyz`, `omniflow stats`, the demo) only once it holds a lease,
i.e. after its executors' `setup`. Before and during `setup` it announces itself in
`<p>:{workers}:@loading` (outside the lease set, so nothing counts it as claiming) with the same
info hash a heartbeat writes, `state` = `loading`: operators see it load.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time

from omniflow.engine.session import Session
from omniflow.engine.worker.chunks import chunk_fields
from omniflow.engine.worker.context import WorkerContext
from omniflow.engine.worker.serving import serving_snapshot
from omniflow.errors import RedisError
from omniflow.models import WorkerState
from omniflow.storage import redisio
from omniflow.storage.transitions.sessions import heartbeat
from omniflow.storage.schema import now_ms

logger = logging.getLogger(__name__)

WORKER_INFO_TTL_S = 86_400
RESYNC_AFTER_S = 5.0        # a session waiting this long for input reads its edge logs again (see `watchdog`)
RESYNC_TAIL = 64            # entries read from the end of an edge log first (see `Liveness.resync`)


def _read_past(chunk: dict[bytes, bytes], last: int) -> bool:
    """Is `chunk` at or below `last`, the last seq a session read from its source (the tail read
    back far enough)?"""
    try:
        return int(chunk[b"seq"]) <= last
    except (KeyError, ValueError):
        return False


class Liveness:
    """Heartbeat, drain state, readiness and the input-wait watchdog of one worker."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.started = asyncio.Event()
        self.heartbeat_ok_at = 0.0      # monotonic time of the last heartbeat Redis accepted
        self.since_ms = now_ms()        # when the worker entered its present state (loading, then leased)

    def _info(self, state: WorkerState) -> dict[str, str | int]:
        """The fields of the worker's info hash (what `omniflow workers` shows)."""
        ctx = self.ctx
        return {
            # per stage served, in the same order: "thinker,talker" / "8,4" / "3,1"
            "stage": ctx.label, "host": ctx.settings.host_id, "shm": ctx.plane.domain, "pid": os.getpid(),
            "capacity": ",".join(str(sum(p.max_sessions for p in g)) for g in ctx.by_stage().values()),
            "active": ",".join(str(sum(p.active for p in g)) for g in ctx.by_stage().values()), "seen_ms": now_ms(),
            # where each stage's sessions run now: "thread" or "loop" (`omniflow.engine.placement`)
            "runs": ",".join("loop" if g[0].core.placement.on_loop else "thread" for g in ctx.by_stage().values()),
            # the task queues (`<stage>@<pipeline version>`) it claims from: which versions it serves
            "queues": ",".join(ctx.pools),
            "state": state.value, "since_ms": self.since_ms,
            "stats": json.dumps(ctx.stats), "window": json.dumps(ctx.window.snapshot()),
            "serving": json.dumps(serving_snapshot(ctx)),
        }

    async def _register(self, state: WorkerState, *, loading: bool = False) -> bytes | None:
        """`heartbeat.lua` on the lease set (or the loading set): score, info, TTL."""
        ctx = self.ctx
        expiry = now_ms() + int(ctx.settings.lease_timeout_s * 1000)
        drain: bytes | None = await redisio.call(ctx.redis, *heartbeat(
            ctx.keys, ctx.id, loading=loading, expiry_ms=expiry, info_ttl_s=WORKER_INFO_TTL_S, info=self._info(state)))
        return drain

    async def announce_loading(self) -> None:
        """Say, until cancelled, that this worker exists and loads its models: every heartbeat
        interval, in the loading set (never the lease set: a loading worker claims nothing)."""
        self.since_ms = now_ms()
        failing = False
        while True:
            try:
                await self._register(WorkerState.LOADING, loading=True)
                failing = False
            except RedisError as exc:
                if not failing:
                    logger.warning("worker %s: announcing it loads failed: %s", self.ctx.id, exc)
                failing = True
            await asyncio.sleep(self.ctx.settings.heartbeat_interval_s)

    async def leave_loading(self) -> None:
        """Setup is over (the lease taken, or setup failed): out of the loading set (the reconciler's
        sweep removes an entry this fails to remove once its announcement lapses)."""
        self.since_ms = now_ms()
        try:
            with redisio.boundary():
                await self.ctx.redis.zrem(self.ctx.keys.workers_loading, self.ctx.id)
        except RedisError as exc:
            logger.warning("worker %s: leaving the loading set failed: %s", self.ctx.id, exc)

    async def heartbeat_once(self) -> None:
        """Renew the lease (`heartbeat.lua`: allowed while Redis is out of memory)."""
        ctx = self.ctx
        ctx.stats["backpressure_waits"] = ctx.backpressure.waits
        ctx.stats["backpressure_wait_s"] = round(ctx.backpressure.wait_s, 3)
        state = (WorkerState.STOPPING if ctx.stopping else WorkerState.DRAINING if ctx.draining
                 else WorkerState.READY)
        drain = await self._register(state)
        self.heartbeat_ok_at = time.monotonic()
        if drain and ctx.undrained.is_set():
            logger.info("worker %s: draining (claims nothing new; %d session(s) held)", ctx.id, len(ctx.sessions))
            ctx.undrained.clear()
        elif not drain and not ctx.undrained.is_set():
            logger.info("worker %s: drain lifted", ctx.id)
            ctx.undrained.set()

    def ready(self) -> tuple[bool, str]:
        """For `/readyz`: started, not stopping, and the lease renewed within its timeout."""
        if not self.started.is_set():
            return False, "starting"
        if self.ctx.stopping:
            return False, "stopping"
        age_s = time.monotonic() - self.heartbeat_ok_at
        if age_s > self.ctx.settings.lease_timeout_s:
            return False, f"no heartbeat accepted for {age_s:.1f}s"
        return True, ""

    async def heartbeat(self) -> None:
        """Renew the lease every `heartbeat_interval_s` (four times as often after a failure)."""
        failing = False
        while True:
            # after a failure, try again soon: the lease lapses after lease_timeout_s
            await asyncio.sleep(self.ctx.settings.heartbeat_interval_s / (4 if failing else 1))
            try:
                await self.heartbeat_once()
                if failing:
                    logger.info("worker %s: heartbeat renewed again", self.ctx.id)
                failing = False
            except RedisError as exc:
                if not failing:
                    logger.warning("worker %s heartbeat failed: %s", self.ctx.id, exc)
                failing = True

    async def watchdog(self) -> None:
        """Input-wait timeouts, checked once a second for all sessions (cheaper than a timer per read).

        A session that has waited a while (`RESYNC_AFTER_S`, or a quarter of its input timeout) reads
        its upstream edge logs again before it gives up: its inbox is a copy of them, and a copy can
        be lost where the edge log is not (a failover that loses the claim that bound the session, so
        its producer never forwarded to it, or the inbox entries the old primary had not passed on)."""
        pools = self.ctx.pools
        period = min(1.0, *(p.spec.retry.input_timeout_s / 2 for p in pools.values()))
        resyncing: set[asyncio.Task[int]] = set()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for session, _task in list(self.ctx.sessions.values()):
                if session is None or not session.waiting_since:
                    continue
                waited = now - session.waiting_since
                if waited > session._input_timeout_s:
                    session.input_timed_out = True
                    if session._waiter is not None:      # the wait itself (on this loop, whoever awaits it)
                        session._waiter.cancel()
                elif waited > min(RESYNC_AFTER_S, session._input_timeout_s / 4) \
                        and now - session.resynced_at > min(RESYNC_AFTER_S, session._input_timeout_s / 4):
                    session.resynced_at = now
                    task = asyncio.create_task(self.resync(session))
                    resyncing.add(task)
                    task.add_done_callback(resyncing.discard)

    async def resync(self, session: Session) -> int:
        """Queue what `session`'s upstream edge logs hold past what it has read (in order; the reader
        skips what it has); the number of chunks queued. A failed read is tried again later."""
        ctx = self.ctx
        srcs = list(session.upstream)
        try:
            with redisio.boundary():
                # the tail first (a long log, streamed audio, is not read whole every few seconds)
                pipe = ctx.redis.pipeline(transaction=False)
                for src in srcs:
                    pipe.xrevrange(ctx.keys.edge(session.wf_id, src, session.stage), count=RESYNC_TAIL)
                tails = await pipe.execute()
                logs = []
                for src, tail in zip(srcs, tails):
                    entries = tail[::-1]
                    if len(tail) == RESYNC_TAIL and not any(_read_past(chunk, session._last_in.get(src, 0))
                                                            for _eid, f in tail for chunk in chunk_fields(f)):
                        entries = await ctx.redis.xrange(ctx.keys.edge(session.wf_id, src, session.stage))
                    logs.append(entries)
        except RedisError as exc:
            logger.warning("worker %s: reading the edge logs of %s/%s again failed: %s", ctx.id, session.wf_id,
                           session.stage, exc)
            return 0
        queued = 0
        for src, entries in zip(srcs, logs):
            for _eid, fields in entries:
                for chunk in chunk_fields(fields):
                    try:
                        new = bool(chunk.get(b"eos")) or int(chunk[b"seq"]) > session._last_in.get(src, 0)
                    except (KeyError, ValueError):
                        new = True          # malformed: the reader fails the session with what is wrong
                    if new:
                        session._queue.put_nowait((src, chunk))
                        queued += 1
        if queued:
            ctx.stats["resynced"] = ctx.stats.get("resynced", 0) + 1
            logger.warning("worker %s: session %s/%s waited %.0fs for input its edge logs held: %d chunk(s) read "
                           "from them (its inbox copy was lost)", ctx.id, session.wf_id, session.stage,
                           time.monotonic() - session.waiting_since if session.waiting_since else 0.0, queued)
        return queued
