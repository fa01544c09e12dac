"""What the parts of a reconciler share: identity, settings, the pipeline, connections, counters."""
from __future__ import annotations

import asyncio
import os
import random
import uuid

from omniflow.storage.client import RedisClient

from omniflow.config import Settings
from omniflow.dataplane import DataPlane
from omniflow.catalog import Catalog
from omniflow.pipeline import Pipeline
from omniflow.storage import registry
from omniflow.storage.keys import Keys, finalize_plan

#: what a reconciler counts (`omniflow stats`, tests)
COUNT_NAMES = ("events", "completed", "failed", "retry", "ignored", "lost", "deadline", "dead_letters",
               "segments_swept")


class ReconcilerContext:
    """The shared state of one reconciler process."""

    def __init__(self, *, settings: Settings, pipeline: Pipeline | Catalog, redis_url: str,
                 reconciler_id: str | None = None) -> None:
        self.settings = settings
        # every pipeline version it has met: its own, and those other processes registered
        self.catalog = pipeline if isinstance(pipeline, Catalog) else Catalog.of(pipeline)
        self.pipeline = self.catalog.default
        # the layout (how many cells) is known once connected (`Reconciler._setup`)
        self.keys = Keys(settings.prefix, settings.cells or 1)
        self.redis_url = redis_url
        self.id = reconciler_id or f"rec-{settings.host_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.rng = random.Random()
        self.started = asyncio.Event()
        self.redis_ok_at = 0.0          # monotonic time of the last event read that Redis answered
        self.finalize_plan = finalize_plan(self.pipeline)
        self.counts: dict[str, int] = dict.fromkeys(COUNT_NAMES, 0)
        # connections, made by `Reconciler._setup`
        self.redis: RedisClient
        self.blocking: RedisClient
        self.plane: DataPlane

    def pipeline_of(self, version: str) -> Pipeline | None:
        """The pipeline version a workflow records ('': the default); None while it is unknown here
        (`learn` fetches it from the registry)."""
        return self.catalog.version(version) if version else self.pipeline

    async def learn(self, versions: set[str]) -> None:
        """Fetch the definitions of versions not met yet from the registry (a pipeline added to the
        running deployment by a new worker); one that is not registered stays unknown."""
        for version in versions:
            if version and self.catalog.version(version) is None:
                found = await registry.fetch(self.redis, self.keys, version)
                if found is not None:
                    self.catalog.add(found, serve_name=False)
