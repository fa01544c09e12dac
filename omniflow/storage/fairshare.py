"""Per-tenant fair share as Redis holds it: the weights (config, overridden live in one hash) and
the live workflows of each tenant, counted per cell by the transitions and added up here.

Each cell counts its tenants' live workflows in `<c>:tinf` (`submit.lua` adds one, `finalize` in
`_lib.lua` takes it away, in the same atomic steps as the workflow's own). A submit checks its
tenant's count *in its cell* inside `submit.lua`; the share it is checked against is the tenant's
share of the whole deployment less what the tenant holds in the other cells, from a view of every
cell's counts that each process re-reads every `fair_refresh_ms`. So on a cluster fair share is the
deployment's, not each cell's: a tenant whose workflows sit in other cells has less room in this
one. (On a single server there is one cell and the check is exact.) The weights live on one slot,
`of:{fair}:weights`, so a change is seen by every process within one refresh.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.config import Settings
from omniflow.fairness import DEFAULT_WEIGHT, check_tenant, check_weight, parse_weights, tenant_share
from omniflow.storage import cells as cells_mod
from omniflow.storage.keys import Keys
from omniflow.storage.schema import now_ms, s

MAX_WAITING = 10_000
MAX_DERIVED = 4096

logger = logging.getLogger(__name__)


class FairShare:
    """One process's view of the weights and of every cell's live count per tenant."""

    def __init__(self, redis: RedisClient, settings: Settings, keys: Keys) -> None:
        self.redis = redis
        self.settings = settings
        self.keys = keys
        self.configured = parse_weights(settings.tenant_weights)
        self.weights: dict[str, float] = dict(self.configured)
        self.counts: list[dict[str, int]] = [{} for _ in keys.all_cells]    # per cell: tenant -> live
        self.waiting: set[str] = set()          # tenants active or refused lately (they want a share too)
        self._derived: dict[Any, Any] = {}      # what the submits compute from the view, until it changes
        self._at = -math.inf
        self.must_refresh = False           # a cell is past the line: re-read before the next submit
        self._background: asyncio.Task[None] | None = None
        self._shared: asyncio.Task[None] | None = None      # the re-read the busy submits share
        self._held: dict[str, tuple[float, str]] = {}      # tenant refused as over its share -> (until, why)

    @property
    def never_read(self) -> bool:
        return self._at == -math.inf

    @property
    def stale(self) -> bool:
        return time.monotonic() - self._at > self.settings.fair_refresh_ms / 1000

    def refresh_soon(self) -> None:
        """Re-read in the background (the submit goes on with the view it has: a refresh of the
        weights and the shares lags by one read, and the happy path waits for nothing)."""
        if self._background is None or self._background.done():
            self._background = asyncio.get_running_loop().create_task(self._refresh_quietly())

    async def refresh_shared(self) -> None:
        """`refresh`, joined by every submit that needs one while it runs (a busy deployment, many
        submits at once: one read of the view, not one each)."""
        if self._shared is None or self._shared.done():
            self._shared = asyncio.get_running_loop().create_task(self.refresh())
        await asyncio.shield(self._shared)

    def hold(self, tenant: str, why: str) -> None:
        """`tenant` was just refused as over its fair share: refuse its next submits here, without a
        round trip, for `fair_hold_ms` (a flood's retries cost the server nothing; the tenant loses at
        most the room that frees in that time)."""
        hold_s = self.settings.fair_hold_ms / 1000
        if hold_s > 0:
            if len(self._held) >= MAX_DERIVED:
                now = time.monotonic()
                self._held = {t: h for t, h in self._held.items() if h[0] > now}
            self._held[tenant] = (time.monotonic() + hold_s, why)

    def held(self, tenant: str) -> str | None:
        """Why `tenant`'s submit is refused here without asking the server (None: ask it)."""
        found = self._held.get(tenant)
        if found is None:
            return None
        if found[0] <= time.monotonic():
            del self._held[tenant]
            return None
        return found[1]

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh()
        except Exception as exc:  # noqa: BLE001 - a failed background read is retried on the next submit
            logger.debug("re-reading the fair-share view failed: %s", exc)

    async def refresh(self) -> None:
        """Re-read the live weights and every cell's counts (one pipeline). Concurrent reads each
        run; the view keeps the one that started last, so it is never older than the last call."""
        started = time.monotonic()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.fair_weights)
        pipe.zrangebyscore(self.keys.fair_waiting, now_ms() - int(self.settings.fair_waiting_s * 1000), "+inf",
                           start=0, num=MAX_WAITING)
        for cell in self.keys.all_cells:
            pipe.hgetall(self.keys.tenant_inflight(cell))
            pipe.hgetall(self.keys.tenant_seen(cell))
        replies = await pipe.execute()
        if started < self._at:
            return          # a read that started later was applied meanwhile
        self.weights = {**self.configured, **decode_weights(replies[0])}
        since = now_ms() - int(self.settings.fair_waiting_s * 1000)
        seen = {s(t) for r in replies[3::2] for t, ms in (r or {}).items() if int(ms) >= since}
        self.waiting = {s(t) for t in replies[1] or []} | seen
        self.counts = [{s(k): int(v) for k, v in (r or {}).items()} for r in replies[2::2]]
        self._derived.clear()
        self._held.clear()          # what the view says now decides (a tenant's workflows may have ended)
        self._at = started
        self.must_refresh = False

    def invalidate(self) -> None:
        """Re-read before the next submit (the cell is busy: shares are being enforced)."""
        self.must_refresh = True

    def admitted(self, cell: int, in_flight: int) -> None:
        """A submit into `cell` was admitted, leaving `in_flight` there: once that is where shares are
        enforced, every submit re-reads the view first (a busy deployment only: the happy path keeps
        its one round trip)."""
        if self.settings.fair_share and in_flight >= self._from(cell):
            self.invalidate()

    def _from(self, cell: int) -> int:
        """The in-flight count of `cell` from which shares are enforced."""
        limit = cells_mod.cell_limit(self.settings.max_in_flight, self.keys.cells, cell)
        return math.floor(limit * self.settings.fair_share_from)

    def _active(self) -> frozenset[str]:
        found = self._derived.get("active")
        if found is None:
            found = self._derived["active"] = frozenset(self.active())
        return found

    def active(self) -> set[str]:
        """The tenants sharing the deployment: those holding live workflows, and those whose last one
        ended, or that were refused, within `fair_waiting_s` (a tenant between two requests keeps its
        share)."""
        return {t for counts in self.counts for t, n in counts.items() if n > 0} | self.waiting

    async def refused(self, tenant: str) -> None:
        """A submit of `tenant` was refused as busy: it counts among the sharers for `fair_waiting_s`
        (a write on the refusal path only; the view learns it now, the other processes on their refresh)."""
        if not self.settings.fair_share or self.alone(tenant) or tenant in self.active():
            return      # alone, or already a sharer (it holds some): nothing to note (a flood writes nothing)
        self.waiting.add(tenant)
        self._derived.clear()
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(self.keys.fair_waiting, {tenant: now_ms()})
        pipe.zremrangebyscore(self.keys.fair_waiting, "-inf", now_ms() - int(self.settings.fair_waiting_s * 1000))
        await pipe.execute()

    def live(self, tenant: str) -> int:
        return sum(counts.get(tenant, 0) for counts in self.counts)

    def share(self, tenant: str) -> int:
        """The live workflows `tenant` may hold in the whole deployment once it is busy."""
        return tenant_share(self.settings.max_in_flight, tenant, self.weights, self._active())

    def alone(self, tenant: str) -> bool:
        """Whether no other tenant has used this deployment (as far as the view knows)."""
        return not any(t != tenant for counts in self.counts for t in counts) and not self.waiting - {tenant}

    def cap(self) -> int:
        """The most one tenant may hold whatever the others do: `max_in_flight` less the reserve kept
        for a tenant that arrives while another fills the deployment (only once the deployment has
        seen another tenant: a deployment of one tenant keeps all of `max_in_flight`)."""
        reserve = math.ceil(self.settings.max_in_flight * self.settings.fair_share_reserve)
        return max(1, self.settings.max_in_flight - reserve)

    def submit_args(self, tenant: str, cell: int) -> list[Any]:
        """The three fair-share ARGV of `submit.lua` for a submit of `tenant` into `cell`: its share
        left there ('': no check), the cell's in-flight count from which the share is enforced, and
        its cap left there."""
        if not self.settings.fair_share:
            return ["", 0, ""]
        found = self._derived.get((tenant, cell))        # the same until the view changes
        if found is None:
            elsewhere = sum(counts.get(tenant, 0) for c, counts in enumerate(self.counts) if c != cell)
            # the cap only binds once another tenant has used the deployment: the view says so for the
            # other cells, the cell's own counts (in the script) for this one
            found = [self.share(tenant) - elsewhere, self._from(cell), self.cap() - elsewhere]
            if len(self._derived) < MAX_DERIVED:
                self._derived[(tenant, cell)] = found
        return list(found)


def decode_weights(raw: Mapping[Any, Any] | None) -> dict[str, float]:
    """The live weights hash; a field that does not parse is skipped (it was written by hand)."""
    out: dict[str, float] = {}
    for k, v in (raw or {}).items():
        try:
            out[s(k)] = check_weight(float(s(v)))
        except ValueError:
            continue
    return out


async def set_weight(redis: RedisClient, keys: Keys, tenant: str, weight: float | None) -> None:
    """Set a tenant's weight live (None: back to the configured one); ValueError for bad input."""
    check_tenant(tenant)
    if weight is None:
        await redis.hdel(keys.fair_weights, tenant)
    else:
        await redis.hset(keys.fair_weights, tenant, repr(check_weight(weight)))


async def weights_table(redis: RedisClient, settings: Settings, keys: Keys) -> list[dict[str, Any]]:
    """Every tenant with a weight or live workflows: its weight (and where it comes from), its live
    workflows and its share now (what `omniflow tenants ls` and `GET /v1/admin/tenants` show)."""
    view = FairShare(redis, settings, keys)
    await view.refresh()
    live_weights = decode_weights(await redis.hgetall(keys.fair_weights))
    names = sorted(set(view.weights) | view.active())
    rows = []
    for t in names:
        source = "live" if t in live_weights else "config" if t in view.configured else "default"
        rows.append({"tenant": t, "weight": view.weights.get(t, DEFAULT_WEIGHT), "source": source,
                     "live": view.live(t), "share": view.share(t)})
    return rows
