"""Finding one workflow among many: filtered, paged listing over the listing indexes.

The indexes are zsets (member: workflow id, score: creation ms), kept exact by the Lua
transitions, so a listing never scans the keyspace:

    <p>:all                    every workflow                      submit.lua
    <p>:idx:state:<state>      one per `WorkflowState`              submit, first claim, finalize
    <p>:idx:tenant:<tenant>    one per tenant (+ <p>:idx:tenants)   submit.lua

A query walks ONE index newest first: the smallest of those its filters name. `since`
bounds the walk (ZCOUNT gives the rank where older records start), so an age filter never
reads past it. The filters no index serves (`stage`, a `request_id` substring, the second of
state and tenant) are checked against the records on the server (`list_scan.lua`, a
read-only script reading at most `SCAN_STEP` records per call); a query stops after
`max_scan` records and says where to continue (`next_offset`), so it stays bounded however
rare the match is. Offsets are ranks in the walked index.

Every index is trimmed with `<p>:all` by the reconciler's sweep (`trim`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from omniflow import scripts
from omniflow.keys import Keys
from omniflow.models import WorkflowState
from omniflow.store import csv, s

DEFAULT_MAX_SCAN = 100_000     # records one query may read to fill a page (then: next_offset)
SCAN_STEP = 2_000              # records one list_scan.lua call reads (bounds how long it holds the server)
FIELDS = ("state", "tenant", "created_ms", "finished_ms", "finals", "stages", "error", "error_stage", "request_id")
STATES = tuple(x.value for x in WorkflowState)


@dataclass(frozen=True)
class ListFilter:
    """What to list; every field left None matches everything."""

    state: str | None = None
    tenant: str | None = None
    stage: str | None = None            # the stage is part of the workflow's plan
    since_ms: int | None = None         # created at or after (epoch ms)
    request_id: str | None = None       # substring of the request id


@dataclass
class ListPage:
    rows: list[dict[str, Any]]
    next_offset: int | None             # rank to continue from; None when the walk reached the end
    total: int | None                   # how many match, when the index alone answers the filters
    scanned: int                        # records read to build this page


def summary(wf_id: str, values: list[Any]) -> dict[str, Any]:
    """One listing row from the record fields `FIELDS`."""
    state, tenant, created, finished, finals, stages, error, error_stage, rid = (s(v) for v in values)
    return {"id": wf_id, "state": state, "tenant": tenant or None, "created_at": int(created or 0) / 1000,
            "finished_at": int(finished) / 1000 if finished else None, "final_stages": csv(finals),
            "stages": csv(stages), "error": error or None, "error_stage": error_stage or None,
            "request_id": rid or None}


async def _pick_index(redis: Redis, keys: Keys, flt: ListFilter) -> tuple[str, int, bool]:
    """(index key, entries in range, whether the index alone answers every filter)."""
    candidates = [keys.state_index(flt.state)] if flt.state else []
    if flt.tenant is not None:
        candidates.append(keys.tenant_index(flt.tenant))
    candidates = candidates or [keys.all_wf]
    low = "-inf" if flt.since_ms is None else flt.since_ms
    pipe = redis.pipeline(transaction=False)
    for key in candidates:
        pipe.zcount(key, low, "+inf")
    counts = [int(n) for n in await pipe.execute()]
    best = min(range(len(candidates)), key=counts.__getitem__)
    exact = len(candidates) == 1 and not flt.stage and not flt.request_id
    return candidates[best], counts[best], exact


async def query(redis: Redis, keys: Keys, flt: ListFilter, *, offset: int = 0, limit: int = 50,
                max_scan: int = DEFAULT_MAX_SCAN) -> ListPage:
    """One page of workflows matching `flt`, newest first, starting at rank `offset` of the walked index."""
    index, end, exact = await _pick_index(redis, keys, flt)
    if exact:
        ids = [s(x) for x in await redis.zrevrange(index, offset, min(end, offset + limit) - 1)] \
            if offset < end else []
        pos, scanned = offset + len(ids), len(ids)
    else:
        ids, pos, scanned = await _scan(redis, keys, index, flt, offset, end, limit, max_scan)
    rows: list[dict[str, Any]] = []
    if ids:
        pipe = redis.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hmget(keys.wf(wf_id), list(FIELDS))
        rows = [row for row in (summary(wf_id, values) for wf_id, values in zip(ids, await pipe.execute()))
                if row["state"]]      # a record that expired since it was indexed
    return ListPage(rows=rows, next_offset=pos if pos < end else None, total=end if exact else None,
                    scanned=scanned)


async def _scan(redis: Redis, keys: Keys, index: str, flt: ListFilter, pos: int, end: int, limit: int,
                max_scan: int) -> tuple[list[str], int, int]:
    """Matching ids from rank `pos` on, checked server-side by `list_scan.lua` in bounded steps."""
    ids: list[str] = []
    scanned = 0
    while len(ids) < limit and pos < end and scanned < max_scan:
        step = min(SCAN_STEP, max_scan - scanned)
        reply = await scripts.call(redis, "list_scan", [index], [
            keys.prefix, pos, end, step, limit - len(ids), flt.state or "",
            "1" if flt.tenant is not None else "0", flt.tenant or "", flt.stage or "", flt.request_id or ""])
        pos, read = int(reply[0]), int(reply[1])
        scanned += read
        ids.extend(s(x) for x in reply[2:])
        if read == 0:
            break
    return ids, pos, scanned


async def state_counts(redis: Redis, keys: Keys) -> dict[str, int]:
    """Workflows per state (ZCARD of each state index: O(1) each)."""
    pipe = redis.pipeline(transaction=False)
    for state in STATES:
        pipe.zcard(keys.state_index(state))
    return {state: int(n) for state, n in zip(STATES, await pipe.execute())}


async def finished_before(redis: Redis, keys: Keys, states: tuple[str, ...], cutoff_ms: int, *,
                          count: int = 500) -> list[str]:
    """Up to `count` ids of workflows in `states` created before `cutoff_ms`, oldest first."""
    pipe = redis.pipeline(transaction=False)
    for state in states:
        pipe.zrangebyscore(keys.state_index(state), "-inf", f"({cutoff_ms}", start=0, num=count)
    ids = [s(x) for reply in await pipe.execute() for x in reply]
    return ids[:count]


async def trim(redis: Redis, keys: Keys, cutoff_ms: int) -> None:
    """Drop index entries created before `cutoff_ms` (their records have expired by then)."""
    pipe = redis.pipeline(transaction=False)
    pipe.smembers(keys.tenants)
    tenants = [s(t) for t in (await pipe.execute())[0]]
    pipe = redis.pipeline(transaction=False)
    for key in (keys.all_wf, *(keys.state_index(x) for x in STATES), *(keys.tenant_index(t) for t in tenants)):
        pipe.zremrangebyscore(key, "-inf", f"({cutoff_ms}")
    await pipe.execute()


def unindex(pipe: Any, keys: Keys, wf_id: str, tenant: str) -> None:
    """Queue the removal of one workflow from every index on `pipe` (purge)."""
    pipe.zrem(keys.all_wf, wf_id)
    for state in STATES:
        pipe.zrem(keys.state_index(state), wf_id)
    pipe.zrem(keys.tenant_index(tenant), wf_id)
