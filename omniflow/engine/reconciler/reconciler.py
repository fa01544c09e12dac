"""The `Reconciler`: builds its parts around one shared context and runs them (one event consumer
per read group, the sweeper), and says whether it is ready."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.config import Settings
from omniflow.dataplane import DataPlane
from omniflow.engine.reconciler.context import ReconcilerContext
from omniflow.engine.reconciler.events import Events
from omniflow.engine.reconciler.sweeps import Sweeps
from omniflow.errors import RedisError
from omniflow.catalog import Catalog
from omniflow.pipeline import Pipeline
from omniflow.runtime import check_eviction_policy, check_layout, forever, when_redis_answers
from omniflow.storage import redisio, registry
from omniflow.storage.keys import EVENT_GROUP, TASK_GROUP, Keys
from omniflow.storage.redisio import connect, ensure_group
from omniflow.storage.transitions.housekeeping import reap_consumer
from omniflow.storage.topology import read_groups

logger = logging.getLogger(__name__)


class Reconciler:
    """One reconciler process (see the package docstring)."""

    def __init__(self, *, settings: Settings, pipeline: Pipeline | Catalog, redis_url: str,
                 reconciler_id: str | None = None) -> None:
        self.ctx = ctx = ReconcilerContext(settings=settings, pipeline=pipeline, redis_url=redis_url,
                                           reconciler_id=reconciler_id)
        self.settings, self.pipeline, self.redis_url, self.id = settings, ctx.pipeline, redis_url, ctx.id
        self.events = Events(ctx)
        self.sweeps = Sweeps(ctx, self.events)
        self._clients: list[RedisClient] = []

    # ------------------------------------------------------------ what others see
    @property
    def started(self) -> asyncio.Event:
        return self.ctx.started

    @property
    def counts(self) -> dict[str, int]:
        return self.ctx.counts

    @property
    def keys(self) -> Keys:
        return self.ctx.keys

    @keys.setter
    def keys(self, keys: Keys) -> None:           # a test's own layout, without `run`
        self.ctx.keys = keys

    @property
    def redis(self) -> RedisClient:
        return self.ctx.redis

    @redis.setter
    def redis(self, client: RedisClient) -> None:       # a test's own connection, without `run`
        self.ctx.redis = client

    async def apply(self, entries: list[tuple[bytes, dict[bytes, bytes] | None]], cell: int = 0) -> list[str]:
        """Apply a batch of events in one round trip (`Events.apply`)."""
        return await self.events.apply(entries, cell)

    async def sweep(self) -> dict[str, int]:
        """One pass of the periodic work over every cell (`Sweeps.sweep`)."""
        return await self.sweeps.sweep()

    def ready(self) -> tuple[bool, str]:
        """For `/readyz`: started, and an event read answered within one blocking read plus a lease."""
        if not self.started.is_set():
            return False, "starting"
        age_s = time.monotonic() - self.ctx.redis_ok_at
        if age_s > self.settings.block_ms / 1000 + self.settings.lease_timeout_s:
            return False, f"no event read answered for {age_s:.1f}s"
        return True, ""

    # ------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        ctx = self.ctx
        try:
            if not await when_redis_answers(self._setup, what=f"reconciler {self.id}", url=self.redis_url,
                                            stop=stop):
                return
            tasks: list[asyncio.Task[Any]] = [
                asyncio.create_task(forever(f"reconciler {self.id}: consume {g[0]}",
                                            functools.partial(self.events.consume, g)), name=f"consume:{g[0]}")
                for g in read_groups(ctx.redis, ctx.keys.cells)]
            tasks.append(asyncio.create_task(forever(f"reconciler {self.id}: sweeps", self.sweeps.run),
                                             name="sweeper"))
            ctx.redis_ok_at = time.monotonic()
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
        ctx = self.ctx
        if not self._clients:
            ctx.redis = connect(self.redis_url)        # asks what kind of server this is: may raise
            ctx.blocking = connect(self.redis_url)
            self._clients = [ctx.redis, ctx.blocking]
            ctx.plane = DataPlane(ctx.redis, self.settings, worker_id=self.id)
            redisio.require_replicas(ctx.redis, self.settings.wait_replicas, self.settings.wait_timeout_ms)
            ctx.keys = Keys.of(self.settings, ctx.redis)
        await check_eviction_policy(ctx.redis)
        await check_layout(ctx.redis, ctx.keys)
        await redisio.load_scripts(ctx.redis)
        for cell in ctx.keys.all_cells:
            await ensure_group(ctx.redis, ctx.keys.events(cell), EVENT_GROUP)
            for pipe in ctx.catalog:
                for stage in pipe.order:
                    for stream in ctx.keys.task_streams(pipe.queue(stage), cell):
                        await ensure_group(ctx.redis, stream, TASK_GROUP)
        for pipe in ctx.catalog:
            await registry.register(ctx.redis, ctx.keys, pipe)

    async def _leave(self) -> None:
        """Delete our consumer from the event group if it holds nothing (a crashed reconciler's
        consumer is deleted by the sweeps once it has been idle long enough)."""
        ctx = self.ctx
        try:
            await redisio.execute(ctx.redis, [reap_consumer(ctx.keys.events(cell), EVENT_GROUP, self.id)
                                              for cell in ctx.keys.all_cells])
        except RedisError as exc:
            logger.warning("reconciler %s: could not leave the event group: %s", self.id, exc)


def run_reconciler(settings: Settings, pipeline: Pipeline | Catalog, redis_url: str) -> None:
    from omniflow.engine.health import with_health
    from omniflow import tracing
    from omniflow.runtime import run_until_signal

    tracing.setup("reconciler")
    rec = Reconciler(settings=settings, pipeline=pipeline, redis_url=redis_url)
    run_until_signal(with_health(rec.run, port=settings.health_port, ready=rec.ready))
