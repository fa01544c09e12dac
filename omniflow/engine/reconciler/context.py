"""What the parts of a reconciler share: identity, settings, the pipeline, connections, counters."""
from __future__ import annotations

import asyncio
import os
import random
import uuid

from omniflow.storage.client import RedisClient

from omniflow.config import Settings
from omniflow.dataplane import DataPlane
from omniflow.pipeline import Pipeline
from omniflow.storage.keys import Keys, finalize_plan

#: what a reconciler counts (`omniflow stats`, tests)
COUNT_NAMES = ("events", "completed", "failed", "retry", "ignored", "lost", "deadline", "dead_letters",
               "segments_swept")


class ReconcilerContext:
    """The shared state of one reconciler process."""

    def __init__(self, *, settings: Settings, pipeline: Pipeline, redis_url: str,
                 reconciler_id: str | None = None) -> None:
        self.settings = settings
        self.pipeline = pipeline
        # the layout (how many cells) is known once connected (`Reconciler._setup`)
        self.keys = Keys(settings.prefix, settings.cells or 1)
        self.redis_url = redis_url
        self.id = reconciler_id or f"rec-{settings.host_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.rng = random.Random()
        self.started = asyncio.Event()
        self.redis_ok_at = 0.0          # monotonic time of the last event read that Redis answered
        self.finalize_plan = finalize_plan(pipeline)
        self.counts: dict[str, int] = dict.fromkeys(COUNT_NAMES, 0)
        # connections, made by `Reconciler._setup`
        self.redis: RedisClient
        self.blocking: RedisClient
        self.plane: DataPlane
