"""Running a claimed session: the executor on its stage's compute thread, how it ended mapped to an
outcome under the stage's retry policy, and the session closed whatever Redis does meanwhile (a
task never stays pending on a live worker). Also the data-plane side of a session: where its
consumers run, releasing what it read, and having a producer run again when its chunks are lost."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from omniflow import tracing
from omniflow.dataplane import InputLost
from omniflow.engine.session import Session
from omniflow.engine.worker.chunks import MAX_DETAIL_CHARS, usage_json
from omniflow.engine.worker.context import WorkerContext
from omniflow.engine.worker.pool import StagePool
from omniflow.models import Priority
from omniflow.errors import Fenced, RedisError, RedisUnavailable, StageError
from omniflow.runtime import Backoff
from omniflow.storage import redisio
from omniflow.storage.keys import TASK_GROUP
from omniflow.storage.redisio import REDIS_ERRORS
from omniflow.storage.schema import StageField, now_ms, s
from omniflow.storage.transitions.sessions import RestartResult, restart, restart_result
from omniflow.storage.usage import Meter, bucket_of

logger = logging.getLogger(__name__)

REPLICA_DOMAINS_MAX = 4096


class SessionRunner:
    """Runs sessions from claim to finish."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._replica_domains: dict[str, str] = {}     # replica id -> its shared-memory domain
        self._expiring: dict[str, int] = {}            # usage keys whose expiry this worker has set -> their hour

    async def run(self, pool: StagePool, cell: int, entry_id: str, session: Session) -> None:
        ctx = self.ctx
        wf_id, stage, attempt = session.wf_id, session.stage, session.attempt
        started = time.monotonic()
        outcome, detail, retryable = "failed", "aborted", False
        if tracing.tracer is not None and session.trace[0]:     # a workflow submitted untraced stays so
            session._span = tracing.session_span(wf_id=wf_id, stage=stage, attempt=attempt, worker=ctx.id,
                                                 pool=pool.stage, traceparent=session.trace[0],
                                                 tracestate=session.trace[1])
        try:
            if session.resume_seq and not pool.executor.resumable:
                await self.restart(session)
            outcome, detail, retryable = await self._execute(pool, session)
        except asyncio.CancelledError:
            if ctx.stopping and not session.aborted:
                raise      # shutting down: the reconciler re-queues what we hold
        except RedisError as exc:
            # A write of this attempt was refused or lost at the Redis boundary (a restart, a failover,
            # a dropped connection, a refusal that outlasted the batcher's patience, a script error):
            # the attempt ends here. Its finish carries how many steps it emitted, so it is closed as a
            # retryable failure (never as done over a hole) and the retry resumes from what was stored.
            logger.warning("session %s/%s: a write failed: %s", wf_id, stage, exc)
            outcome, detail, retryable = "failed", f"worker {ctx.id}: a write failed: {exc}"[:MAX_DETAIL_CHARS], True
        finally:
            ctx.inputs.pop((wf_id, stage, attempt))
        closing_ns = tracing.now_ns() if tracing.tracer is not None else 0
        code = await self._close(pool, cell, entry_id, session, outcome, detail, retryable)
        if session._span is not None:
            tracing.end_session(session._span, outcome=outcome, detail=detail, code=code, steps=session.seq,
                                usage=session.reported_usage)
        if session.held and code == "ok" and outcome == "done":
            # done for good: no retry of this session will replay these payloads
            await self._release_inputs(session)
        if session.completed:         # its finish completed the workflow (the reconciler's decision, taken here)
            ctx.stats["completed"] = ctx.stats.get("completed", 0) + 1
            if session.trace[0]:
                attrs: dict[str, Any] = {"workflow.id": wf_id, "stage": stage, "attempt": attempt, "event": "done",
                                         "worker": ctx.id}
                tracing.decision("completed", traceparent=session.trace[0], start_ns=closing_ns, **attrs)
        if code == "fenced":
            ctx.stats["fenced"] += 1
        elif code is not None:
            ended = "done" if outcome == "done" and code != "gap" else "failed"
            ctx.stats[ended] += 1
            ctx.window.finished(stage, ended, time.monotonic() - started)

    async def _close(self, pool: StagePool, cell: int, entry_id: str, session: Session, outcome: str, detail: str,
                     retryable: bool) -> str | None:
        """End the session (its last steps and the finish, one script call) whatever Redis does
        meanwhile: the task must never stay pending on a live worker. Returns the script's answer
        ('ok', 'fenced', 'gap'), or None when the session was handed to the reconciler instead."""
        ctx = self.ctx
        backoff = Backoff()
        bucket = bucket_of(now_ms())        # the hour whose usage it adds to (the same if the finish is sent again)
        usage_key = ctx.keys.usage(cell, bucket)
        meter = Meter.of(usage_key, bucket=bucket, retention_days=ctx.settings.usage_retention_days,
                         compute_s=session.compute_s, usage=session.reported_usage if outcome == "done" else None,
                         set_expiry=usage_key not in self._expiring)
        while True:
            try:
                code = await session.close(tasks_key=session.tasks_key or pool.stream(cell, session.priority),
                                           events_key=ctx.keys.events(cell),
                                           group=TASK_GROUP, entry_id=entry_id, outcome=outcome, detail=detail,
                                           retryable=retryable, meter=meter)
                if code != "fenced" and meter.expire_at_s:       # the script set the hour's expiry
                    self._expiring = {k: b for k, b in self._expiring.items() if b == bucket}
                    self._expiring[usage_key] = bucket
                return code
            except RedisUnavailable as exc:
                # lost, or refused for longer than the batcher waits: it may or may not have landed;
                # sending the finish again is safe (fenced by status and by step count)
                if ctx.stopping:
                    return None         # our lease goes to 0 at shutdown: the reconciler re-queues it
                await backoff.wait(logger, f"session {session.wf_id}/{session.stage}: finish failed", exc)
            except RedisError as exc:   # the finish itself fails (a bug, a record it cannot take)
                await self._report_lost(entry_id, session.wf_id, session.stage, session.attempt,
                                        f"worker {ctx.id} could not finish the session: {exc}"[:MAX_DETAIL_CHARS],
                                        version=pool.pipeline.digest, priority=session.priority)
                return None

    async def _report_lost(self, entry_id: str, wf_id: str, stage: str, attempt: int, why: str, *,
                           version: str = "", priority: Priority = Priority.API) -> None:
        """Tell the reconciler this session is lost (it acks the task and retries with attempt + 1),
        retrying until Redis takes the report: a task must never stay pending on a live worker. Sent
        through the runner, so with `require_replicas` the report waits for its replicas like every
        other write (one lost with a failover would leave the task pending here until the orphan audit);
        a report sent twice is applied once (the reconciler checks attempt and state)."""
        ctx = self.ctx
        backoff = Backoff()
        while True:
            try:
                await redisio.call(ctx.redis, "XADD", ctx.keys.events(ctx.keys.cell_of(wf_id)), "*",
                                   "t", "lost", "wf", wf_id, "s", stage, "a", attempt, "d", why, "r", "1",
                                   "e", entry_id, "p", version, "c", priority.value)
                return
            except RedisError as exc:
                if ctx.stopping:
                    return              # our lease goes to 0 at shutdown: the reconciler re-queues it
                await backoff.wait(logger, f"session {wf_id}/{stage}: could not report it lost", exc)

    async def restart(self, session: Session, *, lost: InputLost | None = None) -> str:
        """This executor cannot resume: its output, and everything downstream of it, starts over
        (`restart.lua` re-queues the downstream sessions and logs a `restart` event).

        With `lost` ("regenerate"): this session cannot read what stage `lost.src` wrote (the
        chunks were in the shared memory of a host it cannot map, or are gone), so that stage runs
        again, and everything downstream of it, this session included (fenced by its attempt: the
        new attempt reads the new output). Returns the script's answer: 'ok', 'fenced' or, for a
        producer that has used its attempts, 'exhausted'."""
        ctx = self.ctx
        stage = lost.src if lost is not None else session.stage
        pool = ctx.pools.get(session.queue)
        pipeline = pool.pipeline if pool is not None else ctx.pipeline
        below = pipeline.descendants(stage, session.required)
        requeued = below if lost is None else [stage, *below]
        edges = [(st, e.dst) for st in (stage, *below) for e in pipeline.outputs[st] if e.dst in session.required]
        call = restart(ctx.keys, session.wf_id, stage, attempt="" if lost else session.attempt, below=below,
                       edges=edges, requeued=[pipeline.queue(st) for st in requeued], now_ms=now_ms(),
                       regenerate=None if lost is None else (session.stage, session.attempt,
                                                             pipeline.stages[stage].retry.max_attempts,
                                                             str(lost)[:MAX_DETAIL_CHARS]),
                       priority=session.priority.value)
        reply = restart_result(await ctx.batcher_for(session.wf_id).send(*call))
        if reply is RestartResult.FENCED or (lost is not None and reply is RestartResult.OK):
            session.fence()
        if lost is None:
            session.resume_seq = 0
        return reply.value

    async def _execute(self, pool: StagePool, session: Session) -> tuple[str, str, bool]:
        """Run the executor; map how it ended to (outcome, detail, retryable)."""
        retry = pool.spec.retry
        core = pool.core        # (the pool's shared parts, read once: `StagePool`'s properties)
        try:
            if not core.batched:
                session._slots = core.slots     # gives way at its chunks to a higher class or a fairer turn (Slots)
            async with core.slots.held(session.priority, session.tenant), asyncio.timeout(retry.attempt_timeout_s):
                begun = time.monotonic()
                try:
                    # where the pool's sessions run now (`omniflow.engine.placement`)
                    usage = await core.placement.run(core.executor.run(session), core.compute)
                finally:
                    # compute: the executor's time on the session, less its waits for upstream chunks
                    # and for a downstream consumer's room (usage, RTF, tokens/s)
                    session.compute_s = max(0.0, time.monotonic() - begun - session.input_wait_s
                                            - session.backpressure_wait_s)
            session.reported_usage = usage
            session.raise_if_broken()
            return "done", usage_json(usage, session), True
        except Fenced:
            return "failed", "fenced", False
        except InputLost as exc:
            return await self._regenerate(session, exc)
        except TimeoutError:
            return "failed", f"attempt timed out after {retry.attempt_timeout_s:g}s", True
        except StageError as exc:
            return "failed", str(exc)[:MAX_DETAIL_CHARS], exc.retryable
        except RedisError:
            # raised by the session's writes at the Redis boundary (translated there); an OSError of
            # the executor's own (a model server refusing a connection, a missing weights file) is
            # not a Redis error: it is the stage's failure, under its retry policy (below)
            raise
        except Exception as exc:  # noqa: BLE001 - an executor bug is a stage failure, never a worker crash
            logger.exception("executor %s failed on %s", session.stage, session.wf_id)
            return "failed", f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS], True

    # ------------------------------------------------------------ data plane
    async def _regenerate(self, session: Session, lost: InputLost) -> tuple[str, str, bool]:
        """This session cannot read a chunk of `lost.src` here: have that stage run again (see
        `restart`); this attempt ends fenced. A producer out of attempts fails this session with the
        reason, retryable (a replica on the producer's host may still read it)."""
        # The newer attempt the script queues may reach this worker before its reply does, and
        # cancel this one: the call is shielded, and what it did is counted when it ends.
        call = asyncio.ensure_future(self.restart(session, lost=lost))
        self.ctx.track(call)
        call.add_done_callback(functools.partial(self._regenerated, session, lost))
        reply = await asyncio.shield(call)
        if reply == "ok":
            return "failed", f"{lost}; {lost.src} runs again"[:MAX_DETAIL_CHARS], True
        if reply == "exhausted":
            return "failed", f"{lost}; {lost.src} has used its attempts"[:MAX_DETAIL_CHARS], True
        return "failed", "fenced", False

    def _regenerated(self, session: Session, lost: InputLost, call: asyncio.Future[str]) -> None:
        if not call.cancelled() and call.exception() is None and call.result() == "ok":
            self.ctx.stats["regenerated"] += 1
            logger.warning("session %s/%s: %s; %s runs again", session.wf_id, session.stage, lost, lost.src)

    async def domain_of(self, wf_id: str, dst: str) -> str:
        """The shared-memory domain of the replica the consuming session `dst` of `wf_id` is bound to
        ('' while it is not claimed, or when that replica publishes none)."""
        ctx = self.ctx
        replica = await ctx.batcher.send("HGET", ctx.keys.stages(wf_id), StageField.replica(dst))
        if not replica:
            return ""
        rid = s(replica)
        domain = self._replica_domains.get(rid)
        if domain is None:
            domain = s(await ctx.batcher.send("HGET", ctx.keys.worker_info(rid), "shm") or b"")
            if len(self._replica_domains) > REPLICA_DOMAINS_MAX:
                self._replica_domains.clear()
            self._replica_domains[rid] = domain
        return domain

    async def _release_inputs(self, session: Session) -> None:
        try:
            self.ctx.stats["payloads_released"] += await self.ctx.plane.release(session.held)
        except REDIS_ERRORS as exc:     # they expire with their TTL, or go at the workflow's terminal
            logger.warning("session %s/%s: releasing its inputs failed: %s", session.wf_id, session.stage,
                           redisio.translate(exc))
        session.held.clear()
