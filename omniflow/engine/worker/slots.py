"""A stage's session slots (`max_sessions`), handed out by priority class and tenant.

When a slot frees and sessions wait for one, the next is chosen by smooth weighted round robin over
the priority classes that have one waiting (`OMNIFLOW_PRIORITY_WEIGHTS`: a higher class gets most
slots, a lower one its weight's share, so it never starves), then, within the class, the waiting
tenant that holds the fewest of this stage's slots for its weight (ties in weighted turn), then first
come first served. A running session gives its slot way at its next chunk (`give_way`) while a higher
class waits, or while a tenant of its own class waits that holds fewer slots for its weight than its
own tenant would after giving one up; it queues again ahead of the sessions that have not started.

Headroom (`reserve`, the stage's `reserved_slots`): while live traffic is about, the last `reserve`
free slots are kept for it, so a live request starts at once instead of waiting for a running
session's next chunk. A session may take one of them only if no session of a higher class, and no
tenant of its own class that would hold fewer slots for its weight, asked this stage for a slot in
the last `window_s`; when nobody else has asked for that long, a lower class or a flooding tenant
borrows the whole stage (a timer hands the kept slots on as the window closes).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from types import TracebackType

from omniflow.fairness import DEFAULT_WEIGHT, WeightedPicker
from omniflow.models import PRIORITY_ORDER, Priority


class Slots:
    """`n` slots; `async with slots.held(priority, tenant):` runs with one."""

    def __init__(self, n: int, *, class_weights: Mapping[Priority, float] | None = None,
                 tenant_weights: Mapping[str, float] | None = None, reserve: int = 0,
                 window_s: float = 2.0) -> None:
        if not 0 <= reserve < max(n, 1):
            raise ValueError(f"reserved slots must be from 0 to {n - 1} (of {n}), got {reserve}")
        self.n = n
        self.free = n
        self.reserve = reserve
        self.window_s = window_s
        # when each class (by rank) and each (class rank, tenant) last asked for a slot (monotonic s)
        self._asked = [float("-inf")] * len(PRIORITY_ORDER)
        self._asked_by: dict[tuple[int, str], float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._waiting: dict[Priority, dict[str, deque[asyncio.Future[None]]]] = {p: {} for p in PRIORITY_ORDER}
        self._count = [0] * len(PRIORITY_ORDER)         # waiters per class rank
        self._classes: WeightedPicker[Priority] = WeightedPicker(
            class_weights or {p: 1.0 for p in PRIORITY_ORDER})
        self.tenant_weights: Mapping[str, float] = tenant_weights if tenant_weights is not None else {}
        self._tenants = {p: WeightedPicker(self.tenant_weights) for p in PRIORITY_ORDER}
        self.holding: dict[str, int] = {}               # tenant -> slots it holds now
        self.yields = 0

    @property
    def waiting(self) -> int:
        return sum(self._count)

    def higher_waiting(self, priority: Priority) -> bool:
        """Whether a session of a class above `priority` waits for a slot (cheap: read from any thread)."""
        return any(self._count[:priority.rank])

    def _load(self, tenant: str, extra: int = 0) -> float:
        return (self.holding.get(tenant, 0) + extra) / self.tenant_weights.get(tenant, DEFAULT_WEIGHT)

    def should_give_way(self, priority: Priority, tenant: str) -> bool:
        """Whether a session of (`priority`, `tenant`) holding a slot should hand it on now: a higher
        class waits, or a tenant of its class waits that would still hold less than it after the swap."""
        if not any(self._count):        # nobody waits (the common case: asked at every chunk)
            return False
        if any(self._count[:priority.rank]):
            return True
        queues = self._waiting[priority]
        if not queues or (len(queues) == 1 and tenant in queues):
            return False
        mine = self._load(tenant)
        return any(self._load(other, 1) < mine for other, queue in list(queues.items()) if other != tenant and queue)

    def _note(self, priority: Priority, tenant: str, now: float) -> None:
        if not self.reserve:
            return
        self._asked[priority.rank] = now
        self._asked_by[(priority.rank, tenant)] = now
        if len(self._asked_by) > 4 * self.n + 64:      # forget the tenants that went quiet
            self._asked_by = {k: t for k, t in self._asked_by.items() if now - t < self.window_s}

    def _kept_from(self, priority: Priority, tenant: str, now: float) -> float:
        """0.0 if (`priority`, `tenant`) may take a kept slot now; else when it may (monotonic s)."""
        until = 0.0
        horizon = now - self.window_s
        for rank in range(priority.rank):
            if self._asked[rank] > horizon:
                until = max(until, self._asked[rank] + self.window_s)
        mine = self._load(tenant, 1)
        for (rank, other), at in list(self._asked_by.items()):
            if rank == priority.rank and other != tenant and at > horizon and self._load(other, 1) < mine:
                until = max(until, at + self.window_s)
        return until

    def _may_take(self, priority: Priority, tenant: str, now: float) -> bool:
        return self.free > self.reserve or not self._kept_from(priority, tenant, now)

    async def acquire(self, priority: Priority = Priority.API, tenant: str = "", *, first: bool = False) -> None:
        """Wait for a slot in `priority`'s and `tenant`'s turn (`first`: ahead of the others of its
        class and tenant, for a session that gave its slot way mid-stream)."""
        now = time.monotonic() if self.reserve else 0.0
        self._note(priority, tenant, now)
        if self.free > 0 and not any(self._count) and (not self.reserve or self._may_take(priority, tenant, now)):
            self.free -= 1
            self.holding[tenant] = self.holding.get(tenant, 0) + 1
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
                self.release(tenant)    # granted as we were cancelled: pass it on
            else:
                self._forget(priority, tenant, fut)
            raise

    def release(self, tenant: str = "") -> None:
        left = self.holding.get(tenant, 0) - 1
        if left > 0:
            self.holding[tenant] = left
        else:
            self.holding.pop(tenant, None)
        self.free += 1
        self._grant()

    def _grant(self) -> None:
        now = time.monotonic() if self.reserve else 0.0
        while self.free > 0 and any(self._count):
            if self.reserve and self.free <= self.reserve:
                # a kept slot goes to the most deserving waiter (the highest class, its least loaded
                # tenant), and only if nobody more deserving than it asked in the window
                prio = next(p for p in PRIORITY_ORDER if self._count[p.rank])
                queues = self._waiting[prio]
                tenant = min((t for t, q in queues.items() if q), key=lambda t: self._load(t, 1))
                until = self._kept_from(prio, tenant, now)
                if until:
                    self._wake_at(until - now)
                    return
            else:
                prio = self._classes.pick([p for p in PRIORITY_ORDER if self._count[p.rank]])
                queues = self._waiting[prio]
                tenants = [t for t, q in queues.items() if q]
                least = min(self._load(t, 1) for t in tenants)
                tenant = self._tenants[prio].pick([t for t in tenants if self._load(t, 1) == least])
            fut = queues[tenant].popleft()
            if not queues[tenant]:
                del queues[tenant]
            self._count[prio.rank] -= 1
            self.free -= 1
            self.holding[tenant] = self.holding.get(tenant, 0) + 1
            fut.set_result(None)

    def _wake_at(self, delay_s: float) -> None:
        """Hand the kept slots on when the window closes (if nobody more deserving asks meanwhile)."""
        if self._timer is not None and not self._timer.cancelled():
            self._timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:        # released outside a loop (a test): the next acquire or release grants
            return
        self._timer = loop.call_later(max(delay_s, 0.001), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._grant()

    def _forget(self, priority: Priority, tenant: str, fut: asyncio.Future[None]) -> None:
        queue = self._waiting[priority].get(tenant)
        if queue is not None and fut in queue:
            queue.remove(fut)
            self._count[priority.rank] -= 1
            if not queue:
                del self._waiting[priority][tenant]

    def held(self, priority: Priority = Priority.API, tenant: str = "") -> _Held:
        """`async with slots.held(priority, tenant):` runs with a slot, released however it ends."""
        return _Held(self, priority, tenant)

    async def give_way(self, priority: Priority, tenant: str = "") -> bool:
        """Called by a session holding a slot at a chunk boundary: if it should (`should_give_way`),
        hand the slot on and queue for one again, in its class's turn but ahead of the sessions of
        its class and tenant that have not started (it holds its downstream sessions' slots, waiting
        for its chunks). Returns whether it gave way."""
        if not self.should_give_way(priority, tenant):
            return False
        self.yields += 1
        self.release(tenant)
        try:
            await self.acquire(priority, tenant, first=True)
        except asyncio.CancelledError:
            # not held again: the holder's release at its end must not add a slot
            self.free -= 1
            self.holding[tenant] = self.holding.get(tenant, 0) + 1
            raise
        return True


class _Held:
    """`Slots.held`: a slot for the body of an `async with` (a class, not `asynccontextmanager`: it is
    entered once per session, and the generator's machinery was ~6 Python calls of it)."""

    __slots__ = ("_priority", "_slots", "_tenant")

    def __init__(self, slots: Slots, priority: Priority, tenant: str) -> None:
        self._slots, self._priority, self._tenant = slots, priority, tenant

    async def __aenter__(self) -> None:
        await self._slots.acquire(self._priority, self._tenant)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._slots.release(self._tenant)
