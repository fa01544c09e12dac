"""Deadline-aware shedding: will a request meet its deadline, given what the stage queues hold now?

For each stage a request needs, the wait before its session starts is estimated as

    (tasks ahead of it) x (the stage's median session time over the last minute) / (its live slots)

where the tasks ahead are those not yet finished in the streams of its priority class and the classes
above it (lower classes give way to it: `omniflow.engine.worker.slots`). Stages fed by `chunk` edges
are submitted at admission and wait in parallel, so the prediction is the largest (wait + median
session time) over the stages. A stage with no live worker, or none that finished a session in the
last minute, adds nothing (it cannot be estimated; the deadline sweep still ends what is late).

The figures come from the same reads as `omniflow stats` (`omniflow.ops.fleet`), made at most every
`REFRESH_S` per process and only for pipelines whose YAML turns shedding on.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omniflow.engine.window import merge, percentile
from omniflow.models import Priority

if TYPE_CHECKING:
    from omniflow.client.store import Store

REFRESH_S = 0.5


@dataclass
class StageLoad:
    """What one stage's queues and workers say now."""

    ahead: dict[str, int] = field(default_factory=dict)     # priority class -> tasks queued or held in it
    slots: int = 0                                          # live workers' max_sessions, added up
    session_s: float | None = None                          # median session time, last minute

    def wait_s(self, priority: Priority) -> float:
        if not self.slots or self.session_s is None:
            return 0.0
        ahead = sum(n for cls, n in self.ahead.items() if Priority(cls).rank <= priority.rank)
        return ahead * self.session_s / self.slots


class Predictor:
    """One process's view of the stage loads, re-read at most every `REFRESH_S`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.loads: dict[str, StageLoad] = {}
        self._at = -REFRESH_S
        self._lock = asyncio.Lock()

    async def refresh(self, *, force: bool = False) -> None:
        from omniflow.ops import fleet

        async with self._lock:
            if not force and time.monotonic() - self._at < REFRESH_S:
                return
            queues = await fleet.read_queues(self.store)
            workers = [w for w in await fleet.list_workers(self.store) if w["alive"]]
            loads: dict[str, StageLoad] = {}
            for name, rows in queues.stages.items():
                load = loads[name] = StageLoad()
                for row in rows:
                    load.ahead[row.priority] = load.ahead.get(row.priority, 0) + (row.lag or 0) + row.pending
                mine = [w for w in workers if name in w["stages"]]
                load.slots = sum(w["capacity"].get(name, 0) for w in mine)
                load.session_s = percentile(merge(w["window"].get(name, {}) for w in mine)["hist"], 50)
            self.loads, self._at = loads, time.monotonic()

    def predict_s(self, stages: tuple[str, ...], priority: Priority) -> float:
        """Seconds until a request of `priority` needing `stages` has its outputs (an estimate)."""
        worst = 0.0
        for name in stages:
            load = self.loads.get(name)
            if load is not None:
                worst = max(worst, load.wait_s(priority) + (load.session_s or 0.0))
        return worst

    def explain(self, stages: tuple[str, ...], priority: Priority) -> dict[str, Any]:
        return {name: {"wait_s": round(self.loads[name].wait_s(priority), 3),
                       "session_s": self.loads[name].session_s, "slots": self.loads[name].slots}
                for name in stages if name in self.loads}
