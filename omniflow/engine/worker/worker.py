"""The `Worker`: one process serving one stage, or several stages that share a device. It builds
the parts (`omniflow.engine.worker`'s modules) around one shared context and runs their loops:
intake, heartbeat, abort fan-out, input watchdog, data-plane sweep, orphan audit, inbox."""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.config import Settings
from omniflow.dataplane import DataPlane
from omniflow.dataplane.backpressure import WaitStats
from omniflow.engine.window import StageWindow
from omniflow.engine.worker.abort import AbortFanout
from omniflow.engine.worker.claims import Claims
from omniflow.engine.worker.context import WorkerContext
from omniflow.engine.worker.inbox import Inbox
from omniflow.engine.worker.intake import Intake
from omniflow.engine.worker.liveness import Liveness
from omniflow.engine.worker.pool import build_pools, new_worker_id, unique_cores
from omniflow.engine.worker.sessions import SessionRunner
from omniflow.errors import RedisError
from omniflow.catalog import Catalog
from omniflow.fairness import parse_priority_weights, parse_weights
from omniflow.storage.fairshare import decode_weights
from omniflow.pipeline import Pipeline
from omniflow.runtime import check_eviction_policy, check_layout, forever, when_redis_answers
from omniflow.storage import redisio, registry
from omniflow.storage.batcher import Batcher
from omniflow.storage.keys import TASK_GROUP, Keys
from omniflow.storage.redisio import REDIS_ERRORS, connect, ensure_group
from omniflow.storage.topology import read_groups
from omniflow.executor import Executor

logger = logging.getLogger(__name__)


class Worker:
    """A worker process's runtime (see the package docstring)."""

    def __init__(self, *, settings: Settings, pipeline: Pipeline | Catalog | Sequence[Pipeline],
                 stage: str | Sequence[str], redis_url: str, worker_id: str | None = None,
                 executor: Executor | None = None, max_sessions: int | None = None) -> None:
        catalog = pipeline if isinstance(pipeline, Catalog) else Catalog.of(pipeline)
        routes = catalog.routes(stage)
        # tenant weights: the configured ones, refreshed from Redis (`_weights`); shared by every pool's slots
        self.tenant_weights: dict[str, float] = parse_weights(settings.tenant_weights)
        pools = build_pools(routes, executor=executor, max_sessions=max_sessions,
                            class_weights=parse_priority_weights(settings.priority_weights),
                            tenant_weights=self.tenant_weights, live_window_s=settings.live_window_s)
        if executor is not None and len(unique_cores(pools)) > 1:
            raise ValueError("an executor instance can serve one stage (one pool) only")
        stages = list(dict.fromkeys(st for _p, st in routes))
        label = ",".join(stages)          # what this worker serves (heartbeat, logs)
        self.id = worker_id or new_worker_id("+".join(stages) if len(stages) < 3 else "multi", settings.host_id)
        self.ctx = ctx = WorkerContext(settings=settings, pipeline=catalog.default, worker_id=self.id, label=label,
                                       pools=pools, redis_url=redis_url, catalog=catalog)
        self.catalog = catalog
        self.settings, self.pipeline, self.pools, self.stage, self.redis_url = \
            settings, catalog.default, pools, label, redis_url
        self.liveness = Liveness(ctx)
        self.runner = SessionRunner(ctx)
        self.claims = Claims(ctx, self.runner)
        self.inbox = Inbox(ctx)
        self.abort = AbortFanout(ctx)
        self._clients: list[RedisClient] = []

    # ------------------------------------------------------------ what others see
    @property
    def started(self) -> asyncio.Event:
        return self.liveness.started

    @property
    def stats(self) -> dict[str, float]:
        return self.ctx.stats

    @property
    def keys(self) -> Keys:
        return self.ctx.keys

    @property
    def redis(self) -> RedisClient:
        return self.ctx.redis

    @property
    def batcher(self) -> Batcher:
        return self.ctx.batcher

    def batcher_for(self, wf_id: str) -> Batcher:
        return self.ctx.batcher_for(wf_id)

    @property
    def plane(self) -> DataPlane:
        return self.ctx.plane

    @property
    def backpressure(self) -> WaitStats:
        return self.ctx.backpressure

    @property
    def window(self) -> StageWindow:
        return self.ctx.window

    @property
    def draining(self) -> bool:
        return self.ctx.draining

    @property
    def _stopping(self) -> bool:
        return self.ctx.stopping

    @property
    def _heartbeat_ok_at(self) -> float:
        return self.liveness.heartbeat_ok_at

    @_heartbeat_ok_at.setter
    def _heartbeat_ok_at(self, value: float) -> None:
        self.liveness.heartbeat_ok_at = value

    def ready(self) -> tuple[bool, str]:
        """For `/readyz`: started, not stopping, and the lease renewed within its timeout."""
        return self.liveness.ready()

    def cancel_workflow(self, wf_id: str) -> int:
        """Cancel every local session of `wf_id` (abort fan-out); its segments on this host go too."""
        return self.abort.cancel_workflow(wf_id)

    # ------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event | None = None, *, grace_s: float | None = None) -> None:
        """Serve until `stop`; then let the sessions held run for `grace_s` (default: the
        `shutdown_grace_s` setting) and hand the rest back."""
        stop = stop or asyncio.Event()
        ctx = self.ctx
        try:
            if not await when_redis_answers(self._setup_redis, what=f"worker {self.id}", url=self.redis_url,
                                            stop=stop):
                return
            # Seen as `loading` while its models load (outside the lease set: see `Liveness`)
            announcer = asyncio.create_task(self.liveness.announce_loading(), name="announce-loading")
            loaded = False
            try:
                for pool in unique_cores(self.pools):
                    pool.start_compute()
                    await pool.call(pool.executor.setup())
                loaded = True
            finally:
                announcer.cancel()
                await asyncio.gather(announcer, return_exceptions=True)
                if not loaded:          # setup failed (or the worker was cancelled): it is not loading any more
                    await self.liveness.leave_loading()
            # Live (counted by /readyz, `stats`, the demo's readiness) only once its models are loaded:
            # the first heartbeat follows the executors' setup. Until then it holds nothing to lease.
            try:
                await self.liveness.heartbeat_once()
            except RedisError as exc:       # the heartbeat loop tries again within an interval
                logger.warning("worker %s: first heartbeat failed: %s", self.id, exc)
            await self.liveness.leave_loading()
            # The abort fan-out first: no task is taken (and the worker does not count as started)
            # before the server confirmed its subscription, so no abort of a session it holds is
            # published where it cannot hear it (the fenced scripts alone would end such a session
            # only at its next write: never, for one waiting for input).
            listener = asyncio.create_task(forever(f"worker {self.id}: abort-listener", self.abort.listen),
                                           name="abort-listener")
            try:
                await _first_of(self.abort.subscribed.wait(), stop.wait())
            except BaseException:
                listener.cancel()
                raise
            groups = read_groups(ctx.redis, ctx.keys.cells)
            intake = Intake(ctx, self.claims, loops=len(groups))
            loops: list[tuple[str, Callable[[], Coroutine[Any, Any, None]]]] = [
                *((f"intake:{g[0]}", functools.partial(intake.run, g)) for g in groups),
                ("heartbeat", self.liveness.heartbeat),
                ("watchdog", self.liveness.watchdog), ("dataplane-sweep", self.abort.sweep),
                ("orphans", intake.orphans), ("trim", intake.trim), ("tenant-weights", self._weights),
                *((f"inbox:{g[0]}", functools.partial(self.inbox.run, g)) for g in groups)]
            background = [asyncio.create_task(forever(f"worker {self.id}: {name}", loop), name=name)
                          for name, loop in loops]
            background.insert(len(groups) + 1, listener)
            self.started.set()
            logger.info("worker %s serving %s", self.id,
                        ", ".join(f"{p.stage} of {p.pipeline.name}@{p.pipeline.digest} (pool {p.core.key}, "
                                  f"max_sessions={p.max_sessions})" for p in self.pools.values()))
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *background], return_when=asyncio.FIRST_COMPLETED)
            for task in background:
                if task.done() and task.exception():
                    logger.error("worker task %s died: %r", task.get_name(), task.exception())
            stopper.cancel()
            await self._shutdown(background[:len(groups)], background[len(groups):],
                                 self.settings.shutdown_grace_s if grace_s is None else grace_s)
        finally:
            for pool in unique_cores(self.pools):
                await pool.close_executor()
            plane: DataPlane | None = getattr(ctx, "plane", None)     # made once connected
            if plane is not None:
                await plane.aclose()    # what ended goes; a live workflow's payloads stay for this host's next processes
            for client in self._clients:
                await client.aclose()

    async def _weights(self) -> None:
        """Follow the tenant weights set live (`omniflow tenants weight`) for the slots' tenant order."""
        configured = parse_weights(self.settings.tenant_weights)
        while True:
            try:
                with redisio.boundary():
                    live = decode_weights(await self.ctx.redis.hgetall(self.ctx.keys.fair_weights))
                fresh = {**configured, **live}
                if fresh != self.tenant_weights:
                    self.tenant_weights.clear()
                    self.tenant_weights.update(fresh)
            except RedisError as exc:
                logger.debug("worker %s: reading tenant weights failed: %s", self.id, exc)
            await asyncio.sleep(max(1.0, self.settings.fair_refresh_ms / 1000))

    async def _setup_redis(self) -> None:
        ctx = self.ctx
        if not self._clients:
            ctx.redis = connect(self.redis_url)        # asks what kind of server this is: may raise
            ctx.intake_redis = connect(self.redis_url)
            ctx.inbox_redis = connect(self.redis_url)
            writers = [ctx.redis] + [connect(self.redis_url) for _ in range(self.settings.write_connections - 1)]
            self._clients = [*writers, ctx.intake_redis, ctx.inbox_redis]
            for client in writers:
                redisio.require_replicas(client, self.settings.wait_replicas, self.settings.wait_timeout_ms)
            ctx.batchers = [Batcher(client) for client in writers]
            ctx.batcher = ctx.batchers[0]
            ctx.keys = Keys.of(self.settings, ctx.redis)
            for pool in self.pools.values():
                pool.bind(ctx.keys)
            ctx.inbox_keys = {cell: ctx.keys.inbox(self.id, cell) for cell in ctx.keys.all_cells}
            ctx.plane = DataPlane(ctx.redis, self.settings, worker_id=self.id)
        await check_eviction_policy(ctx.redis)
        await check_layout(ctx.redis, ctx.keys)
        await redisio.load_scripts(ctx.redis)
        for pipe in self.catalog:       # a new pipeline (or version) joins the deployment with its first worker
            await registry.register(ctx.redis, ctx.keys, pipe)
        for pool in self.pools.values():
            for streams in pool.class_streams.values():
                for key in streams:
                    await ensure_group(ctx.redis, key, TASK_GROUP)

    async def _shutdown(self, intake: list[asyncio.Task[Any]], rest: list[asyncio.Task[Any]], grace_s: float) -> None:
        ctx = self.ctx
        ctx.stopping = True
        for task in intake:             # stop taking tasks: every read group's loop
            task.cancel()
        await asyncio.gather(*intake, return_exceptions=True)
        active = [task for _, task in ctx.sessions.values()]
        if active:
            logger.info("worker %s: waiting up to %.1fs for %d session(s)", self.id, grace_s, len(active))
            await asyncio.wait(active, timeout=grace_s)
        for _, task in list(ctx.sessions.values()):
            task.cancel()
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, *[t for _, t in ctx.sessions.values()], return_exceptions=True)
        try:
            for batcher in ctx.batchers:
                batcher.closing = True          # a refused write now fails at once: our lease goes to 0
                await batcher.drain()
            # Lease score 0: the reconciler re-queues what we still hold at its next sweep.
            await ctx.redis.zadd(ctx.keys.workers, {self.id: 0})
            for key in ctx.inbox_keys.values():        # one per cell (one slot each on a cluster)
                await ctx.redis.delete(key)
        except REDIS_ERRORS as exc:
            logger.warning("worker %s: could not deregister: %s", self.id, exc)


def run_worker(settings: Settings, pipeline: Pipeline | Catalog, stage: str | Sequence[str], redis_url: str) -> None:
    """Blocking entry point used by the CLI: runs until SIGINT/SIGTERM."""
    from omniflow.engine.health import with_health
    from omniflow import tracing
    from omniflow.runtime import run_until_signal

    tracing.setup("worker")
    worker = Worker(settings=settings, pipeline=pipeline, stage=stage, redis_url=redis_url)
    run_until_signal(with_health(worker.run, port=settings.health_port, ready=worker.ready))


async def _first_of(*aws: Coroutine[Any, Any, Any]) -> None:
    """Until the first of `aws` is done (the others are cancelled)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
