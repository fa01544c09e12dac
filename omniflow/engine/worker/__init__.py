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
- compute: each stage's executor runs on its own compute thread (`omniflow.engine.compute`,
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
  (`omniflow.engine.window`) for `omniflow stats` and the dashboard.

The worker never decides workflow state: it reports to the reconciler.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import msgpack
from redis.asyncio import Redis

from omniflow.storage import redisio
from omniflow.storage.batcher import Batcher
from omniflow.engine.compute import ComputeThread
from omniflow.config import Settings
from omniflow.dataplane import DataPlane, InputLost
from omniflow.dataplane.backpressure import WaitStats
from omniflow.storage.entries import inbox as inbox_entry
from omniflow.storage.entries import task as task_entry
from omniflow.errors import (
    Fenced,
    MalformedEntry,
    PipelineError,
    RedisError,
    RedisUnavailable,
    ScriptError,
    StageError,
)
from omniflow.storage.keys import TASK_GROUP, Keys
from omniflow.models import WorkflowState
from omniflow.pipeline import EdgeMode, Pipeline, import_executor
from omniflow.storage.redisio import REDIS_ERRORS, connect, ensure_group
from omniflow.runtime import Backoff, check_eviction_policy, check_layout, forever, when_redis_answers
from omniflow.storage.scripts import evalsha_args
from omniflow.engine.session import Session
from omniflow.client.store import csv, now_ms, s
from omniflow.storage.topology import is_cluster, pubsub_client, read_groups
from omniflow.engine.window import StageWindow
from omniflow.workers.base import Executor

logger = logging.getLogger(__name__)

__all__ = ["Worker", "ensure_group", "parse_stages", "run_worker"]

T = TypeVar("T")

MAX_DETAIL_CHARS = 4096     # an executor's error message, as the workflow record keeps it
MAX_USAGE_CHARS = 16_384    # an executor's usage document (the reconciler refuses reports over 64 KiB)
WORKER_INFO_TTL_S = 86_400
INBOX_TRIM_EVERY = 128      # inbox entries read between two trims
INTAKE_RECHECK_MS = 20      # a multi-stage worker with a full stage re-reads this often to add it back
# Tasks delivered to this worker that it never heard of (the reply of its read was lost with the
# connection: a failover, a killed client) are looked for this often, once pending this long.
ORPHAN_AUDIT_S = 5.0
ORPHAN_IDLE_MS = 3_000
ORPHAN_BATCH = 256


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


def usage_json(usage: Any, session: Session) -> str:
    """An executor's usage as the record keeps it (bounded: the reconciler refuses huge reports)."""
    text = json.dumps(dict(usage or {}))
    if len(text) > MAX_USAGE_CHARS:
        logger.warning("executor %s returned %d characters of usage on %s; kept only its size",
                       session.stage, len(text), session.wf_id)
        text = json.dumps({"truncated": True, "chars": len(text)})
    return text


def new_worker_id(stage: str, host_id: str) -> str:
    return f"{stage}-{host_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class StagePool:
    """One stage served by a worker: its executor, its session slots, its task stream."""

    def __init__(self, pipeline: Pipeline, stage: str, *, executor: Executor | None,
                 max_sessions: int | None) -> None:
        self.stage = stage
        self.spec = pipeline.stages[stage]
        self.tasks_keys: dict[int, str] = {}      # cell -> the stage's task stream there (see `bind`)
        self.upstream = tuple(e.src for e in pipeline.inputs[stage])
        # downstream stages that run while we produce (backpressure applies to these edges only)
        self.chunk_dsts = frozenset(e.dst for e in pipeline.outputs[stage] if e.mode is EdgeMode.CHUNK)
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

    def bind(self, keys: Keys) -> None:
        """Learn the task stream of every cell (once the deployment's layout is known)."""
        self.tasks_keys = {cell: keys.tasks(self.stage, cell) for cell in keys.all_cells}

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
        # the layout (how many cells) is known once connected: see `_setup_redis`
        self.keys = Keys(settings.prefix, settings.cells or 1)
        self.pools = {name: StagePool(pipeline, name, executor=executor, max_sessions=max_sessions)
                      for name in stages}
        self.stage = ",".join(stages)          # what this worker serves (heartbeat, logs)
        self.id = worker_id or new_worker_id("+".join(stages) if len(stages) < 3 else "multi", settings.host_id)
        self.redis_url = redis_url
        self._by_stream: dict[str, tuple[StagePool, int]] = {}      # task stream -> (its pool, its cell)
        self._intake_loops = 1
        self._starved = 0             # intake loops waiting for a free session slot
        self._sessions: dict[str, tuple[Session | None, asyncio.Task[None]]] = {}
        self._slot_free = asyncio.Event()
        self._claim_tasks: set[asyncio.Task[None]] = set()
        self._held: set[str] = set()     # task entry ids this worker is working on (claim, session, dead letter)
        # (wf, stage, attempt) -> the input queue of that session
        self._inputs: dict[tuple[str, str, int], asyncio.Queue[Any]] = {}
        self._plans: dict[tuple[str, bytes, bytes], tuple[tuple[str, ...], ...]] = {}
        self._params: dict[bytes, dict[str, Any]] = {}
        self._stopping = False
        self._heartbeat_ok_at = 0.0     # monotonic time of the last heartbeat Redis accepted
        self.started = asyncio.Event()
        self.stats: dict[str, float] = {"claimed": 0, "dropped": 0, "done": 0, "failed": 0, "fenced": 0,
                                        "dead_letters": 0, "backpressure_waits": 0, "backpressure_wait_s": 0.0,
                                        "payloads_released": 0, "segments_swept": 0, "regenerated": 0}
        self.backpressure = WaitStats()
        self._replica_domains: dict[str, str] = {}     # replica id -> its shared-memory domain
        self._background: set[asyncio.Task[Any]] = set()
        self.window = StageWindow(self.pools)
        self._undrained = asyncio.Event()       # cleared while an operator drains this worker
        self._undrained.set()

    # ------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event | None = None, *, grace_s: float | None = None) -> None:
        """Serve until `stop`; then let the sessions held run for `grace_s` (default: the
        `shutdown_grace_s` setting) and hand the rest back."""
        stop = stop or asyncio.Event()
        self._clients: list[Redis] = []
        try:
            if not await when_redis_answers(self._setup_redis, what=f"worker {self.id}", url=self.redis_url,
                                            stop=stop):
                return
            for pool in self.pools.values():
                pool.start_compute()
                await pool.call(pool.executor.setup())
            # Live (counted by /readyz, `stats`, the demo's readiness) only once its models are loaded:
            # the first heartbeat follows the executors' setup. Until then it holds nothing to lease.
            try:
                await self._heartbeat_once()
            except RedisError as exc:       # the heartbeat loop tries again within an interval
                logger.warning("worker %s: first heartbeat failed: %s", self.id, exc)
            groups = read_groups(self.redis, self.keys.cells)
            self._intake_loops = len(groups)
            loops: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = [
                *((f"intake:{g[0]}", functools.partial(self._intake, g)) for g in groups),
                ("heartbeat", self._heartbeat), ("abort-listener", self._abort_listener),
                ("watchdog", self._watchdog), ("dataplane-sweep", self._sweep), ("orphans", self._orphans),
                *((f"inbox:{g[0]}", functools.partial(self._inbox, g)) for g in groups)]
            background = [asyncio.create_task(forever(f"worker {self.id}: {name}", loop), name=name)
                          for name, loop in loops]
            self.started.set()
            logger.info("worker %s serving %s", self.id,
                        ", ".join(f"{p.stage} (max_sessions={p.max_sessions})" for p in self.pools.values()))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *background], return_when=asyncio.FIRST_COMPLETED)
            for task in background:
                if task.done() and task.exception():
                    logger.error("worker task %s died: %r", task.get_name(), task.exception())
            stopper.cancel()
            await self._shutdown(background, self.settings.shutdown_grace_s if grace_s is None else grace_s)
        finally:
            for pool in self.pools.values():
                await pool.close_executor()
            plane: DataPlane | None = getattr(self, "plane", None)     # made once connected
            if plane is not None:
                await plane.aclose()    # what ended goes; a live workflow's payloads stay for this host's next
            for client in self._clients:
                await client.aclose()

    async def _setup_redis(self) -> None:
        if not self._clients:
            self.redis = connect(self.redis_url)        # asks what kind of server this is: may raise
            self._intake_redis = connect(self.redis_url)
            self._inbox_redis = connect(self.redis_url)
            self._write_redis = [self.redis] + [connect(self.redis_url)
                                                for _ in range(self.settings.write_connections - 1)]
            self._clients = [*self._write_redis, self._intake_redis, self._inbox_redis]
            for client in self._write_redis:
                redisio.require_replicas(client, self.settings.wait_replicas, self.settings.wait_timeout_ms)
            self._batchers = [Batcher(client) for client in self._write_redis]
            self.batcher = self._batchers[0]
            self.keys = Keys.of(self.settings, self.redis)
            for pool in self.pools.values():
                pool.bind(self.keys)
            self._by_stream = {key: (pool, cell) for pool in self.pools.values() for cell, key in pool.tasks_keys.items()}
            self.inbox_keys = {cell: self.keys.inbox(self.id, cell) for cell in self.keys.all_cells}
            self.plane = DataPlane(self.redis, self.settings, worker_id=self.id)
        await check_eviction_policy(self.redis)
        await check_layout(self.redis, self.keys)
        await redisio.load_scripts(self.redis)
        for pool in self.pools.values():
            for key in pool.tasks_keys.values():
                await ensure_group(self.redis, key, TASK_GROUP)

    async def _shutdown(self, background: list[asyncio.Task[Any]], grace_s: float) -> None:
        self._stopping = True
        intake = background[:self._intake_loops]     # stop taking tasks: every read group's loop
        for task in intake:
            task.cancel()
        await asyncio.gather(*intake, return_exceptions=True)
        active = [task for _, task in self._sessions.values()]
        if active:
            logger.info("worker %s: waiting up to %.1fs for %d session(s)", self.id, grace_s, len(active))
            await asyncio.wait(active, timeout=grace_s)
        for _, task in list(self._sessions.values()):
            task.cancel()
        rest = background[self._intake_loops:]
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, *[t for _, t in self._sessions.values()], return_exceptions=True)
        try:
            for batcher in self._batchers:
                batcher.closing = True          # a refused write now fails at once: our lease goes to 0
                await batcher.drain()
            # Lease score 0: the reconciler re-queues what we still hold at its next sweep.
            await self.redis.zadd(self.keys.workers, {self.id: 0})
            for key in self.inbox_keys.values():        # one per cell (one slot each on a cluster)
                await self.redis.delete(key)
        except REDIS_ERRORS as exc:
            logger.warning("worker %s: could not deregister: %s", self.id, exc)

    # ------------------------------------------------------------ heartbeat
    async def _heartbeat_once(self) -> None:
        """Renew the lease (`heartbeat.lua`: allowed while Redis is out of memory)."""
        expiry = now_ms() + int(self.settings.lease_timeout_s * 1000)
        self.stats["backpressure_waits"] = self.backpressure.waits
        self.stats["backpressure_wait_s"] = round(self.backpressure.wait_s, 3)
        info = {
            # per stage served, in the same order: "thinker,talker" / "8,4" / "3,1"
            "stage": self.stage, "host": self.settings.host_id, "shm": self.plane.domain, "pid": os.getpid(),
            "capacity": ",".join(str(p.max_sessions) for p in self.pools.values()),
            "active": ",".join(str(p.active) for p in self.pools.values()), "seen_ms": now_ms(),
            "stats": json.dumps(self.stats), "window": json.dumps(self.window.snapshot()),
        }
        drain = await redisio.script(self.redis, "heartbeat", [self.keys.workers, self.keys.worker_info(self.id)],
                                     [self.id, expiry, WORKER_INFO_TTL_S, *(x for kv in info.items() for x in kv)])
        self._heartbeat_ok_at = time.monotonic()
        if drain and self._undrained.is_set():
            logger.info("worker %s: draining (claims nothing new; %d session(s) held)", self.id, len(self._sessions))
            self._undrained.clear()
        elif not drain and not self._undrained.is_set():
            logger.info("worker %s: drain lifted", self.id)
            self._undrained.set()

    @property
    def draining(self) -> bool:
        return not self._undrained.is_set()

    def ready(self) -> tuple[bool, str]:
        """For `/readyz`: started, not stopping, and the lease renewed within its timeout."""
        if not self.started.is_set():
            return False, "starting"
        if self._stopping:
            return False, "stopping"
        age_s = time.monotonic() - self._heartbeat_ok_at
        if age_s > self.settings.lease_timeout_s:
            return False, f"no heartbeat accepted for {age_s:.1f}s"
        return True, ""

    async def _heartbeat(self) -> None:
        failing = False
        while True:
            # after a failure, try again soon: the lease lapses after lease_timeout_s
            await asyncio.sleep(self.settings.heartbeat_interval_s / (4 if failing else 1))
            try:
                await self._heartbeat_once()
                if failing:
                    logger.info("worker %s: heartbeat renewed again", self.id)
                failing = False
            except RedisError as exc:
                if not failing:
                    logger.warning("worker %s heartbeat failed: %s", self.id, exc)
                failing = True

    async def _watchdog(self) -> None:
        """Input-wait timeouts, checked once a second for all sessions (cheaper than a timer per read)."""
        period = min(1.0, *(p.spec.retry.input_timeout_s / 2 for p in self.pools.values()))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for session, _task in list(self._sessions.values()):
                if session is not None and session.waiting_since and \
                        now - session.waiting_since > self.pools[session.stage].spec.retry.input_timeout_s:
                    session.input_timed_out = True
                    if session._waiter is not None:      # the wait itself (on this loop, whoever awaits it)
                        session._waiter.cancel()

    async def _orphans(self) -> None:
        """Claim again the tasks delivered to this worker that it never heard of.

        A task read by XREADGROUP is pending for this worker from the moment the server delivers it;
        if the reply is lost with the connection (a failover, a killed client, a restart after the
        delivery was replicated), nobody works on it and nobody re-queues it: the worker is alive
        and renews its lease. So every `ORPHAN_AUDIT_S` the worker lists its own pending tasks idle
        for `ORPHAN_IDLE_MS` that it does not hold, takes them back (XCLAIM) and claims them as if
        just read."""
        while True:
            await asyncio.sleep(ORPHAN_AUDIT_S)
            for pool in self.pools.values():
                for cell, stream in pool.tasks_keys.items():
                    try:
                        await self._adopt_orphans(pool, cell, stream)
                    except RedisError as exc:
                        logger.warning("worker %s: looking for orphaned tasks of %s failed: %s", self.id, stream, exc)

    async def _adopt_orphans(self, pool: StagePool, cell: int, stream: str) -> int:
        with redisio.boundary():
            rows = await self.redis.xpending_range(stream, TASK_GROUP, min="-", max="+", count=ORPHAN_BATCH,
                                                   consumername=self.id, idle=ORPHAN_IDLE_MS)
        ids = [s(row["message_id"]) for row in rows if s(row["message_id"]) not in self._held]
        if not ids:
            return 0
        with redisio.boundary():
            entries = await self.redis.xclaim(stream, TASK_GROUP, self.id, ORPHAN_IDLE_MS, ids)
        found = [(s(eid), fields) for eid, fields in entries if fields and s(eid) not in self._held]
        # deleted while pending (its session ended elsewhere): un-pend it (Redis 7 and Valkey drop such
        # entries from the pending list in XCLAIM itself; older servers return them without fields)
        gone = [s(eid) for eid, fields in entries if not fields]
        if gone:
            with redisio.boundary():
                await self.redis.xack(stream, TASK_GROUP, *gone)
        if found:
            logger.warning("worker %s: %d task(s) of %s were delivered to it but never received; claiming them",
                           self.id, len(found), pool.stage)
            self.stats["orphans"] = self.stats.get("orphans", 0) + len(found)
            self._accept(pool, cell, found)
        return len(found)

    # ------------------------------------------------------------ intake
    async def _intake(self, cells: tuple[int, ...]) -> None:
        """One blocking XREADGROUP over the task streams of `cells` for every stage with a free slot.
        On a single server one loop reads every cell; on a cluster one loop per cell (one slot per
        read). Each read reserves the slots it may fill (COUNT applies per stream), so the loops
        together never take more tasks than the stages have room for."""
        backoff = Backoff()
        while True:
            if self.draining:
                await self._undrained.wait()
                continue
            ready = [pool for pool in self.pools.values() if pool.free > 0]
            if not ready:
                self._starved += 1
                try:
                    self._slot_free.clear()
                    await self._slot_free.wait()
                finally:
                    self._starved -= 1
                continue
            share = len(cells) * self._intake_loops
            count = max(1, min(self.settings.read_batch, *(pool.free // share for pool in ready)))
            # A stage left out because it was full is not in the blocking read (nor are the slots
            # other loops wait for): come back soon to add it when its slots free up (a blocking read
            # cannot be interrupted without losing what it may already have delivered).
            block = self.settings.block_ms if len(ready) == len(self.pools) and not self._starved else \
                min(self.settings.block_ms, INTAKE_RECHECK_MS)
            reserved = count * len(cells)
            for pool in ready:
                pool.claiming += reserved
            try:
                with redisio.boundary():
                    reply = await self._intake_redis.xreadgroup(
                        TASK_GROUP, self.id, {pool.tasks_keys[cell]: ">" for pool in ready for cell in cells},
                        count=count, block=block)
                backoff.reset()
            except RedisError as exc:
                if redisio.is_nogroup(exc):        # the stream was deleted (or the server lost it)
                    try:
                        for pool in ready:
                            for cell in cells:
                                await ensure_group(self.redis, pool.tasks_keys[cell], TASK_GROUP)
                        continue
                    except RedisError as again:
                        exc = again
                await backoff.wait(logger, f"worker {self.id}: intake read failed", exc)
                continue
            finally:
                for pool in ready:
                    pool.claiming -= reserved
                self._slot_free.set()
            for stream, entries in reply or []:
                pool, cell = self._by_stream[s(stream)]
                self._accept(pool, cell, [(s(entry_id), fields) for entry_id, fields in entries])

    def _accept(self, pool: StagePool, cell: int, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        """Validate delivered tasks (malformed ones go to the dead-letter stream) and claim the rest in one call."""
        if self.draining:       # read by a blocking read that began before the drain: give them back
            task = asyncio.create_task(self._hand_back(pool, cell, entries))
            self._claim_tasks.add(task)
            task.add_done_callback(self._claim_tasks.discard)
            return
        claims: list[tuple[str, str, int]] = []
        for entry_id, fields in entries:
            try:
                entry = task_entry(fields, stage=pool.stage)
            except MalformedEntry as exc:
                self._dead_letter(pool.stage, cell, pool.tasks_keys[cell], TASK_GROUP, entry_id, fields,
                                  f"malformed task entry: {exc}")
                continue
            wf_id, stage, attempt = entry.wf_id, entry.stage, entry.attempt
            if attempt > 1:
                # An older attempt of this session still running here was declared lost (our lease lapsed,
                # or we lost Redis): it is fenced anyway; stop it so it cannot hold this stage's inputs.
                # (The sessions held are scanned, not the attempts: an attempt number is only bounded.)
                prefix = f"{wf_id}|{stage}|"
                for key, (_stale, held) in list(self._sessions.items()):
                    if key.startswith(prefix) and int(key.rsplit("|", 1)[1]) < attempt:
                        held.cancel()
            claims.append((entry_id, wf_id, attempt))
            self._held.add(entry_id)
        if claims:
            pool.claiming += len(claims)
            task = asyncio.create_task(self._claim(pool, cell, claims))
            self._claim_tasks.add(task)
            task.add_done_callback(self._claim_tasks.discard)

    def _spawn(self, key: str, coro: Any, session: Session | None = None, pool: StagePool | None = None,
               *, entry_id: str | None = None) -> None:
        task = asyncio.create_task(coro, name=key)
        self._sessions[key] = (session, task)
        if pool is not None:
            pool.active += 1
        if entry_id is not None:
            self._held.add(entry_id)
        task.add_done_callback(lambda _t: self._release(key, pool, entry_id))

    def _release(self, key: str, pool: StagePool | None, entry_id: str | None = None) -> None:
        self._sessions.pop(key, None)
        if entry_id is not None:
            self._held.discard(entry_id)
        if pool is not None:
            pool.active -= 1
        self._slot_free.set()

    async def _hand_back(self, pool: StagePool, cell: int, entries: list[tuple[str, dict[bytes, bytes]]]) -> None:
        """Re-queue unclaimed tasks as they were (same attempt: still valid for any other worker)."""
        stream = pool.tasks_keys[cell]
        pipe = self.redis.pipeline(transaction=not is_cluster(self.redis))    # one stream: one slot
        for entry_id, fields in entries:
            pipe.xadd(stream, fields)
            pipe.xack(stream, TASK_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
        try:
            await pipe.execute()
            logger.info("worker %s (draining): handed back %d task(s) of %s", self.id, len(entries), pool.stage)
        except REDIS_ERRORS as exc:      # still pending here: re-queued when this worker stops
            logger.warning("worker %s: could not hand back %d task(s): %s", self.id, len(entries), exc)

    def _dead_letter(self, dlq_name: str, cell: int, stream: str, group: str, entry_id: str,
                     fields: dict[bytes, bytes] | None, reason: str) -> None:
        """Move a poison entry of `stream` (of `cell`) to that cell's dead-letter stream `dlq:<dlq_name>`
        with the reason (in the background, retried until Redis takes it: the entry stays where it is
        until then)."""
        self.stats["dead_letters"] += 1
        logger.warning("worker %s: dead-lettering entry %s of %s: %s", self.id, entry_id, stream, reason)
        call = redisio.dead_letter_call(self.keys.dlq(dlq_name, cell), stream, group, entry_id, fields, reason,
                                        max_len=self.settings.dlq_max_len)
        self._spawn(f"dlq:{stream}:{entry_id}", self._write_until_done(call, f"dead-letter {entry_id}"),
                    entry_id=entry_id)

    async def _write_until_done(self, call: tuple[Any, ...], what: str) -> None:
        backoff = Backoff()
        while True:
            try:
                await self.batcher.call(*call)
                return
            except RedisUnavailable as exc:
                if self._stopping:
                    return
                await backoff.wait(logger, f"worker {self.id}: {what}", exc)
            except RedisError as exc:
                logger.error("worker %s: %s failed: %s", self.id, what, exc)
                return

    # ------------------------------------------------------------ sessions
    async def _claim(self, pool: StagePool, cell: int, claims: list[tuple[str, str, int]]) -> None:
        """Claim a batch of tasks with one `claim.lua` call, then start a session for each one kept."""
        stage, upstream = pool.stage, pool.upstream
        queues: list[asyncio.Queue[Any]] = []
        for _entry_id, wf_id, attempt in claims:
            # register before claiming: chunks forwarded to our inbox after the claim find their queue
            queue: asyncio.Queue[Any] = asyncio.Queue()
            self._inputs[(wf_id, stage, attempt)] = queue
            queues.append(queue)
        replies: list[Any] | None = None
        try:
            replies = await self._claim_call(pool, cell, claims)
        finally:
            pool.claiming -= len(claims)
            self._slot_free.set()
            if replies is None:
                for _entry_id, wf_id, attempt in claims:
                    self._inputs.pop((wf_id, stage, attempt), None)
        if replies is None:         # the worker is stopping: the reconciler re-queues what we hold
            return
        loop = asyncio.get_running_loop()
        for (entry_id, wf_id, attempt), queue, reply in zip(claims, queues, replies, strict=True):
            if isinstance(reply, Exception) or s(reply[0]) != "ok":
                if isinstance(reply, Exception):    # this task alone cannot be claimed: poison
                    self._dead_letter(stage, cell, pool.tasks_keys[cell], TASK_GROUP, entry_id,
                                      {b"wf": wf_id.encode(), b"s": stage.encode(), b"a": str(attempt).encode()},
                                      f"claim failed: {reply}")
                self.stats["dropped"] += 1
                self._inputs.pop((wf_id, stage, attempt), None)
                self._held.discard(entry_id)
                continue
            try:
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
                    checkpoint=checkpoint, _home=loop if pool.compute is not None else None,
                    _plane=self.plane, _domain_of=self._domain_of, _chunk_dsts=pool.chunk_dsts,
                    _bp=self.backpressure,
                )
            except Exception as exc:  # noqa: BLE001 - a record that does not decode fails its workflow, not us
                self._inputs.pop((wf_id, stage, attempt), None)
                self._spawn(f"{wf_id}|{stage}|{attempt}",
                            self._fail_unstartable(pool, cell, entry_id, wf_id, attempt, f"workflow record is malformed: "
                                                   f"{type(exc).__name__}: {exc}"[:MAX_DETAIL_CHARS]),
                            entry_id=entry_id)
                continue
            self.stats["claimed"] += 1
            if attempt > 1:
                self.window.retried(stage)
            self._spawn(f"{wf_id}|{stage}|{attempt}", self._session(pool, cell, entry_id, session), session, pool,
                        entry_id=entry_id)

    async def _claim_call(self, pool: StagePool, cell: int, claims: list[tuple[str, str, int]]) -> list[Any] | None:
        """The `claim.lua` replies of a batch, one per task (an exception for a task that alone cannot
        be claimed); None when the worker stopped first. A claim sent again is harmless (same replica:
        'ok' again), so transient errors are retried; a batch the script fails on is split, to find
        the task that causes it."""
        args = [self.settings.prefix, TASK_GROUP, self.id, now_ms(), ",".join(pool.upstream), pool.stage,
                *(x for claim in claims for x in claim)]
        keys = [pool.tasks_keys[cell], self.keys.state_index(WorkflowState.PENDING.value, cell),
                self.keys.state_index(WorkflowState.RUNNING.value, cell)]
        for _entry_id, wf_id, _attempt in claims:
            wf = self.keys.wf(wf_id)
            keys += [wf, f"{wf}:stages", f"{wf}:log", *(f"{wf}:edge:{src}:{pool.stage}" for src in pool.upstream)]
        backoff = Backoff()
        while True:
            try:
                replies = await self.batcher.script("claim", keys, args)
                if not isinstance(replies, list) or len(replies) != len(claims):
                    raise ScriptError(f"unexpected claim reply {replies!r:.200}")
                return replies
            except RedisUnavailable as exc:        # lost, refused (OOM, READONLY, LOADING...)
                if self._stopping:
                    return None
                await backoff.wait(logger, f"worker {self.id}: claim failed", exc)
            except ScriptError as exc:
                if len(claims) == 1:
                    return [exc]
                logger.warning("worker %s: a claim of %d tasks failed (%s); claiming them one by one",
                               self.id, len(claims), exc)
                out: list[Any] = []
                for claim in claims:
                    one = await self._claim_call(pool, cell, [claim])
                    if one is None:
                        return None
                    out += one
                return out

    async def _fail_unstartable(self, pool: StagePool, cell: int, entry_id: str, wf_id: str, attempt: int,
                                why: str) -> None:
        """Close a claimed session that cannot start (its record does not decode) as a failure that
        is not retried: its workflow fails with the reason, its task is acknowledged."""
        logger.warning("session %s/%s cannot start: %s", wf_id, pool.stage, why)
        wf = self.keys.wf(wf_id)
        call = evalsha_args("finish", [wf, pool.tasks_keys[cell], self.keys.events(cell), f"{wf}:stages", f"{wf}:log"],
                            [TASK_GROUP, entry_id, pool.stage, attempt, "failed", why, "0", now_ms(), 0, ""])
        await self._write_until_done(call, f"failing session {wf_id}/{pool.stage}")

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

    async def _inbox(self, cells: tuple[int, ...]) -> None:
        """Read this worker's inboxes of `cells` (inputs forwarded by producers) and hand each entry to
        its session: one XREAD for every cell on a single server, one per cell on a cluster."""
        last: dict[str, bytes | str] = {self.inbox_keys[cell]: "0-0" for cell in cells}
        cell_of_key = {self.inbox_keys[cell]: cell for cell in cells}
        untrimmed = dict.fromkeys(last, 0)
        only = next(iter(self.pools)) if len(self.pools) == 1 else None
        backoff = Backoff()
        while True:
            try:
                with redisio.boundary():
                    reply = await self._inbox_redis.xread(dict(last), count=1024, block=self.settings.block_ms)
                backoff.reset()
            except RedisError as exc:
                await backoff.wait(logger, f"worker {self.id}: inbox read failed", exc)
                continue
            for raw_key, entries in reply or []:
                key = s(raw_key)
                for entry_id, fields in entries:
                    last[key] = entry_id
                    try:
                        entry = inbox_entry(fields)
                        chunks = decode_chunks(entry.packed)
                    except (MalformedEntry, *CHUNK_DECODE_ERRORS) as exc:
                        self._dead_letter("inbox", cell_of_key[key], key, "", s(entry_id), fields,
                                          f"malformed inbox entry: {exc}")
                        continue
                    queue = self._inputs.get((entry.wf_id, entry.stage or only or "", entry.attempt))
                    if queue is not None:       # else: a session that ended (its inputs are durable anyway)
                        for chunk in chunks:
                            queue.put_nowait((entry.src, chunk))
                untrimmed[key] += len(entries)
                if entries and untrimmed[key] >= INBOX_TRIM_EVERY:
                    # consumed entries are trimmed in bulk: the inbox stays about as small as what is in flight
                    self.batcher.send("XTRIM", key, "MINID", "~", s(entries[-1][0]))
                    untrimmed[key] = 0

    async def _session(self, pool: StagePool, cell: int, entry_id: str, session: Session) -> None:
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
        except RedisError as exc:
            # A write of this attempt was refused or lost at the Redis boundary (a restart, a failover,
            # a dropped connection, a refusal that outlasted the batcher's patience, a script error):
            # the attempt ends here. Its finish carries how many steps it emitted, so it is closed as a
            # retryable failure (never as done over a hole) and the retry resumes from what was stored.
            logger.warning("session %s/%s: a write failed: %s", wf_id, stage, exc)
            outcome, detail, retryable = "failed", f"worker {self.id}: a write failed: {exc}"[:MAX_DETAIL_CHARS], True
        finally:
            self._inputs.pop((wf_id, stage, attempt), None)
        code = await self._close(pool, cell, entry_id, session, outcome, detail, retryable)
        if session.held and code == "ok" and outcome == "done":
            # done for good: no retry of this session will replay these payloads
            await self._release_inputs(session)
        if code == "fenced":
            self.stats["fenced"] += 1
        elif code is not None:
            ended = "done" if outcome == "done" and code != "gap" else "failed"
            self.stats[ended] += 1
            self.window.finished(stage, ended, time.monotonic() - started)

    async def _close(self, pool: StagePool, cell: int, entry_id: str, session: Session, outcome: str, detail: str,
                     retryable: bool) -> str | None:
        """End the session (its last steps and the finish, one script call) whatever Redis does
        meanwhile: the task must never stay pending on a live worker. Returns the script's answer
        ('ok', 'fenced', 'gap'), or None when the session was handed to the reconciler instead."""
        backoff = Backoff()
        while True:
            try:
                return await session.close(tasks_key=pool.tasks_keys[cell], events_key=self.keys.events(cell),
                                           group=TASK_GROUP,
                                           entry_id=entry_id, outcome=outcome, detail=detail, retryable=retryable)
            except RedisUnavailable as exc:
                # lost, or refused for longer than the batcher waits: it may or may not have landed;
                # sending the finish again is safe (fenced by status and by step count)
                if self._stopping:
                    return None         # our lease goes to 0 at shutdown: the reconciler re-queues it
                await backoff.wait(logger, f"session {session.wf_id}/{session.stage}: finish failed", exc)
            except RedisError as exc:   # the finish itself fails (a bug, a record it cannot take)
                await self._report_lost(entry_id, session.wf_id, session.stage, session.attempt,
                                        f"worker {self.id} could not finish the session: {exc}"[:MAX_DETAIL_CHARS])
                return None

    async def _report_lost(self, entry_id: str, wf_id: str, stage: str, attempt: int, why: str) -> None:
        """Tell the reconciler this session is lost (it acks the task and retries with attempt + 1),
        retrying until Redis takes the report: a task must never stay pending on a live worker."""
        backoff = Backoff()
        while True:
            try:
                with redisio.boundary():
                    await self.redis.xadd(self.keys.events(self.keys.cell_of(wf_id)),
                                          {"t": "lost", "wf": wf_id, "s": stage, "a": attempt, "d": why, "r": "1",
                                           "e": entry_id})
                return
            except RedisError as exc:
                if self._stopping:
                    return              # our lease goes to 0 at shutdown: the reconciler re-queues it
                await backoff.wait(logger, f"session {wf_id}/{stage}: could not report it lost", exc)

    async def _restart(self, session: Session, *, lost: InputLost | None = None) -> str:
        """This executor cannot resume: its output, and everything downstream of it, starts over
        (`restart.lua` re-queues the downstream sessions and logs a `restart` event).

        With `lost` ("regenerate"): this session cannot read what stage `lost.src` wrote (the
        chunks were in the shared memory of a host it cannot map, or are gone), so that stage runs
        again, and everything downstream of it, this session included (fenced by its attempt: the
        new attempt reads the new output). Returns the script's answer: 'ok', 'fenced' or, for a
        producer that has used its attempts, 'exhausted'."""
        stage = lost.src if lost is not None else session.stage
        below = self.pipeline.descendants(stage, session.required)
        requeued = below if lost is None else [stage, *below]
        edges = [f"{s}:{e.dst}" for s in (stage, *below) for e in self.pipeline.outputs[s]
                 if e.dst in session.required]
        wf, cell = self.keys.wf(session.wf_id), self.keys.cell_of(session.wf_id)
        keys = [wf, f"{wf}:stages", f"{wf}:log", *(f"{wf}:edge:{edge}" for edge in edges),
                *(f"{wf}:out:{st}" for st in (stage, *below)), *(self.keys.tasks(st, cell) for st in requeued)]
        args: list[Any] = [self.settings.prefix, stage, "" if lost else session.attempt, now_ms(), ",".join(below),
                           ",".join(edges)]
        if lost is not None:
            args += [session.stage, session.attempt, self.pipeline.stages[stage].retry.max_attempts,
                     str(lost)[:MAX_DETAIL_CHARS]]
        reply = s(await self.batcher_for(session.wf_id).script("restart", keys, args))
        if reply == "fenced" or (lost is not None and reply == "ok"):
            session.fenced = True
        if lost is None:
            session.resume_seq = 0
        return reply

    async def _execute(self, pool: StagePool, session: Session) -> tuple[str, str, bool]:
        """Run the executor; map how it ended to (outcome, detail, retryable)."""
        retry = pool.spec.retry
        try:
            async with pool.slots, asyncio.timeout(retry.attempt_timeout_s):
                usage = await pool.call(pool.executor.run(session))
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
        `_restart`); this attempt ends fenced. A producer out of attempts fails this session with the
        reason, retryable (a replica on the producer's host may still read it)."""
        # The newer attempt the script queues may reach this worker before its reply does, and
        # cancel this one: the call is shielded, and what it did is counted when it ends.
        call = asyncio.ensure_future(self._restart(session, lost=lost))
        self._background.add(call)
        call.add_done_callback(functools.partial(self._regenerated, session, lost))
        reply = await asyncio.shield(call)
        if reply == "ok":
            return "failed", f"{lost}; {lost.src} runs again"[:MAX_DETAIL_CHARS], True
        if reply == "exhausted":
            return "failed", f"{lost}; {lost.src} has used its attempts"[:MAX_DETAIL_CHARS], True
        return "failed", "fenced", False

    def _regenerated(self, session: Session, lost: InputLost, call: asyncio.Future[str]) -> None:
        self._background.discard(call)
        if not call.cancelled() and call.exception() is None and call.result() == "ok":
            self.stats["regenerated"] += 1
            logger.warning("session %s/%s: %s; %s runs again", session.wf_id, session.stage, lost, lost.src)

    async def _domain_of(self, wf_id: str, dst: str) -> str:
        """The shared-memory domain of the replica the consuming session `dst` of `wf_id` is bound to
        ('' while it is not claimed, or when that replica publishes none)."""
        replica = await self.batcher.send("HGET", self.keys.stages(wf_id), f"{dst}:replica")
        if not replica:
            return ""
        rid = s(replica)
        domain = self._replica_domains.get(rid)
        if domain is None:
            domain = s(await self.batcher.send("HGET", self.keys.worker_info(rid), "shm") or b"")
            if len(self._replica_domains) > 4096:
                self._replica_domains.clear()
            self._replica_domains[rid] = domain
        return domain

    async def _release_inputs(self, session: Session) -> None:
        try:
            self.stats["payloads_released"] += await self.plane.release(session.held)
        except REDIS_ERRORS as exc:     # they expire with their TTL, or go at the workflow's terminal
            logger.warning("session %s/%s: releasing its inputs failed: %s", session.wf_id, session.stage,
                           redisio.translate(exc))
        session.held.clear()

    async def _sweep(self) -> None:
        """Every `dataplane_sweep_interval_s`: free this host's segments of ended workflows, expired
        ones and those dead producers left (staggered by worker, so hosts do not sweep in step)."""
        interval = self.settings.dataplane_sweep_interval_s
        await asyncio.sleep(interval * (0.5 + (hash(self.id) % 1000) / 2000))
        while True:
            try:
                freed = await self.plane.sweep()
                self.stats["segments_swept"] += sum(freed.values())
            except REDIS_ERRORS as exc:
                logger.warning("worker %s: data-plane sweep failed: %s", self.id, redisio.translate(exc))
            await asyncio.sleep(interval)

    async def _abort_listener(self) -> None:
        while True:
            client = pubsub_client(self.redis)      # on a cluster: a connection to one of its nodes
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.abort_channel)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self.cancel_workflow(s(message["data"]))
            except REDIS_ERRORS as exc:
                logger.warning("worker %s: abort channel lost: %s", self.id, redisio.translate(exc))
                await asyncio.sleep(0.5)
            finally:
                await pubsub.aclose()
                if client is not self.redis:
                    await client.aclose()

    def cancel_workflow(self, wf_id: str) -> int:
        """Cancel every local session of `wf_id` (abort fan-out); its segments on this host go too."""
        if self.plane.shm is not None:
            freeing = asyncio.get_running_loop().create_task(self.plane.shm.release_workflow(wf_id))
            self._background.add(freeing)      # keep a reference until it is done
            freeing.add_done_callback(self._background.discard)
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

    from omniflow.engine.health import with_health

    worker = Worker(settings=settings, pipeline=pipeline, stage=stage, redis_url=redis_url)
    run_until_signal(with_health(worker.run, port=settings.health_port, ready=worker.ready))

