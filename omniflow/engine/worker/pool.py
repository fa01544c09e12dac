"""One stage served by a worker: its executor, its session slots, its task streams."""
from __future__ import annotations

import os
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from omniflow.engine.compute import ComputeThread
from omniflow.engine.placement import Placement
from omniflow.engine.worker.slots import Slots
from omniflow.errors import PipelineError
from omniflow.models import PRIORITY_ORDER, Priority
from omniflow.pipeline import EdgeMode, Pipeline, StageSpec, import_executor, pool_key
from omniflow.storage.keys import Keys
from omniflow.executor import BatchedExecutor, Executor

T = TypeVar("T")


def new_worker_id(stage: str, host_id: str) -> str:
    return f"{stage}-{host_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class PoolCore:
    """What the stages of one pool share: one executor (built from the first stage declared), its
    compute thread and its session slots. Stages two pipelines declare identically (same pool key:
    `Pipeline.pool_key`) are one pool, so one model in one process serves them all."""

    def __init__(self, stage: str, spec: StageSpec, *, executor: Executor | None, max_sessions: int | None,
                 class_weights: Mapping[Priority, float] | None = None,
                 tenant_weights: Mapping[str, float] | None = None, live_window_s: float = 2.0) -> None:
        self.key = pool_key(spec)
        self.max_sessions = max_sessions or spec.max_sessions
        self.executor = executor or import_executor(spec.executor)(stage=stage, params=spec.params)
        self.class_weights = class_weights
        self.tenant_weights = tenant_weights
        self.live_window_s = live_window_s
        # At most max_sessions run the executor at once (the GPU's batch slots); up to `prefetch` more
        # are claimed and wait for a slot, so a freed slot starts the next session without a round trip.
        self.prefetch_base = self.prefetch_deep = 0
        self.deep = False           # the last read found a backlog (see `saw_read`)
        self.set_prefetch(spec)
        self.slots = self.new_slots(spec)
        self.active = 0             # sessions held (running or waiting for a slot)
        self.claiming = 0           # tasks read but not yet claimed (they hold session slots too)
        self.compute: ComputeThread | None = None    # the executor's thread (runs_on "auto" or "thread")
        try:
            self.placement = Placement(stage, self.executor.runs_on)
        except ValueError as exc:
            raise PipelineError(f"{spec.executor}: {exc}") from None
        self.batched = isinstance(self.executor, BatchedExecutor)
        if self.batched:
            self.placement.pin_thread()     # its step loop is its own scheduler, on the thread
        self.routes = 0             # stages (of pipelines and versions) this pool serves
        self.stage = stage

    def set_prefetch(self, spec: StageSpec) -> None:
        """Take the prefetch `spec` asks for, keeping the larger of it and what the pool has
        (`build_pools` passes the first stage of the pool, and a sharing stage that raises its
        `max_sessions`); unset, it adapts to the queue (`saw_read`): a quarter of `max_sessions`
        (at least 1) while reads drain it, a whole batch while it holds a backlog."""
        if spec.prefetch is not None:
            base = deep = spec.prefetch
        else:
            base = max(1, self.max_sessions // 4)
            deep = max(base, self.max_sessions)
        self.prefetch_base, self.prefetch_deep = max(self.prefetch_base, base), max(self.prefetch_deep, deep)

    @property
    def capacity(self) -> int:
        """Sessions it holds at most: its slots, and the prefetch of the queue's state (`saw_read`)."""
        return self.max_sessions + (self.prefetch_deep if self.deep else self.prefetch_base)

    def saw_read(self, asked: int, got: int) -> None:
        """What a read of this pool's streams delivered (`got` of the `asked` COUNT, most of any one
        stream). A full read of more than one means tasks waited in the queue while no reader was
        blocked on it (a blocked reader takes each task as it comes): a backlog. Then the next batch
        is claimed ahead (`prefetch_deep`), so slots that free up together (a GPU's decode batch
        ending) start again at once instead of one read and claim later (bench/notes.md, round 12:
        simulated GPU at 16 replicas 72-78 % -> 91-93 %). A read that comes back short: the queue ran
        dry, and a replica holds no more than `prefetch_base` beyond its slots, leaving the rest to
        the others."""
        if got < asked:
            self.deep = False
        elif asked > 1:             # (one asked and one delivered says nothing: a blocked read gets one)
            self.deep = True

    def new_slots(self, spec: StageSpec) -> Slots:
        """`max_sessions` slots, of which `reserved_slots` (default one in eight) are kept for live
        traffic while it is about (`Slots`)."""
        n = self.max_sessions
        reserve = spec.reserved_slots if spec.reserved_slots is not None else n // 8
        return Slots(n, class_weights=self.class_weights, tenant_weights=self.tenant_weights,
                     reserve=min(reserve, n - 1), window_s=self.live_window_s)


class StagePool:
    """One stage of one pipeline version served by a worker: its task streams (the stage's queue,
    `Pipeline.queue`), its place in the DAG, and the pool (`PoolCore`: executor and slots) that runs it."""

    def __init__(self, pipeline: Pipeline, stage: str, *, executor: Executor | None = None,
                 max_sessions: int | None = None, core: PoolCore | None = None) -> None:
        self.stage = stage
        self.pipeline = pipeline
        self.queue = pipeline.queue(stage)
        self.spec = pipeline.stages[stage]
        self.tasks_keys: dict[int, str] = {}      # cell -> the queue's task stream there (class api; see `bind`)
        self.class_streams: dict[int, tuple[str, ...]] = {}   # cell -> its streams, highest class first
        self.upstream = pipeline.sources(stage)     # `@input` too for the stage that takes audio
        # downstream stages that run while we produce (backpressure applies to these edges only)
        self.chunk_dsts = frozenset(e.dst for e in pipeline.outputs[stage] if e.mode is EdgeMode.CHUNK)
        self.core = core or PoolCore(stage, self.spec, executor=executor, max_sessions=max_sessions)
        self.core.routes += 1

    # the pool's shared parts
    @property
    def executor(self) -> Executor:
        return self.core.executor

    @property
    def max_sessions(self) -> int:
        return self.core.max_sessions

    @property
    def capacity(self) -> int:
        return self.core.capacity

    @property
    def slots(self) -> Slots:
        return self.core.slots

    @property
    def compute(self) -> ComputeThread | None:
        return self.core.compute

    @property
    def active(self) -> int:
        return self.core.active

    def bind(self, keys: Keys) -> None:
        """Learn the task stream of every cell (once the deployment's layout is known)."""
        self.tasks_keys = {cell: keys.tasks(self.queue, cell) for cell in keys.all_cells}
        self.class_streams = {cell: tuple(keys.tasks(self.queue, cell, p.value) for p in PRIORITY_ORDER)
                              for cell in keys.all_cells}

    def stream(self, cell: int, priority: Priority) -> str:
        """The queue's task stream of `priority` in `cell`."""
        return self.class_streams[cell][priority.rank]

    def start_compute(self) -> None:
        if self.core.placement.needs_thread and self.core.compute is None:
            self.core.compute = ComputeThread(self.stage)

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `setup` or `close` where they run: the compute thread (unless `runs_on = "loop"`)."""
        if self.core.compute is None:
            return await coro
        return await self.core.compute.run(coro)

    async def close_executor(self) -> None:
        try:
            await self.call(self.executor.close())
        finally:
            if self.core.compute is not None:
                self.core.compute.stop()
                self.core.compute = None

    @property
    def free(self) -> int:
        core = self.core        # (asked per delivery: the core's attributes, not this pool's properties)
        return core.capacity - core.active - core.claiming


def build_pools(routes: Sequence[tuple[Pipeline, str]], *, executor: Executor | None = None,
                max_sessions: int | None = None, class_weights: Mapping[Priority, float] | None = None,
                tenant_weights: Mapping[str, float] | None = None,
                live_window_s: float = 2.0) -> dict[str, StagePool]:
    """The `StagePool` of every (pipeline, stage) a worker serves, by queue; stages with one pool key
    share one `PoolCore` (one executor). Its capacity is the largest any of them declares."""
    cores: dict[str, PoolCore] = {}
    pools: dict[str, StagePool] = {}
    for pipe, stage in routes:
        spec = pipe.stages[stage]
        key = pool_key(spec)
        core = cores.get(key)
        if core is None:
            core = cores[key] = PoolCore(stage, spec, executor=executor, max_sessions=max_sessions,
                                         class_weights=class_weights, tenant_weights=tenant_weights,
                                         live_window_s=live_window_s)
        elif max_sessions is None and spec.max_sessions > core.max_sessions:
            core.max_sessions = spec.max_sessions
            core.set_prefetch(spec)
            core.slots = core.new_slots(spec)
        pools[pipe.queue(stage)] = StagePool(pipe, stage, core=core)
    return pools


def unique_cores(pools: dict[str, StagePool]) -> list[StagePool]:
    """One `StagePool` per pool (what sets up and closes each executor once)."""
    seen: dict[int, StagePool] = {}
    for pool in pools.values():
        seen.setdefault(id(pool.core), pool)
    return list(seen.values())


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
