"""What the parts of a worker share: its identity and settings, its connections, its stage pools,
the sessions it holds, its counters. One object, built by `Worker` and handed to each part
(intake, claims, sessions, liveness, inbox, abort fan-out), so no part reaches into another."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.config import Settings
from omniflow.dataplane import DataPlane
from omniflow.dataplane.backpressure import WaitStats
from omniflow.engine.session import Session
from omniflow.engine.session.consumers import Consumers, LocalInputs
from omniflow.engine.window import StageWindow
from omniflow.engine.worker.pool import StagePool
from omniflow.errors import RedisError, RedisUnavailable
from omniflow.catalog import Catalog
from omniflow.pipeline import Pipeline
from omniflow.runtime import Backoff
from omniflow.storage.batcher import Batcher
from omniflow.storage.keys import Keys
from omniflow.storage.transitions.reconcile import dead_letter

logger = logging.getLogger(__name__)

#: the counters a worker publishes with its heartbeat (`omniflow workers`, `/metrics`)
#: the latest aborted workflows a worker remembers (see `WorkerContext.heard_abort`)
ABORTS_KEPT = 4096

STAT_NAMES = ("claimed", "dropped", "done", "failed", "fenced", "dead_letters", "backpressure_waits",
              "payloads_released", "segments_swept", "regenerated")


class WorkerContext:
    """The shared state of one worker process (see the module docstring)."""

    def __init__(self, *, settings: Settings, pipeline: Pipeline, worker_id: str, label: str,
                 pools: dict[str, StagePool], redis_url: str, catalog: Catalog | None = None) -> None:
        self.settings = settings
        self.pipeline = pipeline                # the default pipeline (each pool knows its own)
        self.catalog = catalog or Catalog.of(pipeline)
        self.id = worker_id
        self.label = label                      # the stages served, comma-separated (heartbeat, logs)
        self.pools = pools                      # by queue (`Pipeline.queue`): one per (pipeline version, stage)
        self.redis_url = redis_url
        # the layout (how many cells) is known once connected (`Worker._setup_redis`)
        self.keys = Keys(settings.prefix, settings.cells or 1)
        # connections, made by `Worker._setup_redis`
        self.redis: RedisClient
        self.intake_redis: RedisClient
        self.inbox_redis: RedisClient
        self.batchers: list[Batcher] = []
        self.batcher: Batcher
        self.plane: DataPlane
        self.inbox_keys: dict[int, str] = {}
        # the sessions held: "<wf>|<stage>|<attempt>" -> (its session, or None for a helper task; its task)
        self.sessions: dict[str, tuple[Session | None, asyncio.Task[None]]] = {}
        self.held: set[str] = set()     # task entry ids this worker is working on (claim, session, dead letter)
        self.aborted: dict[str, None] = {}  # the workflows whose abort this worker heard, oldest first
        # (wf, stage, attempt) -> the input queue of that session; what its own producers hand it
        self.inputs = LocalInputs(worker_id)
        self.consumers = Consumers()        # which replicas consume which stage: the inboxes emits declare
        self.slot_free = asyncio.Event()        # a session slot came free (intake waits on it)
        self.undrained = asyncio.Event()        # cleared while an operator drains this worker
        self.undrained.set()
        self.stopping = False
        self.background: set[asyncio.Task[Any]] = set()
        self.stats: dict[str, float] = {name: 0 for name in STAT_NAMES}
        self.stats["backpressure_wait_s"] = 0.0
        self.backpressure = WaitStats()
        self.window = StageWindow(dict.fromkeys(p.stage for p in pools.values()))

    def by_stage(self) -> dict[str, list[StagePool]]:
        """The pools of each stage name served, one per distinct pool (heartbeat fields, `/metrics`)."""
        out: dict[str, list[StagePool]] = {}
        for pool in self.pools.values():
            group = out.setdefault(pool.stage, [])
            if all(p.core is not pool.core for p in group):
                group.append(pool)
        return out

    @property
    def draining(self) -> bool:
        return not self.undrained.is_set()

    def batcher_for(self, wf_id: str) -> Batcher:
        """The write connection of one workflow: its writes keep their order on it."""
        return self.batchers[hash(wf_id) % len(self.batchers)]

    # ------------------------------------------------------------ the sessions held
    def spawn(self, key: str, coro: Coroutine[Any, Any, None], session: Session | None = None,
              pool: StagePool | None = None, *, entry_id: str | None = None) -> None:
        """Run `coro` as the task of `key`, holding a slot of `pool` and the task entry `entry_id`."""
        task = asyncio.create_task(coro, name=key)
        self.sessions[key] = (session, task)
        if pool is not None:
            pool.core.active += 1
        if entry_id is not None:
            self.held.add(entry_id)
        task.add_done_callback(lambda _t: self._release(key, pool, entry_id))
        if session is not None and session.wf_id in self.aborted:
            # claimed before the abort, but the claim's reply was read after the abort's message (two
            # connections): the fan-out found nothing to cancel then, so it happens here -- once the
            # task has begun (callbacks run in order), so that it ends as an aborted session does
            session.abort()
            asyncio.get_running_loop().call_soon(task.cancel)

    def heard_abort(self, wf_id: str) -> None:
        """`wf_id` was aborted (the fan-out): a session of it spawned from now on is cancelled at once."""
        self.aborted[wf_id] = None
        if len(self.aborted) > ABORTS_KEPT:
            del self.aborted[next(iter(self.aborted))]

    def _release(self, key: str, pool: StagePool | None, entry_id: str | None = None) -> None:
        self.sessions.pop(key, None)
        if entry_id is not None:
            self.held.discard(entry_id)
        if pool is not None:
            pool.core.active -= 1
        self.slot_free.set()

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep a reference to a background task until it is done."""
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    # ------------------------------------------------------------ writes that must land
    def dead_letter(self, dlq_name: str, cell: int, stream: str, group: str, entry_id: str,
                    fields: dict[bytes, bytes] | None, reason: str) -> None:
        """Move a poison entry of `stream` (of `cell`) to that cell's dead-letter stream `dlq:<dlq_name>`
        with the reason (in the background, retried until Redis takes it: the entry stays where it is
        until then)."""
        self.stats["dead_letters"] += 1
        logger.warning("worker %s: dead-lettering entry %s of %s: %s", self.id, entry_id, stream, reason)
        call = dead_letter(self.keys.dlq(dlq_name, cell), stream, group, entry_id, fields, reason,
                           max_len=self.settings.dlq_max_len)
        self.spawn(f"dlq:{stream}:{entry_id}", self.write_until_done(call, f"dead-letter {entry_id}"),
                   entry_id=entry_id)

    async def write_until_done(self, call: tuple[Any, ...], what: str) -> None:
        """Send one command until Redis takes it (or refuses it for good, or the worker stops)."""
        backoff = Backoff()
        while True:
            try:
                await self.batcher.call(*call)
                return
            except RedisUnavailable as exc:
                if self.stopping:
                    return
                await backoff.wait(logger, f"worker {self.id}: {what}", exc)
            except RedisError as exc:
                logger.error("worker %s: %s failed: %s", self.id, what, exc)
                return
