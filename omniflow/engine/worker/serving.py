"""What a worker publishes about its serving with each heartbeat (field `serving` of its info hash),
per stage it serves: the step loop's batch sizes (batched executors) and the chunk payloads its
producers sent by transport. All of it is counted in memory where it happens (no Redis command);
the counters only grow over the worker's life, and `/metrics` turns each worker's growth into its
own counters (`omniflow.api.serving`)."""
from __future__ import annotations

from typing import Any

from omniflow.engine.worker.context import WorkerContext
from omniflow.executor import BatchedExecutor


def serving_snapshot(ctx: WorkerContext) -> dict[str, dict[str, Any]]:
    """stage -> {"batch": {steps, sessions, hist} (batched executors only), "dataplane": {transport:
    [chunks, bytes]}} (JSON-ready)."""
    traffic = ctx.plane.traffic.snapshot()
    out: dict[str, dict[str, Any]] = {}
    for name, group in ctx.by_stage().items():
        entry: dict[str, Any] = {"dataplane": traffic.get(name, {})}
        for pool in group:
            executor = pool.executor
            if isinstance(executor, BatchedExecutor) and executor.step_loop is not None:
                entry["batch"] = executor.step_loop.stats.snapshot()
        out[name] = entry
    return out
