"""The reconciler: the single place where workflow state advances.

- consumes `<p>:events` (group `reconciler`) in batches and applies each event
  with `stage_event.lua` (idempotent, so two reconcilers, or a replay after a
  crash, never double-transition); acks and deletes the batch in the same
  round trip;
- reclaims events left pending by a dead reconciler (XAUTOCLAIM);
- under a leased leader, sweeps periodically: workers whose lease lapsed
  (their sessions, i.e. their pending task entries, are re-queued with
  attempt + 1), scheduled retries that are due, workflow deadlines, and the
  listing index.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import uuid
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omniflow import listing, scripts
from omniflow.config import Settings
from omniflow.keys import EVENT_GROUP, TASK_GROUP, Keys
from omniflow.pipeline import Pipeline
from omniflow.runtime import Backoff, check_eviction_policy
from omniflow.store import connect, csv, now_ms, s
from omniflow.worker import ensure_group

logger = logging.getLogger(__name__)

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)
EVENT_BATCH = 256

# Delete a consumer of a group only while it holds no pending entry (atomic: a worker declared dead
# may still be alive and read tasks between our XPENDING and the delete). Returns 1 when gone.
REAP_CONSUMER_LUA = """
local ok, p = pcall(redis.call, 'XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
if not ok then return 1 end
if #p > 0 then return 0 end
redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
SWEEP_BATCH = 200


def _noscript(result: Any) -> bool:
    """A NOSCRIPT reply (the server restarted or was flushed): redis-py says "No matching script"."""
    return isinstance(result, NoScriptError) or (isinstance(result, ResponseError) and "NOSCRIPT" in str(result))


def backoff_ms(attempt: int, *, base_s: float, cap_s: float, jitter: float, rng: random.Random) -> int:
    """Exponential backoff with jitter and a cap, for the retry after `attempt` failed."""
    delay = min(cap_s, base_s * (2 ** max(0, attempt - 1)))
    return int(delay * (1 + rng.uniform(-jitter, jitter)) * 1000)


class Reconciler:
    def __init__(self, *, settings: Settings, pipeline: Pipeline, redis_url: str,
                 reconciler_id: str | None = None) -> None:
        self.settings = settings
        self.pipeline = pipeline
        self.keys = Keys(settings.prefix)
        self.redis_url = redis_url
        self.id = reconciler_id or f"rec-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._rng = random.Random()
        self.started = asyncio.Event()
        self.counts: dict[str, int] = {"events": 0, "completed": 0, "failed": 0, "retry": 0, "ignored": 0,
                                       "lost": 0, "deadline": 0, "dead_letters": 0}

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        self.redis = connect(self.redis_url)
        self._blocking = connect(self.redis_url)
        try:
            await check_eviction_policy(self.redis)
            await scripts.load_all(self.redis)
            await ensure_group(self.redis, self.keys.events, EVENT_GROUP)
            for stage in self.pipeline.order:
                await ensure_group(self.redis, self.keys.tasks(stage), TASK_GROUP)
            tasks = [asyncio.create_task(self._consume(), name="consume"),
                     asyncio.create_task(self._sweeper(), name="sweeper")]
            self.started.set()
            logger.info("reconciler %s running", self.id)
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                if task.done() and task.exception():
                    logger.error("reconciler task %s died: %r", task.get_name(), task.exception())
                task.cancel()
            stopper.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await self.redis.aclose()
            await self._blocking.aclose()

    # ------------------------------------------------------------ events
    async def _consume(self) -> None:
        backoff = Backoff()
        while True:
            try:
                reply = await self._blocking.xreadgroup(
                    EVENT_GROUP, self.id, {self.keys.events: ">"}, count=EVENT_BATCH, block=self.settings.block_ms)
                for _stream, entries in reply or []:
                    if entries:
                        await self.apply(entries)
                backoff.reset()
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    raise
                await ensure_group(self.redis, self.keys.events, EVENT_GROUP)
            except REDIS_ERRORS as exc:
                await backoff.wait(logger, "reconciler", exc)

    def _event_call(self, fields: dict[bytes, bytes], now: int) -> tuple[Any, ...]:
        kind = s(fields[b"t"])
        wf_id, stage, attempt = s(fields[b"wf"]), s(fields[b"s"]), int(fields[b"a"])
        if kind not in ("done", "failed", "lost") or stage not in self.pipeline.stages or not wf_id:
            raise ValueError(f"event type {kind!r} for stage {stage!r}")
        retry = self.pipeline.stages[stage].retry
        due, task_args = now, ["", "", ""]
        if kind == "failed":   # only a failure waits before its retry
            due += backoff_ms(attempt, base_s=retry.backoff_s, cap_s=retry.backoff_max_s,
                              jitter=retry.jitter, rng=self._rng)
        elif kind == "lost":   # a live worker lost Redis mid-session: ack its task, retry it at once
            task_args = [self.keys.tasks(stage), s(fields.get(b"e")), TASK_GROUP]
        return scripts.evalsha_args(
            "stage_event", [self.keys.wf(wf_id), self.keys.inflight, self.keys.retries],
            [self.settings.prefix, kind, stage, attempt, now, s(fields.get(b"d")), s(fields.get(b"r")) or "0",
             retry.max_attempts, due, self.settings.tombstone_ttl_s, self.settings.result_ttl_s, *task_args],
        )

    async def apply(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[str]:
        """Apply a batch of events in one round trip (plus the ack); returns each result code."""
        now = now_ms()
        pipe = self.redis.pipeline(transaction=False)
        codes: list[str | None] = []
        for entry_id, fields in entries:
            try:
                pipe.execute_command(*self._event_call(fields, now))
                codes.append(None)
            except (KeyError, ValueError) as exc:
                self.counts["dead_letters"] += 1
                pipe.xadd(self.keys.dlq("events"), {**fields, b"reason": f"malformed event: {exc!r}".encode(),
                                                    b"entry": entry_id})
                codes.append("dead_letter")
        ids = [entry_id for entry_id, _ in entries]
        pipe.xack(self.keys.events, EVENT_GROUP, *ids)
        pipe.xdel(self.keys.events, *ids)
        results = await pipe.execute(raise_on_error=False)
        if any(_noscript(r) for r in results):
            await scripts.load_all(self.redis)
            return await self.apply(entries)     # idempotent: applied ones are ignored the second time
        out = []
        for code, result in zip(codes, results):
            if code is None:
                if isinstance(result, Exception):
                    logger.error("stage_event failed: %s", result)
                    code = "error"
                else:
                    code = s(result[0])
            self.counts[code] = self.counts.get(code, 0) + 1
            out.append(code)
        self.counts["events"] += len(entries)
        return out

    # ------------------------------------------------------------ sweeps
    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self._reclaim_events()
                if await self._lead():
                    await self.sweep()
            except REDIS_ERRORS as exc:
                logger.warning("reconciler sweep: %s", exc)
            except ResponseError as exc:     # e.g. a server restarting (LOADING): never stop sweeping
                logger.error("reconciler sweep failed: %s", exc)

    async def _lead(self) -> bool:
        ttl_ms = int(self.settings.sweep_interval_s * 3000)
        if await self.redis.set(self.keys.leader, self.id, nx=True, px=ttl_ms):
            return True
        if s(await self.redis.get(self.keys.leader)) == self.id:
            await self.redis.pexpire(self.keys.leader, ttl_ms)
            return True
        return False

    async def _reclaim_events(self) -> None:
        reply = await self.redis.xautoclaim(self.keys.events, EVENT_GROUP, self.id,
                                            min_idle_time=self.settings.event_claim_idle_ms,
                                            start_id="0-0", count=EVENT_BATCH)
        entries = [e for e in reply[1] if e[1]]
        if entries:
            logger.info("reconciler %s reclaimed %d pending event(s)", self.id, len(entries))
            await self.apply(entries)

    async def sweep(self) -> dict[str, int]:
        """One pass of the periodic work. Safe to run concurrently (every step is idempotent)."""
        done = {"lost": await self._sweep_dead_workers(), "retries": await self._sweep_retries(),
                "deadlines": await self._sweep_deadlines()}
        await listing.trim(self.redis, self.keys,
                           now_ms() - int((self.settings.result_ttl_s + self.settings.max_deadline_s) * 1000))
        return done

    async def _run_scripts(self, calls: list[tuple[Any, ...]]) -> list[Any]:
        """Run script calls in one round trip; after NOSCRIPT (Redis restarted) load the scripts and
        run those again (every script is idempotent). Errors are returned in place, never ignored."""
        if not calls:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*call)
        results = list(await pipe.execute(raise_on_error=False))
        missing = [i for i, r in enumerate(results) if _noscript(r)]
        if missing:
            await scripts.load_all(self.redis)
            pipe = self.redis.pipeline(transaction=False)
            for i in missing:
                pipe.execute_command(*calls[i])
            for i, result in zip(missing, await pipe.execute(raise_on_error=False)):
                results[i] = result
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
            left = 0
            for name in stages:
                n, more = await self._requeue_pending(name, worker_id)
                requeued += n
                left += more
            if left == 0:
                # Delete the consumer only if it holds nothing: XGROUP DELCONSUMER drops its pending
                # entries, and a worker declared dead may still be alive (SIGSTOP, a long GC pause)
                # and have read new tasks since we listed them. Such a worker re-registers with its
                # next heartbeat; its stale sessions are fenced by attempt.
                pipe = self.redis.pipeline(transaction=False)
                for name in stages:
                    pipe.eval(REAP_CONSUMER_LUA, 1, self.keys.tasks(name), TASK_GROUP, worker_id)
                reaped = await pipe.execute(raise_on_error=False)
                if all(r == 1 for r in reaped):
                    pipe = self.redis.pipeline(transaction=False)
                    pipe.zrem(self.keys.workers, worker_id)
                    pipe.delete(self.keys.worker_info(worker_id), self.keys.inbox(worker_id))
                    await pipe.execute(raise_on_error=False)
                    logger.warning("worker %s is gone; its sessions were re-queued", worker_id)
        self.counts["lost"] += requeued
        return requeued

    async def _requeue_pending(self, stage: str, worker_id: str) -> tuple[int, int]:
        stream = self.keys.tasks(stage)
        try:
            pending = await self.redis.xpending_range(stream, TASK_GROUP, min="-", max="+", count=SWEEP_BATCH,
                                                      consumername=worker_id)
        except ResponseError:
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
        retry = self.pipeline.stages[stage].retry
        for p, rows in zip(pending, found):
            if not rows:
                continue
            fields = rows[0][1]
            wf_id, attempt = s(fields.get(b"wf")), s(fields.get(b"a"))
            calls.append(scripts.evalsha_args(
                "stage_event", [self.keys.wf(wf_id), self.keys.inflight, self.keys.retries],
                [self.settings.prefix, "lost", stage, attempt, now, f"worker {worker_id} stopped heartbeating",
                 "1", retry.max_attempts, now, self.settings.tombstone_ttl_s, self.settings.result_ttl_s,
                 stream, s(p["message_id"]), TASK_GROUP]))
        results = await self._run_scripts(calls)
        failed = sum(isinstance(r, Exception) for r in results)
        # entries whose script failed are still pending: keep the consumer, try again next sweep
        return len(results) - failed, int(len(pending) == SWEEP_BATCH or failed > 0)

    async def _sweep_retries(self) -> int:
        due = [s(m) for m in await self.redis.zrangebyscore(self.keys.retries, "-inf", now_ms(), start=0,
                                                             num=SWEEP_BATCH)]
        if not due:
            return 0
        calls = []
        for member in due:
            wf_id, stage, attempt = member.rsplit("|", 2)
            calls.append(scripts.evalsha_args(
                "retry_due", [self.keys.wf(wf_id), self.keys.retries], [self.settings.prefix, member, stage, attempt]))
        await self._run_scripts(calls)
        return len(due)

    async def _sweep_deadlines(self) -> int:
        late = [s(m) for m in await self.redis.zrangebyscore(self.keys.inflight, "-inf", now_ms(), start=0,
                                                              num=SWEEP_BATCH)]
        if not late:
            return 0
        now = now_ms()
        results = await self._run_scripts([scripts.evalsha_args(
            "abort", [self.keys.wf(wf_id), self.keys.inflight],
            [self.settings.prefix, now, "failed", "deadline exceeded", "",
             self.settings.tombstone_ttl_s, self.settings.result_ttl_s]) for wf_id in late])
        # A record that expired or vanished ('gone') must not pin an admission slot; one whose abort
        # failed (e.g. NOSCRIPT twice) stays, so that the next sweep fails it properly.
        stray = [wf_id for wf_id, r in zip(late, results)
                 if not isinstance(r, Exception) and s(r[0]) in ("gone", "terminal")]
        if stray:
            await self.redis.zrem(self.keys.inflight, *stray)
        self.counts["deadline"] += len(late)
        return len(late)


def run_reconciler(settings: Settings, pipeline: Pipeline, redis_url: str) -> None:
    from omniflow.runtime import run_until_signal

    run_until_signal(Reconciler(settings=settings, pipeline=pipeline, redis_url=redis_url).run)


