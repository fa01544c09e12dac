"""The worker runtime: one process serving one stage (`omniflow worker --stage NAME`),
or several stages that share a device (`--stage thinker,talker`: DESIGN §1, a stage
is not a GPU). Each stage served keeps its own executor, session slots and task
stream; the process shares one intake read, one inbox, one group-commit
connection and one heartbeat between them.

- intake: one XREADGROUP on `<p>:stage:<name>:tasks` of every stage served
  (group `workers`, consumer = worker id), only as many tasks as free session
  slots (backpressure; a stage with no free slot is left out of the read);
- claim: `claim.lua` per task, group-committed; drops tasks of retired workflows;
- inputs: the claim returns what the edge logs already hold; later chunks are
  forwarded by their producers to this worker's inbox stream, one XREAD for all sessions;
- compute: each stage's executor runs on its own compute thread (`omniflow.compute`,
  unless it says `runs_on = "loop"`), so blocking model code never delays this loop;
- outputs: `emit.lua` / `finish.lua` through the group-commit `Batcher`;
- liveness: a heartbeat renews the worker's lease in `<p>:workers`; the
  reconciler re-queues the sessions of a worker whose lease lapsed (they are
  the worker's pending entries in the consumer group), and fencing by attempt
  keeps a worker that comes back from writing for them;
- abort: pub/sub on `<p>:abort` cancels a workflow's sessions at once (the
  tombstone and the fenced scripts are the durable truth);
- drain: `omniflow drain` sets `drain` on the worker's info hash; the heartbeat reads it
  and intake stops claiming until it is cleared, while the sessions held run to their end
  (graceful rolling restarts). The heartbeat also publishes the last minute of work
  (`omniflow.window`) for `omniflow stats` and the dashboard.

The worker never decides workflow state: it reports to the reconciler.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import msgpack
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from omniflow import scripts
from omniflow.batcher import Batcher
from omniflow.compute import ComputeThread
from omniflow.config import Settings
from omniflow.errors import Fenced, PipelineError, RedisUnavailable, StageError
from omniflow.keys import TASK_GROUP, Keys
from omniflow.pipeline import Pipeline, import_executor
from omniflow.runtime import Backoff, check_eviction_policy
from omniflow.session import Session
from omniflow.store import connect, csv, now_ms, s
from omniflow.window import StageWindow
from omniflow.workers.base import Executor

logger = logging.getLogger(__name__)

T = TypeVar("T")

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError, RedisUnavailable)
DEFAULT_GRACE_S = 10.0
INBOX_TRIM_EVERY = 128      # inbox entries read between two trims
INTAKE_RECHECK_MS = 20      # a multi-stage worker with a full stage re-reads this often to add it back


def fields_dict(flat: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields as Lua returns them (flat list) -> dict."""
    return dict(zip(flat[::2], flat[1::2]))


CHUNK_DECODE_ERRORS = (ValueError, TypeError, msgpack.UnpackException)


def decode_chunks(packed: bytes) -> list[dict[bytes, bytes]]:
    """The chunks of one edge or inbox entry's `m` field (a msgpack array of flat field lists);
    raises one of `CHUNK_DECODE_ERRORS` when it does not decode."""
    return [fields_dict(flat) for flat in msgpack.unpackb(packed, raw=True)]


def chunk_fields(fields: dict[bytes, bytes]) -> list[dict[bytes, bytes]]:
    """The chunks of one edge-log entry (as the claim's catch-up returns it).

    An entry that does not decode yields one malformed chunk: the consuming session fails with a
    clear error (`Session._decode`), the worker does not."""
    packed = fields.get(b"m")
    if packed is None:
        return [fields]
    try:
        return decode_chunks(packed)
    except CHUNK_DECODE_ERRORS:
        return [{b"malformed": b"1"}]


def new_worker_id(stage: str) -> str:
    return f"{stage}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def ensure_group(redis: Redis, stream: str, group: str) -> None:
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class StagePool:
    """One stage served by a worker: its executor, its session slots, its task stream."""

    def __init__(self, pipeline: Pipeline, keys: Keys, stage: str, *, executor: Executor | None,
                 max_sessions: int | None) -> None:
        self.stage = stage
        self.spec = pipeline.stages[stage]
        self.tasks_key = keys.tasks(stage)
        self.upstream = tuple(e.src for e in pipeline.inputs[stage])
        self.max_sessions = max_sessions or self.spec.max_sessions
        self.executor = executor or import_executor(self.spec.executor)(stage=stage, params=self.spec.params)
        # At most max_sessions run the executor at once (the GPU's batch slots); up to `prefetch` more
        # are claimed and wait for a slot, so a freed slot starts the next session without a round trip.
        prefetch = self.spec.prefetch if self.spec.prefetch is not None else max(1, self.max_sessions // 4)
        self.capacity = self.max_sessions + prefetch
        self.slots = asyncio.Semaphore(self.max_sessions)
        self.active = 0             # sessions held (running or waiting for a slot)
        self.claiming = 0           # tasks read but not yet claimed (they hold session slots too)
        self.compute: ComputeThread | None = None    # where the executor runs (runs_on == "thread")

    def start_compute(self) -> None:
        if self.executor.runs_on == "thread" and self.compute is None:
            self.compute = ComputeThread(self.stage)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run one of the executor's coroutines where it runs (its compute thread, or this loop)."""
        if self.compute is None:
            return await coro
        return await self.compute.run(coro)

    async def close_executor(self) -> None:
        try:
            await self.call(self.executor.close())
        finally:
            if self.compute is not None:
                self.compute.stop()
                self.compute = None

    @property
    def free(self) -> int:
        return self.capacity - self.active - self.claiming


def parse_stages(value: str | Sequence[str], pipeline: Pipeline) -> list[str]:
    """`thinker`, `thinker,talker` or `all` -> the stage names, validated against the pipeline."""
    names = [x.strip() for x in (value.split(",") if isinstance(value, str) else value) if x.strip()]
    if names == ["all"]:
        return list(pipeline.order)
    if not names:
        raise PipelineError(f"no stage given; pipeline {pipeline.name!r} has {list(pipeline.order)}")
    for name in names:
        if name not in pipeline.stages:
            raise PipelineError(f"unknown stage {name!r}; pipeline {pipeline.name!r} has {list(pipeline.order)}")
    if len(set(names)) != len(names):
        raise PipelineError(f"stage listed twice in {','.join(names)!r}")
    return names


class Worker:
    def __init__(self, *, settings: Settings, pipeline: Pipeline, stage: str | Sequence[str], redis_url: str,
                 worker_id: str | None = None, executor: Executor | None = None,
                 max_sessions: int | None = None) -> None:
        stages = parse_stages(stage, pipeline)
        if executor is not None and len(stages) > 1:
            raise ValueError("an executor instance can serve one stage only")
        self.settings = settings
        self.pipeline = pipeline
        self.keys = Keys(settings.prefix)
        self.pools = {name: StagePool(pipeline, self.keys, name, executor=executor, max_sessions=max_sessions)
                      for name in stages}
        self.stage = ",".join(stages)          # what this worker serves (heartbeat, logs)
        self.id = worker_id or new_worker_id("+".join(stages) if len(stages) < 3 else "multi")
        self.redis_url = redis_url
        self._by_stream = {pool.tasks_key: pool for pool in self.pools.values()}
        self._sessions: dict[str, tuple[Session | None, asyncio.Task[None]]] = {}
        self._slot_free = asyncio.Event()
        self._claim_tasks: set[asyncio.Task[None]] = set()
        # (wf, stage, attempt) -> the input queue of that session
        self._inputs: dict[tuple[str, str, int], asyncio.Queue[Any]] = {}
        self._plans: dict[tuple[str, bytes, bytes], tuple[tuple[str, ...], ...]] = {}
        self._params: dict[bytes, dict[str, Any]] = {}
        self._stopping = False
        self.started = asyncio.Event()
        self.stats = {"claimed": 0, "dropped": 0, "done": 0, "failed": 0, "fenced": 0, "dead_letters": 0}
        self.window = StageWindow(self.pools)
        self._undrained = asyncio.Event()       # cleared while an operator drains this worker
        self._undrained.set()

    # ------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event | None = None, *, grace_s: float = DEFAULT_GRACE_S) -> None:
        stop = stop or asyncio.Event()
        self.redis = connect(self.redis_url)
        self._intake_redis = connect(self.redis_url)
        self._inbox_redis = connect(self.redis_url)
        self._write_redis = [self.redis] + [connect(self.redis_url) for _ in range(self.settings.write_connections - 1)]
        self._batchers = [Batcher(client) for client in self._write_redis]
        self.batcher = self._batchers[0]
        self.inbox_key = self.keys.inbox(self.id)
        try:
            await check_eviction_policy(self.redis)
            await scripts.load_all(self.redis)
            for pool in self.pools.values():
                await ensure_group(self.redis, pool.tasks_key, TASK_GROUP)
                pool.start_compute()
                await pool.call(pool.executor.setup())
            await self._heartbeat_once()
            background = [
                asyncio.create_task(self._intake(), name="intake"),
                asyncio.create_task(self._heartbeat(), name="heartbeat"),
                asyncio.create_task(self._abort_listener(), name="abort-listener"),
                asyncio.create_task(self._watchdog(), name="watchdog"),
                asyncio.create_task(self._inbox(), name="inbox"),
            ]
            self.started.set()
            logger.info("worker %s serving %s", self.id,
                        ", ".join(f"{p.stage} (max_sessions={p.max_sessions})" for p in self.pools.values()))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *background], return_when=asyncio.FIRST_COMPLETED)
            for task in background:
                if task.done() and task.exception():
                    logger.error("worker task %s died: %r", task.get_name(), task.exception())
            stopper.cancel()
            await self._shutdown(background, grace_s)
        finally:
            for pool in self.pools.values():
                await pool.close_executor()
            for client in (*self._write_redis, self._intake_redis, self._inbox_redis):
                await client.aclose()

    async def _shutdown(self, background: list[asyncio.Task[Any]], grace_s: float) -> None:
        self._stopping = True
        background[0].cancel()          # stop taking tasks
        await asyncio.gather(background[0], return_exceptions=True)
        active = [task for _, task in self._sessions.values()]
        if active:
            logger.info("worker %s: waiting up to %.1fs for %d session(s)", self.id, grace_s, len(active))
            await asyncio.wait(active, timeout=grace_s)
        for _, task in list(self._sessions.values()):
            task.cancel()
        for task in background[1:]:
            task.cancel()
        await asyncio.gather(*background[1:], *[t for _, t in self._sessions.values()], return_exceptions=True)
        try:
            for batcher in self._batchers:
                await batcher.drain()
            # Lease score 0: the reconciler re-queues what we still hold at its next sweep.
            await self.redis.zadd(self.keys.workers, {self.id: 0})
            await self.redis.delete(self.inbox_key)
        except REDIS_ERRORS as exc:
            logger.warning("worker %s: could not deregister: %s", self.id, exc)

    # ------------------------------------------------------------ heartbeat
    async def _heartbeat_once(self) -> None:
        expiry = now_ms() + int(self.settings.lease_timeout_s * 1000)
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.keys.workers, {self.id: expiry})
        pipe.hset(self.keys.worker_info(self.id), mapping={
            # per stage served, in the same order: "thinker,talker" / "8,4" / "3,1"
            "stage": self.stage, "host": socket.gethostname(), "pid": os.getpid(),
            "capacity": ",".join(str(p.max_sessions) for p in self.pools.values()),
            "active": ",".join(str(p.active) for p in self.pools.values()), "seen_ms": now_ms(),
            "stats": json.dumps(self.stats), "window": json.dumps(self.window.snapshot()),
        })
        pipe.expire(self.keys.worker_info(self.id), 86_400)
        pipe.hget(self.keys.worker_info(self.id), "drain")
        drain = (await pipe.execute())[-1]
        if drain and self._undrained.is_set():
            logger.info("worker %s: draining (claims nothing new; %d session(s) held)", self.id, len(self._sessions))
            self._undrained.clear()
        elif not drain and not self._undrained.is_set():
            logger.info("worker %s: drain lifted", self.id)
            self._undrained.set()

    @property
    def draining(self) -> bool:
        return not self._undrained.is_set()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await self._heartbeat_once()
            except REDIS_ERRORS as exc:
                logger.warning("worker %s heartbeat failed: %s", self.id, exc)

    async def _watchdog(self) -> None:
        """Input-wait timeouts, checked once a second for all sessions (cheaper than a timer per read)."""
        period = min(1.0, *(p.spec.retry.input_timeout_s / 2 for p in self.pools.values()))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for session, task in list(self._sessions.values()):
                if session is not None and session.waiting_since and \
                        now - session.waiting_since > self.pools[session.stage].spec.retry.input_timeout_s:
                    session.input_timed_out = True
                    if session._waiter is not None:      # the wait itself (on this loop, whoever awaits it)
                        session._waiter.cancel()

    # ------------------------------------------------------------ intake
    async def _intake(self) -> None:
        backoff = Backoff()
        while True:
            if self.draining:
                await self._undrained.wait()
                continue
            ready = [pool for pool in self.pools.values() if pool.free > 0]
            if not ready:
                self._slot_free.clear()
                await self._slot_free.wait()
                continue
            # COUNT applies per stream: the stage with the fewest free slots bounds the read
            count = min(self.settings.read_batch, *(pool.free for pool in ready))
            # A stage left out because it was full is not in the blocking read: come back soon to add
            # it when its slots free up (a blocking read cannot be interrupted without losing what
            # it may already have delivered).
            block = self.settings.block_ms if len(ready) == len(self.pools) else \
                min(self.settings.block_ms, INTAKE_RECHECK_MS)
            try:
                reply = await self._intake_redis.xreadgroup(
                    TASK_GROUP, self.id, {pool.tasks_key: ">" for pool in ready}, count=count, block=block,
                )
                backoff.reset()
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    for pool in ready:
                        await ensure_group(self.redis, pool.tasks_key, TASK_GROUP)
                    continue
                raise
            except REDIS_ERRORS as exc:
                await backoff.wait(logger, f"worker {self.id}: intake read failed", exc)
                continue
            for stream, entries in reply or []:
                self._accept(self._by_stream[s(stream)], [(s(entry_id), fields) for entry_id, fields in entries])

    def _accept(self, pool: StagePool, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        """Validate delivered tasks (malformed ones go to the dead-letter stream) and claim the rest in one call."""
        if self.draining:       # read by a blocking read that began before the drain: give them back
            task = asyncio.create_task(self._hand_back(pool, entries))
            self._claim_tasks.add(task)
            task.add_done_callback(self._claim_tasks.discard)
            return
        claims: list[tuple[str, str, int]] = []
        for entry_id, fields in entries:
            try:
                wf_id = s(fields[b"wf"])
                stage = s(fields[b"s"])
                attempt = int(fields[b"a"])
                if stage != pool.stage or not wf_id or attempt < 1:
                    raise ValueError(f"task for stage {stage!r} attempt {attempt} on {pool.stage}'s stream")
            except (KeyError, ValueError) as exc:
                self.stats["dead_letters"] += 1
                self._spawn(f"dlq:{entry_id}",
                            self._dead_letter(pool, entry_id, fields, f"malformed task entry: {exc!r}"))
                continue
            for older in range(1, attempt):
                # An older attempt of this session still running here was declared lost (our lease lapsed,
                # or we lost Redis): it is fenced anyway; stop it so it cannot hold this stage's inputs.
                stale = self._sessions.get(f"{wf_id}|{stage}|{older}")
                if stale is not None:
                    stale[1].cancel()
            claims.append((entry_id, wf_id, attempt))
        if claims:
            pool.claiming += len(claims)
            task = asyncio.create_task(self._claim(pool, claims))
            self._claim_tasks.add(task)
            task.add_done_callback(self._claim_tasks.discard)

    def _spawn(self, key: str, coro: Any, session: Session | None = None, pool: StagePool | None = None) -> None:
        task = asyncio.create_task(coro, name=key)
        self._sessions[key] = (session, task)
        if pool is not None:
            pool.active += 1
        task.add_done_callback(lambda _t: self._release(key, pool))

    def _release(self, key: str, pool: StagePool | None) -> None:
        self._sessions.pop(key, None)
        if pool is not None:
            pool.active -= 1
        self._slot_free.set()

    async def _hand_back(self, pool: StagePool, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        """Re-queue unclaimed tasks as they were (same attempt: still valid for any other worker)."""
        pipe = self.redis.pipeline(transaction=True)
        for entry_id, fields in entries:
            pipe.xadd(pool.tasks_key, fields)
            pipe.xack(pool.tasks_key, TASK_GROUP, entry_id)
            pipe.xdel(pool.tasks_key, entry_id)
        try:
            await pipe.execute()
            logger.info("worker %s (draining): handed back %d task(s) of %s", self.id, len(entries), pool.stage)
        except REDIS_ERRORS as exc:      # still pending here: re-queued when this worker stops
            logger.warning("worker %s: could not hand back %d task(s): %s", self.id, len(entries), exc)

    async def _dead_letter(self, pool: StagePool, entry_id: str, fields: dict[bytes, bytes], reason: str) -> None:
        logger.warning("worker %s: dead-lettering task %s: %s", self.id, entry_id, reason)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(self.keys.dlq(pool.stage), {**{k: v for k, v in fields.items()}, b"reason": reason.encode(),
                                              b"entry": entry_id.encode()})
        pipe.xack(pool.tasks_key, TASK_GROUP, entry_id)
        pipe.xdel(pool.tasks_key, entry_id)
        await pipe.execute()

    # ------------------------------------------------------------ sessions
    async def _claim(self, pool: StagePool, claims: list[tuple[str, str, int]]) -> None:
        """Claim a batch of tasks with one `claim.lua` call, then start a session for each one kept."""
        stage, upstream = pool.stage, pool.upstream
        queues: list[asyncio.Queue[Any]] = []
        for _entry_id, wf_id, attempt in claims:
            # register before claiming: chunks forwarded to our inbox after the claim find their queue
            queue: asyncio.Queue[Any] = asyncio.Queue()
            self._inputs[(wf_id, stage, attempt)] = queue
            queues.append(queue)
        args = [self.settings.prefix, TASK_GROUP, self.id, now_ms(), ",".join(upstream), stage,
                *(x for claim in claims for x in claim)]
        replies = None
        backoff = Backoff()
        try:
            while replies is None:
                try:
                    replies = await self.batcher.script("claim", [pool.tasks_key], args)
                    if not isinstance(replies, list) or len(replies) != len(claims):
                        raise ResponseError(f"unexpected claim reply {replies!r:.200}")
                except (*REDIS_ERRORS, ResponseError) as exc:   # e.g. LOADING after a restart
                    # a retried claim is harmless (same replica: 'ok' again)
                    replies = None
                    if self._stopping:
                        return
                    await backoff.wait(logger, f"worker {self.id}: claim failed", exc)
        finally:
            pool.claiming -= len(claims)
            self._slot_free.set()
            if replies is None:
                for _entry_id, wf_id, attempt in claims:
                    self._inputs.pop((wf_id, stage, attempt), None)
        loop = asyncio.get_running_loop()
        for (entry_id, wf_id, attempt), queue, reply in zip(claims, queues, replies, strict=True):
            if s(reply[0]) != "ok":
                self.stats["dropped"] += 1
                self._inputs.pop((wf_id, stage, attempt), None)
                continue
            self.stats["claimed"] += 1
            if attempt > 1:
                self.window.retried(stage)
            _, raw_input, raw_params, raw_stages, raw_finals, seq = reply[:6]
            checkpoint = s(reply[7]) if len(reply) > 7 else ""
            catchup = [(s(src), chunk) for src, entries in reply[6] for entry in entries
                       for chunk in chunk_fields(fields_dict(entry[1]))] if upstream else []
            required, finals, downstream = self._plan_of(stage, raw_stages, raw_finals)
            session = Session(
                wf_id=wf_id, stage=stage, attempt=attempt,
                input=json.loads(raw_input), params=self._params_of(raw_params, stage),
                finals=finals, downstream=downstream,
                resume_seq=int(seq or 0), _batcher=self.batcher_for(wf_id), _keys=self.keys,
                upstream=upstream, required=required, _queue=queue, _catchup=catchup,
                _input_timeout_s=pool.spec.retry.input_timeout_s, waiting_input=bool(upstream),
                checkpoint=checkpoint, _home=loop,
            )
            self._spawn(f"{wf_id}|{stage}|{attempt}", self._session(pool, entry_id, session), session, pool)

    def _plan_of(self, stage: str, raw_stages: bytes, raw_finals: bytes) -> tuple[tuple[str, ...], ...]:
        """(required stages, finals, this stage's downstream) of a workflow, from its record's csv
        fields; the same few combinations recur for every workflow, so they are decoded once."""
        key = (stage, raw_stages, raw_finals)
        plan = self._plans.get(key)
        if plan is None:
            required = tuple(csv(raw_stages))
            plan = (required, tuple(csv(raw_finals)), tuple(self.pipeline.downstream(stage, required)))
            if len(self._plans) < 1024:
                self._plans[key] = plan
        return plan

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
            if len(self._params) < 1024:
                self._params[raw_params] = parsed
        return dict(parsed.get(stage, {}))

    def batcher_for(self, wf_id: str) -> Batcher:
        """The write connection of one workflow: its writes keep their order on it."""
        return self._batchers[hash(wf_id) % len(self._batchers)]

    async def _inbox(self) -> None:
        """Read this worker's inbox (inputs forwarded by producers) and hand each entry to its session."""
        last: bytes | str = "0-0"
        untrimmed = 0
        only = next(iter(self.pools)) if len(self.pools) == 1 else None
        backoff = Backoff()
        while True:
            try:
                reply = await self._inbox_redis.xread({self.inbox_key: last}, count=1024, block=self.settings.block_ms)
                backoff.reset()
            except REDIS_ERRORS as exc:
                await backoff.wait(logger, f"worker {self.id}: inbox read failed", exc)
                continue
            for _key, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id
                    try:
                        dst = s(fields[b"ds"]) if b"ds" in fields else only
                        target = (s(fields[b"wf"]), dst, int(fields[b"da"]))
                        src = s(fields[b"src"])
                        chunks = decode_chunks(fields[b"m"])
                    except (KeyError, *CHUNK_DECODE_ERRORS):
                        logger.warning("worker %s: malformed inbox entry %s dropped", self.id, s(entry_id))
                        continue
                    queue = self._inputs.get(target)
                    if queue is not None:       # else: a session that ended (its inputs are durable anyway)
                        for chunk in chunks:
                            queue.put_nowait((src, chunk))
                untrimmed += len(entries)
                if untrimmed >= INBOX_TRIM_EVERY:
                    # consumed entries are trimmed in bulk: the inbox stays about as small as what is in flight
                    self.batcher.send("XTRIM", self.inbox_key, "MINID", "~", s(entries[-1][0]))
                    untrimmed = 0

    async def _session(self, pool: StagePool, entry_id: str, session: Session) -> None:
        wf_id, stage, attempt = session.wf_id, session.stage, session.attempt
        started = time.monotonic()
        outcome, detail, retryable = "failed", "aborted", False
        try:
            if session.resume_seq and not pool.executor.resumable:
                await self._restart(session)
            outcome, detail, retryable = await self._execute(pool, session)
        except asyncio.CancelledError:
            if self._stopping and not session.aborted:
                raise      # shutting down: the reconciler re-queues what we hold
        except REDIS_ERRORS as exc:
            # Redis went away mid-session (restart, failover, a dropped connection): writes of this
            # attempt may be lost, so it ends here. We are alive and keep our lease, so nobody else
            # would re-queue it: report it lost ourselves (the retry resumes from what was written).
            logger.warning("session %s/%s lost Redis: %s", wf_id, stage, exc)
            await self._report_lost(entry_id, wf_id, stage, attempt, f"worker {self.id} lost Redis: {exc}")
            return
        finally:
            self._inputs.pop((wf_id, stage, attempt), None)
        try:
            code = await session.close(tasks_key=pool.tasks_key, events_key=self.keys.events, group=TASK_GROUP,
                                       entry_id=entry_id, outcome=outcome, detail=detail, retryable=retryable)
        except REDIS_ERRORS as exc:      # the finish may or may not have landed: 'lost' is idempotent
            await self._report_lost(entry_id, wf_id, stage, attempt, f"worker {self.id} lost Redis at finish: {exc}")
            return
        if code == "fenced":
            self.stats["fenced"] += 1
        else:
            self.stats["done" if outcome == "done" else "failed"] += 1
            self.window.finished(stage, outcome, time.monotonic() - started)

    async def _report_lost(self, entry_id: str, wf_id: str, stage: str, attempt: int, why: str,
                           *, give_up_s: float = 600.0) -> None:
        """Tell the reconciler this session is lost (it acks the task and retries with attempt + 1),
        retrying until Redis answers again; past `give_up_s` our lease must lapse first."""
        deadline, backoff = asyncio.get_running_loop().time() + give_up_s, 0.05
        while True:
            try:
                await self.redis.xadd(self.keys.events, {"t": "lost", "wf": wf_id, "s": stage, "a": attempt,
                                                         "d": why, "r": "1", "e": entry_id})
                return
            except REDIS_ERRORS as exc:
                if asyncio.get_running_loop().time() > deadline:
                    logger.error("session %s/%s: could not report it lost: %s", wf_id, stage, exc)
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)

    async def _restart(self, session: Session) -> None:
        """This executor cannot resume: its output, and everything downstream of it, starts over
        (`restart.lua` re-queues the downstream sessions and logs a `restart` event)."""
        below = self.pipeline.descendants(session.stage, session.required)
        edges = [f"{s}:{e.dst}" for s in (session.stage, *below) for e in self.pipeline.outputs[s]
                 if e.dst in session.required]
        reply = await self.batcher_for(session.wf_id).script(
            "restart", [self.keys.wf(session.wf_id)],
            [self.settings.prefix, session.stage, session.attempt, now_ms(), ",".join(below), ",".join(edges)])
        if s(reply) == "fenced":
            session.fenced = True
        session.resume_seq = 0

    async def _execute(self, pool: StagePool, session: Session) -> tuple[str, str, bool]:
        """Run the executor; map how it ended to (outcome, detail, retryable)."""
        retry = pool.spec.retry
        try:
            async with pool.slots, asyncio.timeout(retry.attempt_timeout_s):
                usage = await pool.call(pool.executor.run(session))
            session.raise_if_broken()
            return "done", json.dumps(dict(usage or {})), True
        except Fenced:
            return "failed", "fenced", False
        except TimeoutError:
            return "failed", f"attempt timed out after {retry.attempt_timeout_s:g}s", True
        except StageError as exc:
            return "failed", str(exc), exc.retryable
        except REDIS_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - an executor bug is a stage failure, never a worker crash
            logger.exception("executor %s failed on %s", session.stage, session.wf_id)
            return "failed", f"{type(exc).__name__}: {exc}", True

    # ------------------------------------------------------------ abort
    async def _abort_listener(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.abort_channel)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self.cancel_workflow(s(message["data"]))
            except REDIS_ERRORS as exc:
                logger.warning("worker %s: abort channel lost: %s", self.id, exc)
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()

    def cancel_workflow(self, wf_id: str) -> int:
        """Cancel every local session of `wf_id` (abort fan-out)."""
        n = 0
        for key, (session, task) in list(self._sessions.items()):
            if key.startswith(f"{wf_id}|"):
                if session is not None:
                    session.aborted = True
                task.cancel()
                n += 1
        return n


def run_worker(settings: Settings, pipeline: Pipeline, stage: str | Sequence[str], redis_url: str) -> None:
    """Blocking entry point used by the CLI: runs until SIGINT/SIGTERM."""
    from omniflow.runtime import run_until_signal

    worker = Worker(settings=settings, pipeline=pipeline, stage=stage, redis_url=redis_url)
    run_until_signal(worker.run)

