"""The reconciler: the single place where workflow state advances.

- consumes `<p>:events` (group `reconciler`) in batches and applies each event
  with `stage_event.lua` (idempotent, so two reconcilers, or a replay after a
  crash, never double-transition), which acks and deletes the event in the same
  atomic step: an event whose call was refused (OOM, READONLY...) or lost stays
  pending and is applied again (this reconciler re-reads its pending entries
  first); an event that does not decode, or that its script fails on, goes to
  `<p>:dlq:events` with the reason;
- reclaims events left pending by a dead reconciler (XAUTOCLAIM), and deletes
  the consumers that dead reconcilers left in the group;
- under a leased leader, sweeps periodically: workers whose lease lapsed
  (their sessions, i.e. their pending task entries, are re-queued with
  attempt + 1), scheduled retries that are due, workflow deadlines, and the
  listing index.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis

from omniflow.storage import listing, redisio
from omniflow.config import Settings
from omniflow.dataplane import DataPlane
from omniflow.storage.entries import EventKind, event, retry_member
from omniflow.storage.entries import task as task_entry
from omniflow.errors import MalformedEntry, RedisError, RedisUnavailable, ScriptError
from omniflow.storage.keys import DLQ_EVENTS, EVENT_GROUP, TASK_GROUP, Keys, finalize_suffixes
from omniflow.models import WorkflowState
from omniflow.pipeline import Pipeline
from omniflow.storage.redisio import connect, ensure_group
from omniflow.runtime import Backoff, check_eviction_policy, check_layout, forever, when_redis_answers
from omniflow.storage.scripts import evalsha_args
from omniflow.client.store import abort_call
from omniflow.storage.schema import csv, now_ms, s
from omniflow.storage.topology import is_cluster, read_groups

logger = logging.getLogger(__name__)

EVENT_BATCH = 256
SWEEP_BATCH = 200
CONSUMER_SWEEP_EVERY = 20       # sweeps between two passes over the event groups' dead consumers
PENDING = "pending"                     # an event Redis refused or lost: it stays pending, applied later
MAX_BACKOFF_DOUBLINGS = 60              # 2**60 x any base is past every cap: no overflow, whatever the attempt
#: a consumer of the event group that holds nothing and has not read for this long belongs to a
#: reconciler that is gone (a live one reads at least once per `block_ms`)
MIN_DEAD_CONSUMER_IDLE_MS = 60_000


def backoff_ms(attempt: int, *, base_s: float, cap_s: float, jitter: float, rng: random.Random) -> int:
    """Exponential backoff with jitter and a cap, for the retry after `attempt` failed."""
    delay = min(cap_s, base_s * (2 ** min(MAX_BACKOFF_DOUBLINGS, max(0, attempt - 1))))
    return int(delay * (1 + rng.uniform(-jitter, jitter)) * 1000)


class Reconciler:
    def __init__(self, *, settings: Settings, pipeline: Pipeline, redis_url: str,
                 reconciler_id: str | None = None) -> None:
        self.settings = settings
        self.pipeline = pipeline
        # the layout (how many cells) is known once connected: see `_setup`
        self.keys = Keys(settings.prefix, settings.cells or 1)
        self.redis_url = redis_url
        self.id = reconciler_id or f"rec-{settings.host_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._rng = random.Random()
        self.started = asyncio.Event()
        self._redis_ok_at = 0.0         # monotonic time of the last event read that Redis answered
        self._sweeps = 0
        self._final_suffixes = finalize_suffixes(pipeline)
        self.counts: dict[str, int] = {"events": 0, "completed": 0, "failed": 0, "retry": 0, "ignored": 0,
                                       "lost": 0, "deadline": 0, "dead_letters": 0, "segments_swept": 0}

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        self._clients: list[Redis] = []
        try:
            if not await when_redis_answers(self._setup, what=f"reconciler {self.id}", url=self.redis_url,
                                            stop=stop):
                return
            tasks = [asyncio.create_task(forever(f"reconciler {self.id}: consume {g[0]}",
                                                 functools.partial(self._consume, g)), name=f"consume:{g[0]}")
                     for g in read_groups(self.redis, self.keys.cells)]
            tasks.append(asyncio.create_task(forever(f"reconciler {self.id}: sweeps", self._sweeper), name="sweeper"))
            self._redis_ok_at = time.monotonic()
            self.started.set()
            logger.info("reconciler %s running", self.id)
            await stop.wait()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._leave()
        finally:
            for client in self._clients:
                await client.aclose()

    async def _setup(self) -> None:
        if not self._clients:
            self.redis = connect(self.redis_url)        # asks what kind of server this is: may raise
            self._blocking = connect(self.redis_url)
            self._clients = [self.redis, self._blocking]
            self.plane = DataPlane(self.redis, self.settings, worker_id=self.id)
            redisio.require_replicas(self.redis, self.settings.wait_replicas, self.settings.wait_timeout_ms)
            self.keys = Keys.of(self.settings, self.redis)
        await check_eviction_policy(self.redis)
        await check_layout(self.redis, self.keys)
        await redisio.load_scripts(self.redis)
        for cell in self.keys.all_cells:
            await ensure_group(self.redis, self.keys.events(cell), EVENT_GROUP)
            for stage in self.pipeline.order:
                await ensure_group(self.redis, self.keys.tasks(stage, cell), TASK_GROUP)

    def stage_event_keys(self, wf_id: str, stage: str) -> list[str]:
        """KEYS of a `stage_event.lua` call (see its header): all of `wf_id`'s cell."""
        wf, cell, keys = self.keys.wf(wf_id), self.keys.cell_of(wf_id), self.keys
        return [wf, keys.inflight(cell), keys.retries(cell), keys.events(cell), keys.dlq(stage, cell),
                *(keys.tasks(st, cell) for st in self.pipeline.order),
                *keys.finalize_keys(wf_id, self._final_suffixes)]

    async def _leave(self) -> None:
        """Delete our consumer from the event group if it holds nothing (a crashed reconciler's
        consumer is deleted by the sweeps once it has been idle long enough)."""
        try:
            await redisio.execute(self.redis, [evalsha_args("reap_consumer", [self.keys.events(cell)],
                                                            [EVENT_GROUP, self.id]) for cell in self.keys.all_cells])
        except RedisError as exc:
            logger.warning("reconciler %s: could not leave the event group: %s", self.id, exc)

    # ------------------------------------------------------------ events
    async def _consume(self, cells: tuple[int, ...] = (0,)) -> None:
        """Read the events of `cells` (one read for all of them on a single server, one loop per cell
        on a cluster) and apply them. After an event could not be applied (Redis refused or was
        lost), this reconciler's own pending entries are read again first (XREADGROUP from 0)."""
        backoff = Backoff()
        backlog = True                  # our pending entries first: at start, and after a failure
        streams = {self.keys.events(cell): cell for cell in cells}
        while True:
            try:
                with redisio.boundary():
                    reply = await self._blocking.xreadgroup(
                        EVENT_GROUP, self.id, dict.fromkeys(streams, "0" if backlog else ">"), count=EVENT_BATCH,
                        block=None if backlog else self.settings.block_ms)
                self._redis_ok_at = time.monotonic()
                got = [(streams[s(stream)], entries) for stream, entries in reply or [] if entries]
                if backlog and not got:
                    backlog = False
                    continue
                codes = [code for cell, entries in got for code in await self.apply(entries, cell)]
                if PENDING in codes:
                    backlog = True
                    await backoff.wait(logger, f"reconciler {self.id}: events not applied", RedisUnavailable(
                        "Redis refused or lost some stage_event calls"))
                    continue
                backoff.reset()
            except RedisError as exc:
                backlog = True
                if redisio.is_nogroup(exc):
                    try:
                        for stream in streams:
                            await ensure_group(self.redis, stream, EVENT_GROUP)
                        continue
                    except RedisError as again:
                        exc = again
                await backoff.wait(logger, f"reconciler {self.id}: reading events failed", exc)

    def ready(self) -> tuple[bool, str]:
        """For `/readyz`: started, and an event read answered within one blocking read plus a lease."""
        if not self.started.is_set():
            return False, "starting"
        age_s = time.monotonic() - self._redis_ok_at
        if age_s > self.settings.block_ms / 1000 + self.settings.lease_timeout_s:
            return False, f"no event read answered for {age_s:.1f}s"
        return True, ""

    def _event_call(self, entry_id: bytes | str, fields: dict[bytes, bytes] | None, now: int,
                    cell: int) -> tuple[Any, ...]:
        """The `stage_event.lua` call of one event entry of `cell`; `MalformedEntry` when it does not
        decode (or names a workflow of another cell)."""
        ev = event(fields, stages=self.pipeline.stages)
        if self.keys.cell_of(ev.wf_id) != cell:
            raise MalformedEntry(f"workflow {ev.wf_id} is not in cell {cell}")
        retry = self.pipeline.stages[ev.stage].retry
        due, task = now, ("", "")
        if ev.kind is EventKind.FAILED:   # only a failure waits before its retry
            due += backoff_ms(ev.attempt, base_s=retry.backoff_s, cap_s=retry.backoff_max_s,
                              jitter=retry.jitter, rng=self._rng)
        elif ev.kind is EventKind.LOST:   # a live worker lost Redis mid-session: ack its task, retry it at once
            task = (self.keys.tasks(ev.stage, cell), ev.task_entry)
        return self._stage_event_call(ev.wf_id, ev.stage, ev.kind.value, ev.attempt, now, ev.detail,
                                      retryable=ev.retryable, due_ms=due, task=task, event_id=entry_id)

    def _stage_event_call(self, wf_id: str, stage: str, kind: str, attempt: int, now: int, detail: str, *,
                          retryable: bool, due_ms: int, task: tuple[str, bytes | str] = ("", ""),
                          event_id: bytes | str = "") -> tuple[Any, ...]:
        """A `stage_event.lua` call (ARGV: see its header): `task` is the (stream, entry) a `lost`
        session's task is acknowledged in, `event_id` the event entry it applies ('' for a sweep's)."""
        stream, entry = task
        return evalsha_args(
            "stage_event", self.stage_event_keys(wf_id, stage),
            [self.settings.prefix, kind, stage, attempt, now, detail, "1" if retryable else "0",
             self.pipeline.stages[stage].retry.max_attempts, due_ms, self.settings.tombstone_ttl_s,
             self.settings.result_ttl_s, stream, entry, TASK_GROUP if stream else "", EVENT_GROUP, event_id,
             self.settings.dlq_max_len])

    def _dead_letter_call(self, entry_id: bytes | str, fields: dict[bytes, bytes] | None, reason: str,
                          cell: int) -> tuple[Any, ...]:
        return redisio.dead_letter_call(self.keys.dlq(DLQ_EVENTS, cell), self.keys.events(cell), EVENT_GROUP, entry_id,
                                        fields, reason, max_len=self.settings.dlq_max_len)

    async def apply(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]], cell: int = 0) -> list[str]:
        """Apply a batch of events in one round trip; returns each result code.

        Each event is acked by its own script call, so only applied events are acked. Codes: the
        script's ('advanced', 'completed', 'retry', 'failed', 'ignored'), 'dead_letter' (malformed,
        or its script failed: moved to the cell's `dlq:events` with the reason), or `PENDING` (Redis refused
        or lost the call: the event stays pending and is applied later)."""
        now = now_ms()
        calls: list[tuple[Any, ...]] = []
        codes: list[str | None] = []
        for entry_id, fields in entries:
            if not fields:                 # deleted while pending (an old reconciler's XDEL): just un-pend it
                calls.append(("XACK", self.keys.events(cell), EVENT_GROUP, entry_id))
                codes.append("ignored")
                continue
            try:
                calls.append(self._event_call(entry_id, fields, now, cell))
                codes.append(None)
            except MalformedEntry as exc:
                calls.append(self._dead_letter_call(entry_id, fields, f"malformed event: {exc}", cell))
                codes.append("dead_letter")
        try:
            results = await redisio.execute(self.redis, calls)
        except RedisUnavailable as exc:
            logger.warning("reconciler %s: applying %d event(s) failed: %s", self.id, len(entries), exc)
            return [PENDING] * len(entries)
        out: list[str] = []
        poison: list[tuple[Any, ...]] = []
        for (entry_id, fields), code, result in zip(entries, codes, results):
            if isinstance(result, RedisUnavailable):
                code = PENDING
            elif isinstance(result, Exception):      # the script failed on this event: poison
                logger.error("reconciler %s: event %s failed: %s", self.id, s(entry_id), result)
                poison.append(self._dead_letter_call(entry_id, fields, f"stage_event failed: {result}", cell))
                code = "dead_letter"
            elif code is None:
                code = s(result[0])
            self.counts[code] = self.counts.get(code, 0) + 1
            out.append(code)
        self.counts["events"] += len(entries)
        if poison:
            try:
                failed = [r for r in await redisio.execute(self.redis, poison) if isinstance(r, Exception)]
            except RedisUnavailable as exc:
                failed = [exc]
            if failed:        # they stay pending: the next pass tries again
                logger.warning("reconciler %s: could not dead-letter %d event(s): %s", self.id, len(failed), failed[0])
                out = [PENDING if c == "dead_letter" else c for c in out]
        return out

    # ------------------------------------------------------------ sweeps
    async def _sweeper(self) -> None:
        failing = False
        next_host_sweep = asyncio.get_running_loop().time() + self.settings.dataplane_sweep_interval_s / 2
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self._reclaim_events()
                if await self._lead():
                    await self.sweep()
                if asyncio.get_running_loop().time() >= next_host_sweep:
                    # this host's shared-memory segments (every reconciler: segments are per host)
                    next_host_sweep += self.settings.dataplane_sweep_interval_s
                    freed = await self.plane.sweep()
                    self.counts["segments_swept"] += sum(freed.values())
                failing = False
            except RedisError as exc:     # refused, lost, a server restarting: never stop sweeping
                if not failing:
                    logger.warning("reconciler %s: sweep failed: %s", self.id, exc)
                failing = True

    @redisio.translated
    async def _lead(self) -> bool:
        ttl_ms = int(self.settings.sweep_interval_s * 3000)
        if await self.redis.set(self.keys.leader, self.id, nx=True, px=ttl_ms):
            return True
        if s(await self.redis.get(self.keys.leader)) == self.id:
            await self.redis.pexpire(self.keys.leader, ttl_ms)
            return True
        return False

    @redisio.translated
    async def _reclaim_events(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for cell in self.keys.all_cells:
            pipe.xautoclaim(self.keys.events(cell), EVENT_GROUP, self.id, min_idle_time=self.settings.event_claim_idle_ms,
                            start_id="0-0", count=EVENT_BATCH)
        for cell, reply in zip(self.keys.all_cells, await pipe.execute()):
            entries = list(reply[1])
            if entries:
                logger.info("reconciler %s reclaimed %d pending event(s) of cell %d", self.id, len(entries), cell)
                await self.apply(entries, cell)

    @redisio.translated
    async def sweep(self) -> dict[str, int]:
        """One pass of the periodic work, over every cell. Safe to run concurrently (every step is
        idempotent)."""
        self._sweeps += 1
        done = {"lost": await self._sweep_dead_workers(), "retries": await self._sweep_retries(),
                "deadlines": await self._sweep_deadlines(),
                # housekeeping: consumers of crashed reconcilers (a few per crash) go at a slower pace
                "consumers": await self._sweep_consumers() if self._sweeps % CONSUMER_SWEEP_EVERY == 1 else 0}
        await listing.trim(self.redis, self.keys,
                           now_ms() - int((self.settings.result_ttl_s + self.settings.max_deadline_s) * 1000))
        return done

    async def _run_scripts(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        """Run script calls in one round trip (`redisio.execute`: NOSCRIPT handled); errors are
        returned in place and logged, never ignored."""
        if not calls:
            return []
        results = await redisio.execute(self.redis, calls)
        for result in results:
            if isinstance(result, Exception):
                logger.error("reconciler script failed: %s", result)
        return results

    async def _sweep_dead_workers(self) -> int:
        dead = [s(w) for w in await self.redis.zrangebyscore(self.keys.workers, "-inf", now_ms(), start=0, num=50)]
        requeued = 0
        for worker_id in dead:
            served = csv(s(await self.redis.hget(self.keys.worker_info(worker_id), "stage")))
            stages = [x for x in served if x in self.pipeline.stages] or list(self.pipeline.order)
            left = mine = 0
            for name in stages:
                for cell in self.keys.all_cells:
                    n, more = await self._requeue_pending(name, cell, worker_id)
                    mine += n
                    left += more
            requeued += mine
            if left == 0:
                # Delete the consumer only if it holds nothing: XGROUP DELCONSUMER drops its pending
                # entries, and a worker declared dead may still be alive (SIGSTOP, a long GC pause)
                # and have read new tasks since we listed them. Such a worker re-registers with its
                # next heartbeat; its stale sessions are fenced by attempt.
                reaped = await self._run_scripts([evalsha_args("reap_consumer", [self.keys.tasks(name, cell)],
                                                               [TASK_GROUP, worker_id])
                                                  for name in stages for cell in self.keys.all_cells])
                if all(r == 1 for r in reaped):
                    pipe = self.redis.pipeline(transaction=False)
                    pipe.zrem(self.keys.workers, worker_id)
                    pipe.delete(self.keys.worker_info(worker_id))
                    for cell in self.keys.all_cells:        # one key per command: one slot each on a cluster
                        pipe.delete(self.keys.inbox(worker_id, cell))
                    await pipe.execute(raise_on_error=False)
                    if mine:
                        logger.warning("worker %s is gone; %d session(s) re-queued", worker_id, mine)
                    else:      # a worker that stopped cleanly (or held nothing): nothing was at risk
                        logger.info("worker %s is gone; it held no session", worker_id)
        self.counts["lost"] += requeued
        return requeued

    async def _requeue_pending(self, stage: str, cell: int, worker_id: str) -> tuple[int, int]:
        stream = self.keys.tasks(stage, cell)
        try:
            with redisio.boundary():
                pending = await self.redis.xpending_range(stream, TASK_GROUP, min="-", max="+", count=SWEEP_BATCH,
                                                          consumername=worker_id)
        except ScriptError:             # no such stream or group (yet)
            return 0, 0
        if not pending:
            return 0, 0
        pipe = self.redis.pipeline(transaction=False)
        for p in pending:
            pipe.xrange(stream, p["message_id"], p["message_id"])
        found = await pipe.execute()
        now = now_ms()
        gone = [s(p["message_id"]) for p, rows in zip(pending, found) if not rows]
        if gone:    # the entry was deleted (its session finished or was dropped): just un-pend it
            await self.redis.xack(stream, TASK_GROUP, *gone)
        calls = []
        for p, rows in zip(pending, found):
            if not rows:
                continue
            entry_id, fields = s(p["message_id"]), rows[0][1]
            try:
                task = task_entry(fields, stage=stage)
            except MalformedEntry as exc:
                calls.append(redisio.dead_letter_call(self.keys.dlq(stage, cell), stream, TASK_GROUP, entry_id, fields,
                                                      f"malformed task entry: {exc}",
                                                      max_len=self.settings.dlq_max_len))
                continue
            if self.keys.cell_of(task.wf_id) != cell:
                calls.append(redisio.dead_letter_call(self.keys.dlq(stage, cell), stream, TASK_GROUP, entry_id, fields,
                                                      f"task of workflow {task.wf_id} in cell {cell}",
                                                      max_len=self.settings.dlq_max_len))
                continue
            calls.append(self._stage_event_call(task.wf_id, stage, EventKind.LOST.value, task.attempt, now,
                                                f"worker {worker_id} stopped heartbeating", retryable=True,
                                                due_ms=now, task=(stream, entry_id)))
        results = await self._run_scripts(calls)
        failed = sum(isinstance(r, Exception) for r in results)
        # entries whose script failed are still pending: keep the consumer, try again next sweep
        return len(results) - failed, int(len(pending) == SWEEP_BATCH or failed > 0)

    async def _due(self, key_of: Callable[[int], str]) -> list[tuple[int, list[str]]]:
        """Per cell, the members of the zset `key_of(cell)` scored before now (one round trip)."""
        pipe = self.redis.pipeline(transaction=False)
        now = now_ms()
        for cell in self.keys.all_cells:
            pipe.zrangebyscore(key_of(cell), "-inf", now, start=0, num=SWEEP_BATCH)
        return [(cell, [s(m) for m in members]) for cell, members in zip(self.keys.all_cells, await pipe.execute())
                if members]

    async def _sweep_retries(self) -> int:
        calls: list[tuple[Any, ...]] = []
        poison: list[tuple[int, str, str]] = []
        due_n = 0
        for cell, due in await self._due(self.keys.retries):
            due_n += len(due)
            for member in due:
                try:
                    wf_id, stage, attempt = retry_member(member, stages=self.pipeline.stages)
                    if self.keys.cell_of(wf_id) != cell:
                        raise MalformedEntry(f"workflow {wf_id} is not in cell {cell}")
                except MalformedEntry as exc:
                    poison.append((cell, member, str(exc)))
                    continue
                wf = self.keys.wf(wf_id)
                calls.append(evalsha_args(
                    "retry_due", [wf, self.keys.retries(cell), f"{wf}:stages", self.keys.tasks(stage, cell)],
                    [self.settings.prefix, member, stage, attempt]))
        await self._run_scripts(calls)
        for cell, member, reason in poison:
            pipe = self.redis.pipeline(transaction=not is_cluster(self.redis))    # one slot: both of the cell
            pipe.xadd(self.keys.dlq("retries", cell), {"member": member, "reason": reason},
                      maxlen=self.settings.dlq_max_len, approximate=True)
            pipe.zrem(self.keys.retries(cell), member)
            await pipe.execute()
            self.counts["dead_letters"] += 1
        return due_n

    async def _sweep_deadlines(self) -> int:
        late = [(cell, wf_id) for cell, ids in await self._due(self.keys.inflight) for wf_id in ids]
        if not late:
            return 0
        results = await self._run_scripts([
            abort_call(self.keys, self.settings, self._final_suffixes, wf_id, state=WorkflowState.FAILED,
                       reason="deadline exceeded") for _cell, wf_id in late])
        # A record that expired or vanished ('gone') must not pin an admission slot; one whose abort
        # failed (e.g. NOSCRIPT twice) stays, so that the next sweep fails it properly.
        stray = [(cell, wf_id) for (cell, wf_id), r in zip(late, results)
                 if not isinstance(r, Exception) and s(r[0]) in ("gone", "terminal")]
        for cell, wf_id in stray:
            await self.redis.zrem(self.keys.inflight(cell), wf_id)
        self.counts["deadline"] += len(late)
        return len(late)

    async def _sweep_consumers(self, *, idle_ms: int | None = None) -> int:
        """Delete the consumers crashed reconcilers left in the event group (one per crash, forever
        otherwise; a restarted reconciler has a new name): those idle for longer than `idle_ms`."""
        if idle_ms is None:
            idle_ms = max(MIN_DEAD_CONSUMER_IDLE_MS, 10 * self.settings.block_ms, 3 * self.settings.event_claim_idle_ms)
        reaped = 0
        for cell in self.keys.all_cells:
            try:
                reaped += await redisio.reap_idle_consumers(self.redis, self.keys.events(cell), EVENT_GROUP,
                                                            idle_ms=idle_ms, keep=self.id)
            except ScriptError:             # no such group yet
                continue
        return reaped


def run_reconciler(settings: Settings, pipeline: Pipeline, redis_url: str) -> None:
    from omniflow.engine.health import with_health
    from omniflow.runtime import run_until_signal

    rec = Reconciler(settings=settings, pipeline=pipeline, redis_url=redis_url)
    run_until_signal(with_health(rec.run, port=settings.health_port, ready=rec.ready))


