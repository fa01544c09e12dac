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

from omniflow import tracing
from omniflow.engine.reconciler.context import ReconcilerContext
from omniflow.engine.reconciler.events import EVENT_BATCH, Events, trace_decision
from omniflow.errors import MalformedEntry, RedisError, ScriptError
from omniflow.models import WorkflowState
from omniflow.storage import listing, redisio, registry
from omniflow.storage.entries import EventKind, retry_member
from omniflow.storage.entries import task as task_entry
from omniflow.storage.keys import EVENT_GROUP, TASK_GROUP
from omniflow.pipeline import stage_queue
from omniflow.storage.schema import RecordField, csv, now_ms, s
from omniflow.storage.transitions import admission, housekeeping, reconcile
from omniflow.storage.transitions.admission import AbortResult
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
        reply = await redisio.call(self.ctx.redis, *housekeeping.leader_lease(self.ctx.keys, self.ctx.id, ttl_ms=ttl_ms))
        return housekeeping.lease_code(reply) is not housekeeping.LeaseResult.HELD

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
            raw_queues, raw_stages = await self.ctx.redis.hmget(self.ctx.keys.worker_info(worker_id), "queues", "stage")
            # the queues it claimed from (`<stage>@<version>`); a worker that published none: the
            # default pipeline's queues of the stages it named (or of every stage)
            stages = [q for q in csv(s(raw_queues)) if "@" in q] or [
                self.ctx.pipeline.queue(x) for x in (
                    [x for x in csv(s(raw_stages)) if x in self.ctx.pipeline.stages] or self.ctx.pipeline.order)]
            await self.ctx.learn({q.partition("@")[2] for q in stages})
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
                reaped = await self._run_scripts([housekeeping.reap_consumer(stream, TASK_GROUP, worker_id)
                                                  for name in stages for cell in self.ctx.keys.all_cells
                                                  for stream in self.ctx.keys.task_streams(name, cell)])
                if all(r == housekeeping.ReapResult.GONE for r in reaped):
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

    async def _requeue_pending(self, queue: str, cell: int, worker_id: str, stream: str) -> tuple[int, int]:
        stage, _, version = queue.partition("@")
        pipeline = self.ctx.pipeline_of(version) or self.ctx.pipeline
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
        lost: list[tuple[int, str, int]] = []     # (its call, workflow, attempt) of each lost session
        for p, rows in zip(pending, found):
            if not rows:
                continue
            entry_id, fields = s(p["message_id"]), rows[0][1]
            try:
                task = task_entry(fields, stage=stage)
            except MalformedEntry as exc:
                calls.append(reconcile.dead_letter(self.ctx.keys.dlq(stage, cell), stream, TASK_GROUP, entry_id, fields,
                                                   f"malformed task entry: {exc}", max_len=self.ctx.settings.dlq_max_len))
                continue
            if self.ctx.keys.cell_of(task.wf_id) != cell:
                calls.append(reconcile.dead_letter(self.ctx.keys.dlq(stage, cell), stream, TASK_GROUP, entry_id, fields,
                                                   f"task of workflow {task.wf_id} in cell {cell}",
                                                   max_len=self.ctx.settings.dlq_max_len))
                continue
            if stage not in pipeline.stages:     # a version no longer known anywhere: leave it pending
                continue
            calls.append(self.events.stage_event_call(task.wf_id, stage, EventKind.LOST.value, task.attempt, now,
                                                f"worker {worker_id} stopped heartbeating", retryable=True,
                                                due_ms=now, task=(stream, entry_id), pipeline=pipeline))
            lost.append((len(calls) - 1, task.wf_id, task.attempt))
        begun = tracing.now_ns() if tracing.tracer is not None else 0
        results = await self._run_scripts(calls)
        if begun and len(results) == len(calls):
            for i, wf_id, attempt in lost:
                trace_decision(results[i], begun, reconciler=self.ctx.id, wf_id=wf_id, stage=stage, attempt=attempt,
                               kind=EventKind.LOST.value, detail=f"worker {worker_id} stopped heartbeating")
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
        due_retries: list[tuple[str, str, int, str]] = []
        due_n = 0
        for cell, due in await self._due(self.ctx.keys.retries):
            due_n += len(due)
            for member in due:
                try:
                    wf_id, stage, attempt = retry_member(member)
                    if self.ctx.keys.cell_of(wf_id) != cell:
                        raise MalformedEntry(f"workflow {wf_id} is not in cell {cell}")
                except MalformedEntry as exc:
                    poison.append((cell, member, str(exc)))
                    continue
                due_retries.append((wf_id, stage, attempt, member))
        if due_retries:
            # the task stream is named by the record's pipeline version: read it, so that the script
            # declares the stream it writes (retries are off the happy path: one pipelined read a sweep)
            pipe = self.ctx.redis.pipeline(transaction=False)
            for wf_id, *_ in due_retries:
                pipe.hget(self.ctx.keys.wf(wf_id), RecordField.PIPELINE_HASH)
            versions = await pipe.execute()
            calls = [reconcile.retry_due(self.ctx.keys, wf_id, stage, attempt, member, version=s(version or b""))
                     for (wf_id, stage, attempt, member), version in zip(due_retries, versions)]
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
        reasons = await self._deadline_reasons([wf_id for _cell, wf_id in late])
        begun = tracing.now_ns() if tracing.tracer is not None else 0
        results = await self._run_scripts([
            admission.abort(self.ctx.keys, self.ctx.finalize_plan, wf_id, now_ms=now_ms(), state=WorkflowState.FAILED,
                            reason=reason, stage=stage, tombstone_ttl_s=self.ctx.settings.tombstone_ttl_s,
                            result_ttl_s=self.ctx.settings.result_ttl_s)
            for (_cell, wf_id), (reason, stage) in zip(late, reasons)])
        if begun:
            for (_cell, wf_id), (reason, _stage), r in zip(late, reasons, results):
                if not isinstance(r, Exception) and admission.abort_code(r) is AbortResult.OK:
                    tracing.decision("abort", traceparent=s(r[-1]), start_ns=begun, error=reason,
                                     **{"workflow.id": wf_id, "reconciler": self.ctx.id})
        # A record that expired or vanished ('gone') must not pin an admission slot; one whose abort
        # failed (e.g. NOSCRIPT twice) stays, so that the next sweep fails it properly.
        stray = [(cell, wf_id) for (cell, wf_id), r in zip(late, results)
                 if not isinstance(r, Exception)
                 and admission.abort_code(r) in (AbortResult.GONE, AbortResult.TERMINAL)]
        for cell, wf_id in stray:
            await self.ctx.redis.zrem(self.ctx.keys.inflight(cell), wf_id)
        self.ctx.counts["deadline"] += len(late)
        return len(late)

    async def _deadline_reasons(self, wf_ids: list[str]) -> list[tuple[str, str]]:
        """Why each late workflow fails, and the stage to blame: 'deadline exceeded', or, when a
        session of it still waits for a worker and no live worker serves its pipeline version,
        that (a workflow finishes on the version it started with: docs/architecture.md)."""
        keys, redis = self.ctx.keys, self.ctx.redis
        pipe = redis.pipeline(transaction=False)
        for wf_id in wf_ids:
            pipe.hmget(keys.wf(wf_id), RecordField.PIPELINE, RecordField.PIPELINE_HASH, RecordField.STAGES,
                       RecordField.STAGES_IN_RECORD)
        records = await pipe.execute()
        pipe = redis.pipeline(transaction=False)
        for wf_id, (_name, _version, raw_stages, sl) in zip(wf_ids, records):
            pipe.hmget(keys.stage_hash(wf_id, {RecordField.STAGES_IN_RECORD: s(sl)}), *(csv(s(raw_stages)) or ["-"]))
        statuses = await pipe.execute()
        served = await registry.served(redis, keys)
        out: list[tuple[str, str]] = []
        for (raw_name, raw_version, raw_stages, _sl), status in zip(records, statuses):
            name, version = s(raw_name), s(raw_version)
            waiting = [st for st, value in zip(csv(s(raw_stages)), status) if s(value) == "pending"
                       and version and stage_queue(st, version) not in served]
            if waiting:
                out.append((f"deadline exceeded: no worker serves pipeline {name!r} version {version} "
                            f"(stage {waiting[0]} waited for one); a workflow finishes on the version it "
                            "started with", waiting[0]))
            else:
                out.append(("deadline exceeded", ""))
        return out

    async def consumers(self, *, idle_ms: int | None = None) -> int:
        """Delete the consumers crashed reconcilers left in the event group (one per crash, forever
        otherwise; a restarted reconciler has a new name): those idle for longer than `idle_ms`."""
        if idle_ms is None:
            idle_ms = max(MIN_DEAD_CONSUMER_IDLE_MS, 10 * self.ctx.settings.block_ms, 3 * self.ctx.settings.event_claim_idle_ms)
        reaped = 0
        for cell in self.ctx.keys.all_cells:
            try:
                reaped += await housekeeping.reap_idle_consumers(self.ctx.redis, self.ctx.keys.events(cell), EVENT_GROUP,
                                                                 idle_ms=idle_ms, keep=self.ctx.id)
            except ScriptError:             # no such group yet
                continue
        return reaped
