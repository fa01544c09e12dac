"""One stage served by a worker: its executor, its session slots, its task streams."""
from __future__ import annotations

import os
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from omniflow.engine.compute import ComputeThread
from omniflow.engine.worker.slots import Slots
from omniflow.errors import PipelineError
from omniflow.models import PRIORITY_ORDER, Priority
from omniflow.pipeline import EdgeMode, Pipeline, import_executor
from omniflow.storage.keys import Keys
from omniflow.executor import Executor

T = TypeVar("T")


def new_worker_id(stage: str, host_id: str) -> str:
    return f"{stage}-{host_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class StagePool:
    """One stage served by a worker: its executor, its session slots, its task stream."""

    def __init__(self, pipeline: Pipeline, stage: str, *, executor: Executor | None,
                 max_sessions: int | None, class_weights: Mapping[Priority, float] | None = None,
                 tenant_weights: Mapping[str, float] | None = None) -> None:
        self.stage = stage
        self.spec = pipeline.stages[stage]
        self.tasks_keys: dict[int, str] = {}      # cell -> the stage's task stream there (class api; see `bind`)
        self.class_streams: dict[int, tuple[str, ...]] = {}   # cell -> its streams, highest class first
        self.upstream = tuple(e.src for e in pipeline.inputs[stage])
        # downstream stages that run while we produce (backpressure applies to these edges only)
        self.chunk_dsts = frozenset(e.dst for e in pipeline.outputs[stage] if e.mode is EdgeMode.CHUNK)
        self.max_sessions = max_sessions or self.spec.max_sessions
        self.executor = executor or import_executor(self.spec.executor)(stage=stage, params=self.spec.params)
        # At most max_sessions run the executor at once (the GPU's batch slots); up to `prefetch` more
        # are claimed and wait for a slot, so a freed slot starts the next session without a round trip.
        prefetch = self.spec.prefetch if self.spec.prefetch is not None else max(1, self.max_sessions // 4)
        self.capacity = self.max_sessions + prefetch
        self.slots = Slots(self.max_sessions, class_weights=class_weights, tenant_weights=tenant_weights)
        self.active = 0             # sessions held (running or waiting for a slot)
        self.claiming = 0           # tasks read but not yet claimed (they hold session slots too)
        self.compute: ComputeThread | None = None    # where the executor runs (runs_on == "thread")

    def bind(self, keys: Keys) -> None:
        """Learn the task stream of every cell (once the deployment's layout is known)."""
        self.tasks_keys = {cell: keys.tasks(self.stage, cell) for cell in keys.all_cells}
        self.class_streams = {cell: tuple(keys.tasks(self.stage, cell, p.value) for p in PRIORITY_ORDER)
                              for cell in keys.all_cells}

    def stream(self, cell: int, priority: Priority) -> str:
        """The stage's task stream of `priority` in `cell`."""
        return self.class_streams[cell][priority.rank]

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
