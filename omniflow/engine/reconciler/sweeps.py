"""The reconciler's periodic work: reclaiming events a dead reconciler left pending, and under the
leased leader the sweeps over every cell: workers whose lease lapsed (their sessions, i.e. their
pending task entries, are re-queued with attempt + 1), scheduled retries that are due, workflow
deadlines, the consumers dead reconcilers left, and the listing index. Every step is idempotent, so
two reconcilers sweeping at once is harmless."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from omniflow.client.store import abort_call
from omniflow.engine.reconciler.context import ReconcilerContext
from omniflow.engine.reconciler.events import EVENT_BATCH, Events
from omniflow.errors import MalformedEntry, RedisError, ScriptError
from omniflow.models import WorkflowState
from omniflow.storage import listing, redisio
from omniflow.storage.entries import EventKind, retry_member
from omniflow.storage.entries import task as task_entry
from omniflow.storage.keys import EVENT_GROUP, TASK_GROUP
from omniflow.storage.schema import csv, now_ms, s
from omniflow.storage.scripts import evalsha_args
from omniflow.storage.topology import is_cluster

logger = logging.getLogger(__name__)

SWEEP_BATCH = 200
CONSUMER_SWEEP_EVERY = 20       # sweeps between two passes over the event groups' dead consumers
#: a consumer of the event group that holds nothing and has not read for this long belongs to a
#: reconciler that is gone (a live one reads at least once per `block_ms`)
MIN_DEAD_CONSUMER_IDLE_MS = 60_000


class Sweeps:
    """The periodic passes of one reconciler."""

    def __init__(self, ctx: ReconcilerContext, events: Events) -> None:
        self.ctx = ctx
        self.events = events
        self.passes = 0

    async def run(self) -> None:
        failing = False
        next_host_sweep = asyncio.get_running_loop().time() + self.ctx.settings.dataplane_sweep_interval_s / 2
        while True:
            await asyncio.sleep(self.ctx.settings.sweep_interval_s)
            try:
                await self._reclaim_events()
                if await self._lead():
                    await self.sweep()
                if asyncio.get_running_loop().time() >= next_host_sweep:
                    # this host's shared-memory segments (every reconciler: segments are per host)
                    next_host_sweep += self.ctx.settings.dataplane_sweep_interval_s
                    freed = await self.ctx.plane.sweep()
                    self.ctx.counts["segments_swept"] += sum(freed.values())
                failing = False
            except RedisError as exc:     # refused, lost, a server restarting: never stop sweeping
                if not failing:
                    logger.warning("reconciler %s: sweep failed: %s", self.ctx.id, exc)
                failing = True

    @redisio.translated
    async def _lead(self) -> bool:
        ttl_ms = int(self.ctx.settings.sweep_interval_s * 3000)
        if await self.ctx.redis.set(self.ctx.keys.leader, self.ctx.id, nx=True, px=ttl_ms):
            return True
        if s(await self.ctx.redis.get(self.ctx.keys.leader)) == self.ctx.id:
            await self.ctx.redis.pexpire(self.ctx.keys.leader, ttl_ms)
            return True
        return False

    @redisio.translated
    async def _reclaim_events(self) -> None:
        pipe = self.ctx.redis.pipeline(transaction=False)
        for cell in self.ctx.keys.all_cells:
            pipe.xautoclaim(self.ctx.keys.events(cell), EVENT_GROUP, self.ctx.id,
                            min_idle_time=self.ctx.settings.event_claim_idle_ms, start_id="0-0", count=EVENT_BATCH)
        for cell, reply in zip(self.ctx.keys.all_cells, await pipe.execute()):
            entries = list(reply[1])
            if entries:
                logger.info("reconciler %s reclaimed %d pending event(s) of cell %d", self.ctx.id, len(entries), cell)
                await self.events.apply(entries, cell)

    @redisio.translated
    async def sweep(self) -> dict[str, int]:
        """One pass of the periodic work, over every cell. Safe to run concurrently (every step is
        idempotent)."""
        self.passes += 1
        done = {"lost": await self.dead_workers(), "retries": await self.retries(),
                "deadlines": await self.deadlines(), "loaders": await self.lapsed_loaders(),
                # housekeeping: consumers of crashed reconcilers (a few per crash) go at a slower pace
                "consumers": await self.consumers() if self.passes % CONSUMER_SWEEP_EVERY == 1 else 0}
        await listing.trim(self.ctx.redis, self.ctx.keys,
                           now_ms() - int((self.ctx.settings.result_ttl_s + self.ctx.settings.max_deadline_s) * 1000))
        return done

    async def _run_scripts(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        """Run script calls in one round trip (`redisio.execute`: NOSCRIPT handled); errors are
        returned in place and logged, never ignored."""
        if not calls:
            return []
        results = await redisio.execute(self.ctx.redis, calls)
        for result in results:
            if isinstance(result, Exception):
                logger.error("reconciler script failed: %s", result)
        return results

    async def dead_workers(self) -> int:
        dead = [s(w) for w in await self.ctx.redis.zrangebyscore(self.ctx.keys.workers, "-inf", now_ms(), start=0, num=50)]
        requeued = 0
        for worker_id in dead:
            served = csv(s(await self.ctx.redis.hget(self.ctx.keys.worker_info(worker_id), "stage")))
            stages = [x for x in served if x in self.ctx.pipeline.stages] or list(self.ctx.pipeline.order)
            left = mine = 0
            for name in stages:
                for cell in self.ctx.keys.all_cells:
                    for stream in self.ctx.keys.task_streams(name, cell):
                        n, more = await self._requeue_pending(name, cell, worker_id, stream)
                        mine += n
                        left += more
            requeued += mine
            if left == 0:
                # Delete the consumer only if it holds nothing: XGROUP DELCONSUMER drops its pending
                # entries, and a worker declared dead may still be alive (SIGSTOP, a long GC pause)
                # and have read new tasks since we listed them. Such a worker re-registers with its
                # next heartbeat; its stale sessions are fenced by attempt.
                reaped = await self._run_scripts([evalsha_args("reap_consumer", [stream], [TASK_GROUP, worker_id])
                                                  for name in stages for cell in self.ctx.keys.all_cells
                                                  for stream in self.ctx.keys.task_streams(name, cell)])
                if all(r == 1 for r in reaped):
                    pipe = self.ctx.redis.pipeline(transaction=False)
                    pipe.zrem(self.ctx.keys.workers, worker_id)
                    pipe.delete(self.ctx.keys.worker_info(worker_id))
                    for cell in self.ctx.keys.all_cells:        # one key per command: one slot each on a cluster
                        pipe.delete(self.ctx.keys.inbox(worker_id, cell))
                    await pipe.execute(raise_on_error=False)
                    if mine:
                        logger.warning("worker %s is gone; %d session(s) re-queued", worker_id, mine)
                    else:      # a worker that stopped cleanly (or held nothing): nothing was at risk
                        logger.info("worker %s is gone; it held no session", worker_id)
        self.ctx.counts["lost"] += requeued
        return requeued

    async def lapsed_loaders(self) -> int:
        """Workers that died while loading their models (their loading announcement lapsed): out of
        the loading set, and their info hash deleted unless they took a lease meanwhile. They held
        nothing, so nothing is re-queued."""
        keys, redis = self.ctx.keys, self.ctx.redis
        lapsed = [s(w) for w in await redis.zrangebyscore(keys.workers_loading, "-inf", now_ms(), start=0,
                                                          num=SWEEP_BATCH)]
        if not lapsed:
            return 0
        pipe = redis.pipeline(transaction=False)
        for worker_id in lapsed:
            pipe.zscore(keys.workers, worker_id)
        leased = await pipe.execute()
        pipe = redis.pipeline(transaction=False)
        for worker_id, score in zip(lapsed, leased):
            pipe.zrem(keys.workers_loading, worker_id)
            if score is None:
                pipe.delete(keys.worker_info(worker_id))
                logger.info("worker %s stopped while loading its models; forgotten", worker_id)
        await pipe.execute(raise_on_error=False)
        return len(lapsed)

    async def _requeue_pending(self, stage: str, cell: int, worker_id: str, stream: str) -> tuple[int, int]:
        try:
            with redisio.boundary():
                pending = await self.ctx.redis.xpending_range(stream, TASK_GROUP, min="-", max="+", count=SWEEP_BATCH,
                                                          consumername=worker_id)
        except ScriptError:             # no such stream or group (yet)
            return 0, 0
        if not pending:
            return 0, 0
        pipe = self.ctx.redis.pipeline(transaction=False)
        for p in pending:
            pipe.xrange(stream, p["message_id"], p["message_id"])
        found = await pipe.execute()
        now = now_ms()
        gone = [s(p["message_id"]) for p, rows in zip(pending, found) if not rows]
        if gone:    # the entry was deleted (its session finished or was dropped): just un-pend it
            await self.ctx.redis.xack(stream, TASK_GROUP, *gone)
        calls = []
        for p, rows in zip(pending, found):
            if not rows:
                continue
            entry_id, fields = s(p["message_id"]), rows[0][1]
            try:
                task = task_entry(fields, stage=stage)
            except MalformedEntry as exc:
                calls.append(redisio.dead_letter_call(self.ctx.keys.dlq(stage, cell), stream, TASK_GROUP, entry_id, fields,
                                                      f"malformed task entry: {exc}",
                                                      max_len=self.ctx.settings.dlq_max_len))
                continue
            if self.ctx.keys.cell_of(task.wf_id) != cell:
                calls.append(redisio.dead_letter_call(self.ctx.keys.dlq(stage, cell), stream, TASK_GROUP, entry_id, fields,
                                                      f"task of workflow {task.wf_id} in cell {cell}",
                                                      max_len=self.ctx.settings.dlq_max_len))
                continue
            calls.append(self.events.stage_event_call(task.wf_id, stage, EventKind.LOST.value, task.attempt, now,
                                                f"worker {worker_id} stopped heartbeating", retryable=True,
                                                due_ms=now, task=(stream, entry_id)))
        results = await self._run_scripts(calls)
        failed = sum(isinstance(r, Exception) for r in results)
        # entries whose script failed are still pending: keep the consumer, try again next sweep
        return len(results) - failed, int(len(pending) == SWEEP_BATCH or failed > 0)

    async def _due(self, key_of: Callable[[int], str]) -> list[tuple[int, list[str]]]:
        """Per cell, the members of the zset `key_of(cell)` scored before now (one round trip)."""
        pipe = self.ctx.redis.pipeline(transaction=False)
        now = now_ms()
        for cell in self.ctx.keys.all_cells:
            pipe.zrangebyscore(key_of(cell), "-inf", now, start=0, num=SWEEP_BATCH)
        return [(cell, [s(m) for m in members]) for cell, members in zip(self.ctx.keys.all_cells, await pipe.execute())
                if members]

    async def retries(self) -> int:
        calls: list[tuple[Any, ...]] = []
        poison: list[tuple[int, str, str]] = []
        due_n = 0
        for cell, due in await self._due(self.ctx.keys.retries):
            due_n += len(due)
            for member in due:
                try:
                    wf_id, stage, attempt = retry_member(member, stages=self.ctx.pipeline.stages)
                    if self.ctx.keys.cell_of(wf_id) != cell:
                        raise MalformedEntry(f"workflow {wf_id} is not in cell {cell}")
                except MalformedEntry as exc:
                    poison.append((cell, member, str(exc)))
                    continue
                wf = self.ctx.keys.wf(wf_id)
                calls.append(evalsha_args(
                    "retry_due", [wf, self.ctx.keys.retries(cell), f"{wf}:stages",
                                  *self.ctx.keys.task_streams(stage, cell)],
                    [self.ctx.settings.prefix, member, stage, attempt]))
        await self._run_scripts(calls)
        for cell, member, reason in poison:
            pipe = self.ctx.redis.pipeline(transaction=not is_cluster(self.ctx.redis))    # one slot: both of the cell
            pipe.xadd(self.ctx.keys.dlq("retries", cell), {"member": member, "reason": reason},
                      maxlen=self.ctx.settings.dlq_max_len, approximate=True)
            pipe.zrem(self.ctx.keys.retries(cell), member)
            await pipe.execute()
            self.ctx.counts["dead_letters"] += 1
        return due_n

    async def deadlines(self) -> int:
        late = [(cell, wf_id) for cell, ids in await self._due(self.ctx.keys.inflight) for wf_id in ids]
        if not late:
            return 0
        results = await self._run_scripts([
            abort_call(self.ctx.keys, self.ctx.settings, self.ctx.final_suffixes, wf_id, state=WorkflowState.FAILED,
                       reason="deadline exceeded") for _cell, wf_id in late])
        # A record that expired or vanished ('gone') must not pin an admission slot; one whose abort
        # failed (e.g. NOSCRIPT twice) stays, so that the next sweep fails it properly.
        stray = [(cell, wf_id) for (cell, wf_id), r in zip(late, results)
                 if not isinstance(r, Exception) and s(r[0]) in ("gone", "terminal")]
        for cell, wf_id in stray:
            await self.ctx.redis.zrem(self.ctx.keys.inflight(cell), wf_id)
        self.ctx.counts["deadline"] += len(late)
        return len(late)

    async def consumers(self, *, idle_ms: int | None = None) -> int:
        """Delete the consumers crashed reconcilers left in the event group (one per crash, forever
        otherwise; a restarted reconciler has a new name): those idle for longer than `idle_ms`."""
        if idle_ms is None:
            idle_ms = max(MIN_DEAD_CONSUMER_IDLE_MS, 10 * self.ctx.settings.block_ms, 3 * self.ctx.settings.event_claim_idle_ms)
        reaped = 0
        for cell in self.ctx.keys.all_cells:
            try:
                reaped += await redisio.reap_idle_consumers(self.ctx.redis, self.ctx.keys.events(cell), EVENT_GROUP,
                                                            idle_ms=idle_ms, keep=self.ctx.id)
            except ScriptError:             # no such group yet
                continue
        return reaped
