"""Ending work from outside a session: the abort fan-out (pub/sub on `<p>:abort` cancels a workflow's
sessions at once; the tombstone and the fenced scripts are the durable truth) and the data-plane
sweep of this host's segments of ended workflows."""
from __future__ import annotations

import asyncio
import logging

from omniflow.engine.worker.context import WorkerContext
from omniflow.storage import redisio
from omniflow.storage.redisio import REDIS_ERRORS
from omniflow.storage.schema import s

logger = logging.getLogger(__name__)

ABORT_RESUBSCRIBE_S = 0.5


class AbortFanout:
    """Cancels the local sessions of aborted workflows, and sweeps this host's shared memory."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        # set while the server has confirmed this worker's subscription: an abort published before
        # that never reaches it (the worker counts as started only once it is set)
        self.subscribed = asyncio.Event()

    async def listen(self) -> None:
        ctx = self.ctx
        while True:
            try:
                async for data in ctx.redis.listen(ctx.keys.abort_channel, subscribed=self.subscribed):
                    self.cancel_workflow(s(data))
            except REDIS_ERRORS as exc:
                self.subscribed.clear()
                logger.warning("worker %s: abort channel lost: %s", ctx.id, redisio.translate(exc))
                await asyncio.sleep(ABORT_RESUBSCRIBE_S)

    def cancel_workflow(self, wf_id: str) -> int:
        """Cancel every local session of `wf_id` (abort fan-out); its segments on this host go too."""
        ctx = self.ctx
        ctx.heard_abort(wf_id)
        if ctx.plane.shm is not None:
            ctx.track(asyncio.get_running_loop().create_task(ctx.plane.shm.release_workflow(wf_id)))
        n = 0
        for key, (session, task) in list(ctx.sessions.items()):
            if key.startswith(f"{wf_id}|"):
                if session is not None:
                    session.abort()
                task.cancel()
                n += 1
        return n

    async def sweep(self) -> None:
        """Every `dataplane_sweep_interval_s`: free this host's segments of ended workflows, expired
        ones and those dead producers left (staggered by worker, so hosts do not sweep in step)."""
        ctx = self.ctx
        interval = ctx.settings.dataplane_sweep_interval_s
        await asyncio.sleep(interval * (0.5 + (hash(ctx.id) % 1000) / 2000))
        while True:
            try:
                freed = await ctx.plane.sweep()
                ctx.stats["segments_swept"] += sum(freed.values())
            except REDIS_ERRORS as exc:
                logger.warning("worker %s: data-plane sweep failed: %s", ctx.id, redisio.translate(exc))
            await asyncio.sleep(interval)
