"""A stage's session slots (`max_sessions`), handed out by priority class and tenant.

When a slot frees and sessions wait for one, the next is chosen by smooth weighted round robin over
the priority classes that have one waiting (`OMNIFLOW_PRIORITY_WEIGHTS`: a higher class gets most
slots, a lower one its weight's share, so it never starves), then over the tenants waiting in that
class (their fair-share weights), then first come first served. A session of a lower class gives its
slot way at its next chunk (`yield_to_higher`) while a higher class waits, and queues for it again.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from omniflow.fairness import WeightedPicker
from omniflow.models import PRIORITY_ORDER, Priority


class Slots:
    """`n` slots; `async with slots.held(priority, tenant):` runs with one."""

    def __init__(self, n: int, *, class_weights: Mapping[Priority, float] | None = None,
                 tenant_weights: Mapping[str, float] | None = None) -> None:
        self.n = n
        self.free = n
        self._waiting: dict[Priority, dict[str, deque[asyncio.Future[None]]]] = {p: {} for p in PRIORITY_ORDER}
        self._count = [0] * len(PRIORITY_ORDER)         # waiters per class rank
        self._classes: WeightedPicker[Priority] = WeightedPicker(
            class_weights or {p: 1.0 for p in PRIORITY_ORDER})
        self._tenants = {p: WeightedPicker(tenant_weights if tenant_weights is not None else {}) for p in PRIORITY_ORDER}
        self.yields = 0

    @property
    def waiting(self) -> int:
        return sum(self._count)

    def higher_waiting(self, priority: Priority) -> bool:
        """Whether a session of a class above `priority` waits for a slot (cheap: read from any thread)."""
        return any(self._count[:priority.rank])

    async def acquire(self, priority: Priority = Priority.API, tenant: str = "", *, first: bool = False) -> None:
        """Wait for a slot in `priority`'s and `tenant`'s turn (`first`: ahead of the others of its
        class and tenant, for a session that gave its slot way mid-stream)."""
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting[priority].setdefault(tenant, deque())
        if first:
            queue.appendleft(fut)
        else:
            queue.append(fut)
        self._count[priority.rank] += 1
        self._grant()       # a free slot and only this waiter (the free ones went to nobody)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()          # granted as we were cancelled: pass it on
            else:
                self._forget(priority, tenant, fut)
            raise

    def release(self) -> None:
        self.free += 1
        self._grant()

    def _grant(self) -> None:
        while self.free > 0 and self.waiting:
            classes = [p for p in PRIORITY_ORDER if self._count[p.rank]]
            prio = self._classes.pick(classes)
            queues = self._waiting[prio]
            tenant = self._tenants[prio].pick([t for t, q in queues.items() if q])
            fut = queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
            self._count[prio.rank] -= 1
            self.free -= 1
            fut.set_result(None)

    def _forget(self, priority: Priority, tenant: str, fut: asyncio.Future[None]) -> None:
        queue = self._waiting[priority].get(tenant)
        if queue is not None and fut in queue:
            queue.remove(fut)
            self._count[priority.rank] -= 1
            if not queue:
                del self._waiting[priority][tenant]

    @asynccontextmanager
    async def held(self, priority: Priority = Priority.API, tenant: str = "") -> AsyncIterator[None]:
        await self.acquire(priority, tenant)
        try:
            yield
        finally:
            self.release()

    async def yield_to_higher(self, priority: Priority, tenant: str = "") -> bool:
        """Called by a session holding a slot at a chunk boundary: if a higher class waits, give the
        slot to it and queue for one again, in `priority`'s turn but ahead of the sessions of its class
        that have not started (it holds its downstream sessions' slots, waiting for its chunks).
        Returns whether it gave way."""
        if not self.higher_waiting(priority):
            return False
        self.yields += 1
        self.release()
        try:
            await self.acquire(priority, tenant, first=True)
        except asyncio.CancelledError:
            self.free -= 1      # not held again: the holder's release at its end must not add a slot
            raise
        return True
