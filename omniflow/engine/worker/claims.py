"""Claiming the tasks a worker took: one `claim.lua` call per batch, then a `Session` for each task
kept (its record decoded, its catch-up of inputs, its resume state), started by the `SessionRunner`."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from omniflow import tracing
from omniflow.engine.session import Session
from omniflow.engine.session.consumers import InputQueue
from omniflow.engine.worker.chunks import MAX_DETAIL_CHARS, chunk_fields, fields_dict
from omniflow.engine.worker.context import WorkerContext
from omniflow.engine.worker.pool import StagePool
from omniflow.engine.worker.sessions import SessionRunner
from omniflow.errors import RedisError, RedisUnavailable, ScriptError
from omniflow.models import Priority, SessionState, StageStatus
from omniflow.pipeline import INPUT_SRC
from omniflow.runtime import Backoff
from omniflow.storage import redisio
from omniflow.storage.keys import TASK_GROUP, FinalizePlan, finalize_plan
from omniflow.storage.schema import csv, now_ms, s
from omniflow.storage.transitions import sessions as transitions
from omniflow.storage.transitions.emit import finish
from omniflow.storage.transitions.sessions import Claim, ClaimGroup, ClaimResult, claim_code

logger = logging.getLogger(__name__)

PLAN_CACHE_MAX = 1024

#: (required stages, finals, the stage's downstream, whether its finish may complete the workflow)
_Plan = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], bool]


@dataclass(frozen=True)
class Delivered:
    """Tasks one read delivered from one task stream: of `pool`'s stage, in `cell`, of class `prio`."""

    pool: StagePool
    cell: int
    prio: Priority
    claims: list[Claim]


def _regroup(tasks: list[tuple[Delivered, Claim]]) -> list[Delivered]:
    """Some tasks of some groups, as groups (in order)."""
    out: list[Delivered] = []
    for group, claim in tasks:
        if out and out[-1].pool is group.pool and out[-1].prio is group.prio and out[-1].cell == group.cell:
            out[-1].claims.append(claim)
        else:
            out.append(Delivered(group.pool, group.cell, group.prio, [claim]))
    return out


class Claims:
    """Turns delivered tasks into running sessions."""

    def __init__(self, ctx: WorkerContext, runner: SessionRunner) -> None:
        self.ctx = ctx
        self.runner = runner
        self._plans: dict[tuple[str, bytes, bytes], _Plan] = {}
        self._finalize: dict[str, FinalizePlan] = {}      # pipeline version -> what finalize touches
        self._params: dict[bytes, dict[str, Any]] = {}
        self._served = frozenset(pool.stage for pool in ctx.pools.values())    # its producers hand them chunks

    async def claim(self, pool: StagePool, cell: int, claims: list[Claim], prio: Priority = Priority.API) -> None:
        """Claim a batch of tasks of one priority class's stream with one `claim.lua` call, then start
        a session for each one kept."""
        await self.claim_many([Delivered(pool, cell, prio, claims)])

    async def claim_many(self, groups: list[Delivered]) -> None:
        """Claim what one read delivered from several task streams of one cell (the stages a worker
        serves) with one `claim.lua` call, then start a session for each task kept."""
        ctx = self.ctx
        tasks = [(group, claim) for group in groups for claim in group.claims]
        queues: list[InputQueue] = []
        for group, (_entry_id, wf_id, attempt) in tasks:
            # register before claiming: chunks forwarded to our inbox after the claim find their queue
            queue = InputQueue()
            ctx.inputs.register((wf_id, group.pool.stage, attempt), queue)
            queues.append(queue)
        replies: list[Any] | None = None
        legacy: set[str] = set()        # workflows of the storage layout before (claimed again naming `<wf>:stages`)
        try:
            replies = await self._claim_call(groups)
            again = [i for i, reply in enumerate(replies or ())
                     if not isinstance(reply, Exception) and claim_code(reply) is ClaimResult.LAYOUT]
            if replies is not None and again:
                legacy = {tasks[i][1][1] for i in again}
                more = await self._claim_call(_regroup([tasks[i] for i in again]), legacy=legacy)
                if more is None:
                    replies = None
                else:
                    for i, reply in zip(again, more, strict=True):
                        replies[i] = reply
        finally:
            for group in groups:
                group.pool.core.claiming -= len(group.claims)
            ctx.slot_free.set()
            if replies is None:
                for group, (_entry_id, wf_id, attempt) in tasks:
                    ctx.inputs.pop((wf_id, group.pool.stage, attempt))
        if replies is None:         # the worker is stopping: the reconciler re-queues what we hold
            return
        for (group, claim), queue, reply in zip(tasks, queues, replies, strict=True):
            self._start(group, claim, queue, reply, legacy)

    def _start(self, group: Delivered, claim: Claim, queue: InputQueue, reply: Any, legacy: set[str]) -> None:
        """Start the session of one claimed task (or drop it, as its reply says)."""
        ctx = self.ctx
        pool, cell, prio = group.pool, group.cell, group.prio
        stream = pool.stream(cell, prio)
        stage, upstream = pool.stage, pool.upstream
        entry_id, wf_id, attempt = claim
        loop = asyncio.get_running_loop()
        if isinstance(reply, Exception) or claim_code(reply) is not ClaimResult.OK:
            if isinstance(reply, Exception):    # this task alone cannot be claimed: poison
                ctx.dead_letter(stage, cell, stream, TASK_GROUP, entry_id,
                                {b"wf": wf_id.encode(), b"s": stage.encode(), b"a": str(attempt).encode()},
                                f"claim failed: {reply}")
            elif len(reply) > 2 and s(reply[1]) == "held":
                ctx.track(asyncio.create_task(self._vouch(s(reply[2]), pool.queue)))
            ctx.stats["dropped"] += 1
            ctx.inputs.pop((wf_id, stage, attempt))
            ctx.held.discard(entry_id)
            return
        try:
            _, raw_input, raw_params, raw_stages, raw_finals, seq = reply[:6]
            checkpoint = s(reply[7]) if len(reply) > 7 else ""
            trace = (s(reply[8]), s(reply[9])) if tracing.tracer is not None and len(reply) > 9 else ("", "")
            tenant = s(reply[10]) if len(reply) > 10 else ""
            catchup = [(s(src), chunk) for src, entries in reply[6] for entry in entries
                       for chunk in chunk_fields(fields_dict(entry[1]))] if upstream else []
            required, finals, downstream, completes = self._plan_of(pool, raw_stages, raw_finals)
            record_input = json.loads(raw_input)
            # this workflow's sources: the upstream stages it runs, and `@input` if it streams audio in
            sources = tuple(u for u in upstream if u in required or (u == INPUT_SRC and "audio" in record_input))
            session = Session(
                wf_id=wf_id, stage=stage, attempt=attempt,
                input=record_input, params=self._params_of(raw_params, stage),
                finals=finals, downstream=downstream,
                resume_seq=int(seq or 0), _batcher=ctx.batcher_for(wf_id), _keys=ctx.keys,
                upstream=sources, required=required, _queue=queue,
                _catchup=[c for c in catchup if c[0] in sources] if len(sources) < len(upstream) else catchup,
                _input_timeout_s=pool.spec.retry.input_timeout_s,
                state=SessionState.WAITING_INPUT if sources else SessionState.RUNNING,
                # claimed as waiting for input (its pool's stage may have some), it has none: running
                _status=StageStatus.RUNNING.value if upstream and not sources else "",
                checkpoint=checkpoint, _home=loop if pool.compute is not None else None,
                _plane=ctx.plane, _domain_of=self.runner.domain_of, _chunk_dsts=pool.chunk_dsts,
                _bp=ctx.backpressure, _consumers=ctx.consumers,
                _local=ctx.inputs if self._served.intersection(downstream) else None, queue=pool.queue, trace=trace,
                priority=prio, tenant=tenant, tasks_key=stream,
                _completion=self._completion(pool, cell, wf_id, wf_id in legacy) if completes else None,
                _legacy=wf_id in legacy,
            )
        except Exception as exc:  # noqa: BLE001 - a record that does not decode fails its workflow, not us
            ctx.inputs.pop((wf_id, stage, attempt))
            why = f"workflow record is malformed: {type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]
            ctx.spawn(f"{wf_id}|{stage}|{attempt}", self._fail_unstartable(pool, cell, prio, entry_id, wf_id,
                                                                           attempt, why),
                      entry_id=entry_id)
            return
        ctx.stats["claimed"] += 1
        if attempt > 1:
            ctx.window.retried(stage)
        ctx.spawn(f"{wf_id}|{stage}|{attempt}", self.runner.run(pool, cell, entry_id, session), session, pool,
                  entry_id=entry_id)

    async def _vouch(self, replica: str, queue: str) -> None:
        """A task this worker was delivered is held by `replica` (claim.lua made it pending for that
        replica again). If `replica` holds no lease (a worker the reconciler already declared dead
        and forgot, before the task was delivered again), give it one that lapses in a lease timeout,
        and name the queue it claimed from: a live replica renews it with its next heartbeat, a dead
        one is found by the reconciler's dead-worker sweep, which re-queues its pending tasks."""
        ctx = self.ctx
        try:
            expiry = now_ms() + int(ctx.settings.lease_timeout_s * 1000)
            # one slot ({workers}): one round trip, cluster or not; through the runner, so that with
            # `require_replicas` it waits for its replicas (a lease lost with a failover: nobody finds the session)
            added, kept = await redisio.execute(ctx.redis, [
                ("ZADD", ctx.keys.workers, "NX", expiry, replica),
                ("HSETNX", ctx.keys.worker_info(replica), "queues", queue)])      # kept if it has one
            for reply in (added, kept):
                if isinstance(reply, Exception):
                    raise reply
            if not added:
                return          # it holds a lease: alive, or the reconciler will find it dead
            logger.warning("worker %s: a task held by worker %s, which holds no lease, was delivered here; "
                           "leased it until the reconciler can tell whether it lives", ctx.id, replica)
        except RedisError as exc:       # its orphan audit, or the next delivery, tries again
            logger.warning("worker %s: could not lease worker %s for the reconciler: %s", ctx.id, replica, exc)

    async def _claim_call(self, groups: list[Delivered], legacy: Collection[str] = ()) -> list[Any] | None:
        """The `claim.lua` replies of a batch, one per task in the order of the groups' tasks (an
        exception for a task that alone cannot be claimed); None when the worker stopped first. A
        claim sent again is harmless (same replica: 'ok' again), so transient errors are retried; a
        batch the script fails on is split, to find the task that causes it. `legacy`: the workflows
        whose `<wf>:stages` the call declares (the others answer `ClaimResult.LAYOUT` when they are of
        the storage layout before)."""
        ctx = self.ctx
        call = transitions.claim_groups(
            ctx.keys, [ClaimGroup(g.pool.stage, g.pool.upstream, g.cell, g.claims, g.pool.queue, g.prio.value)
                       for g in groups], worker_id=ctx.id, now_ms=now_ms(), legacy=legacy)
        size = sum(len(g.claims) for g in groups)
        backoff = Backoff()
        while True:
            try:
                replies = await ctx.batcher.send(*call)
                if not isinstance(replies, list) or len(replies) != size:
                    raise ScriptError(f"unexpected claim reply {replies!r:.200}")
                return replies
            except RedisUnavailable as exc:        # lost, refused (OOM, READONLY, LOADING...)
                if ctx.stopping:
                    return None
                await backoff.wait(logger, f"worker {ctx.id}: claim failed", exc)
            except ScriptError as exc:
                if size == 1:
                    return [exc]
                logger.warning("worker %s: a claim of %d tasks failed (%s); claiming them one by one",
                               ctx.id, size, exc)
                out: list[Any] = []
                for group in groups:
                    for claim in group.claims:
                        one = await self._claim_call([Delivered(group.pool, group.cell, group.prio, [claim])], legacy)
                        if one is None:
                            return None
                        out += one
                return out

    async def _fail_unstartable(self, pool: StagePool, cell: int, prio: Priority, entry_id: str, wf_id: str,
                                attempt: int, why: str) -> None:
        """Close a claimed session that cannot start (its record does not decode) as a failure that
        is not retried: its workflow fails with the reason, its task is acknowledged."""
        ctx = self.ctx
        logger.warning("session %s/%s cannot start: %s", wf_id, pool.stage, why)
        call = finish(ctx.keys, wf_id, pool.stage, attempt, entry_id=entry_id, outcome="failed", detail=why,
                      retryable=False, now_ms=now_ms(), seq=0, downstream=(), queue=pool.queue, priority=prio.value)
        await ctx.write_until_done(call, f"failing session {wf_id}/{pool.stage}")

    def _plan_of(self, pool: StagePool, raw_stages: bytes, raw_finals: bytes) -> _Plan:
        """(required stages, finals, this stage's downstream, whether its finish may complete the
        workflow) of a workflow, from its record's csv fields; the same few combinations recur for
        every workflow, so they are decoded once. A finish may complete it when the stage is final
        and no other final stage runs after it (`finish_completes` on): the last to finish, but for
        parallel branches, where the finish that completes it reports to the reconciler instead."""
        key = (pool.queue, raw_stages, raw_finals)
        plan = self._plans.get(key)
        if plan is None:
            required = tuple(csv(raw_stages))
            finals = tuple(csv(raw_finals))
            after = set(pool.pipeline.descendants(pool.stage, required))
            completes = (self.ctx.settings.finish_completes and pool.stage in finals
                         and not any(f in after for f in finals))
            plan = (required, finals, tuple(pool.pipeline.downstream(pool.stage, required)), completes)
            if len(self._plans) < PLAN_CACHE_MAX:
                self._plans[key] = plan
        return plan

    def _completion(self, pool: StagePool, cell: int, wf_id: str, legacy: bool) -> tuple[tuple[str, ...], str, int]:
        """What a session's finish needs to complete workflow `wf_id` itself (`Session._completion`):
        every key finalize may touch completing it (`Keys.completion_keys`), its cell's inflight set, the result ttl."""
        pipe = pool.pipeline
        fplan = self._finalize.get(pipe.digest)
        if fplan is None:
            fplan = self._finalize[pipe.digest] = finalize_plan(pipe)
        keys = self.ctx.keys
        inflight = keys.inflight(cell)
        return (inflight, *keys.completion_keys(wf_id, fplan, legacy=legacy)), inflight, self.ctx.settings.result_ttl_s

    def _params_of(self, raw_params: bytes, stage: str) -> dict[str, Any]:
        """A stage's params from the record's JSON, parsed once per distinct JSON. Each session gets
        its own dict; params with nested values are parsed afresh, so no session can change another's."""
        parsed = self._params.get(raw_params)
        if parsed is None:
            parsed = json.loads(raw_params)
            flat = all(isinstance(p, dict) and not any(isinstance(v, (dict, list)) for v in p.values())
                       for p in parsed.values())
            if not flat:
                return parsed.get(stage, {})  # type: ignore[no-any-return]
            if len(self._params) < PLAN_CACHE_MAX:
                self._params[raw_params] = parsed
        return dict(parsed.get(stage, {}))
