"""Finding one workflow among many: filtered, paged listing over the listing indexes.

The indexes are zsets (member: workflow id, score: creation ms), kept exact by the Lua
transitions, so a listing never scans the keyspace:

    <cell>:all                 every workflow                      submit.lua
    <cell>:idx:state:<state>   one per state but `pending`          first claim, finalize
    <cell>:idx:tenant:<tenant> one per tenant but `default`          submit.lua
                               (+ <cell>:idx:tenants, their names)
    <cell>:inflight            the live workflows, by deadline      submit, finalize (admission)

Two filters are served by an index that holds more than they match, checked on the records like
the filters no index serves: `state=pending` walks `inflight` (the live workflows, pending or
running: a pending index would cost every workflow's start a ZREM and a ZADD), latest deadline
first, and its count is `inflight` less the running index; `tenant=default` (the tenant of a
deployment without tenants, whose index would repeat `all`) walks `all`.

Each cell (`omniflow.storage.cells`) keeps its own indexes. With one cell (a single server) a query
walks one index as described below; with several, it walks the indexes of every cell merged
newest first (ranks are ranks in that merged order), and checks the other filters on the
records from the client, in bounded steps likewise.

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

from omniflow.storage.client import RedisClient

from omniflow.storage import redisio
from omniflow.storage.keys import INDEXED_STATES, UNINDEXED_TENANT, Keys
from omniflow.models import WorkflowState
from omniflow.storage.schema import RecordField, WorkflowRecord, csv, s
from omniflow.storage.transitions.listing import list_scan, list_scan_result

DEFAULT_MAX_SCAN = 100_000     # records one query may read to fill a page (then: next_offset)
SCAN_STEP = 2_000              # records one list_scan.lua call reads (bounds how long it holds the server)
OLDEST_MAX_READ = 50_000       # records `oldest_pending` reads at most
FIELDS = (RecordField.STATE, RecordField.TENANT, RecordField.CREATED_MS, RecordField.FINISHED_MS, RecordField.FINALS,
          RecordField.STAGES, RecordField.ERROR, RecordField.ERROR_STAGE, RecordField.REQUEST_ID, RecordField.PIPELINE,
          RecordField.PIPELINE_HASH)
STATES = tuple(x.value for x in WorkflowState)
SCAN_FIELDS = ("state", "tenant", "stages", "request_id", "created_ms")     # what a walk checks (list_scan.lua)


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
    rec = WorkflowRecord.decode(wf_id, {name: s(v) for name, v in zip(FIELDS, values) if v is not None})
    return {"id": wf_id, "state": rec.state, "tenant": rec.tenant or None, "created_at": rec.created_ms / 1000,
            "finished_at": rec.finished_ms / 1000 if rec.finished_ms else None, "final_stages": rec.finals,
            "stages": rec.stages, "error": rec.error or None, "error_stage": rec.error_stage or None,
            "request_id": rec.request_id or None, "pipeline": rec.pipeline or None,
            "pipeline_version": rec.pipeline_version or None}


def _candidates(keys: Keys, flt: ListFilter, cell: int) -> list[tuple[str, bool]]:
    """The indexes of one cell that can serve `flt`, each with whether it holds exactly the workflows
    of the filter it serves (`inflight` holds the running ones too, `all` every tenant's)."""
    candidates: list[tuple[str, bool]] = []
    if flt.state == WorkflowState.PENDING.value:
        candidates.append((keys.inflight(cell), False))
    elif flt.state:
        candidates.append((keys.state_index(flt.state, cell), True))
    if flt.tenant == UNINDEXED_TENANT:
        candidates.append((keys.all_wf(cell), False))
    elif flt.tenant is not None:
        candidates.append((keys.tenant_index(flt.tenant, cell), True))
    return candidates or [(keys.all_wf(cell), True)]


async def _pick_index(redis: RedisClient, keys: Keys, flt: ListFilter) -> tuple[list[str], int, bool]:
    """(the chosen index, one key per cell; its entries in range over the cells; whether the index
    alone answers every filter). `inflight` is scored by deadline, never before creation: its entries
    with a deadline from `since` on hold every one created from then (the walk checks the creation)."""
    per_cell = [_candidates(keys, flt, cell) for cell in keys.all_cells]
    low = "-inf" if flt.since_ms is None else flt.since_ms
    pipe = redis.pipeline(transaction=False)
    for candidates in per_cell:
        for key, _exact in candidates:
            pipe.zcount(key, low, "+inf")
    counts = [int(n) for n in await pipe.execute()]
    width = len(per_cell[0])
    totals = [sum(counts[i::width]) for i in range(width)]
    best = min(range(width), key=totals.__getitem__)
    exact = width == 1 and per_cell[0][best][1] and not flt.stage and not flt.request_id
    return [candidates[best][0] for candidates in per_cell], totals[best], exact


async def query(redis: RedisClient, keys: Keys, flt: ListFilter, *, offset: int = 0, limit: int = 50,
                max_scan: int = DEFAULT_MAX_SCAN) -> ListPage:
    """One page of workflows matching `flt`, newest first, starting at rank `offset` of the walked index."""
    indexes, end, exact = await _pick_index(redis, keys, flt)
    if len(indexes) > 1:
        ids, pos, scanned = await _walk_cells(redis, keys, indexes, flt, offset, end, limit, max_scan, exact=exact)
        return await _page(redis, keys, ids, pos, end, exact, scanned)
    index = indexes[0]
    if exact:
        ids = [s(x) for x in await redis.zrevrange(index, offset, min(end, offset + limit) - 1)] \
            if offset < end else []
        pos, scanned = offset + len(ids), len(ids)
    else:
        ids, pos, scanned = await _scan(redis, keys, index, flt, offset, end, limit, max_scan)
    return await _page(redis, keys, ids, pos, end, exact, scanned)


async def _page(redis: RedisClient, keys: Keys, ids: list[str], pos: int, end: int, exact: bool, scanned: int) -> ListPage:
    rows: list[dict[str, Any]] = []
    if ids:
        pipe = redis.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hmget(keys.wf(wf_id), list(FIELDS))
        rows = [row for row in (summary(wf_id, values) for wf_id, values in zip(ids, await pipe.execute()))
                if row["state"]]      # a record that expired since it was indexed
    return ListPage(rows=rows, next_offset=pos if pos < end else None, total=end if exact else None,
                    scanned=scanned)


async def _merged(redis: RedisClient, indexes: list[str], low: Any, start: int, count: int) -> list[str]:
    """The ids at merged ranks start..start+count-1, newest first, of one index over every cell."""
    pipe = redis.pipeline(transaction=False)
    for key in indexes:
        pipe.zrevrangebyscore(key, "+inf", low, start=0, num=start + count, withscores=True)
    merged = sorted(((score, s(member)) for reply in await pipe.execute() for member, score in reply), reverse=True)
    return [wf_id for _, wf_id in merged[start:start + count]]


def _matches(flt: ListFilter, values: list[Any]) -> bool:
    """The filters `list_scan.lua` checks on the server, on one record's `SCAN_FIELDS`."""
    state, tenant, stages, rid, created = (s(v) for v in values)
    return bool(state) and (not flt.state or state == flt.state) and (flt.tenant is None or tenant == flt.tenant) \
        and (not flt.stage or flt.stage in csv(stages)) and (not flt.request_id or flt.request_id in rid) \
        and (flt.since_ms is None or int(created or 0) >= flt.since_ms)


async def _walk_cells(redis: RedisClient, keys: Keys, indexes: list[str], flt: ListFilter, pos: int, end: int, limit: int,
                      max_scan: int, *, exact: bool) -> tuple[list[str], int, int]:
    """`_scan` over the merged indexes of several cells, the records checked here (bounded steps)."""
    low = "-inf" if flt.since_ms is None else flt.since_ms
    ids: list[str] = []
    scanned = 0
    while len(ids) < limit and pos < end and scanned < max_scan:
        chunk = await _merged(redis, indexes, low, pos, (limit - len(ids)) if exact else min(SCAN_STEP, max_scan - scanned))
        if not chunk:
            break
        if exact:
            ids += chunk
            pos += len(chunk)
            scanned += len(chunk)
            continue
        pipe = redis.pipeline(transaction=False)
        for wf_id in chunk:
            pipe.hmget(keys.wf(wf_id), list(SCAN_FIELDS))
        for i, (wf_id, values) in enumerate(zip(chunk, await pipe.execute())):
            if _matches(flt, values):
                ids.append(wf_id)
                if len(ids) >= limit:
                    chunk = chunk[:i + 1]
                    break
        pos += len(chunk)
        scanned += len(chunk)
    return ids, pos, scanned


async def _scan(redis: RedisClient, keys: Keys, index: str, flt: ListFilter, pos: int, end: int, limit: int,
                max_scan: int) -> tuple[list[str], int, int]:
    """Matching ids from rank `pos` on, checked server-side by `list_scan.lua` in bounded steps."""
    ids: list[str] = []
    scanned = 0
    while len(ids) < limit and pos < end and scanned < max_scan:
        step = min(SCAN_STEP, max_scan - scanned)
        chunk = [s(x) for x in await redis.zrevrange(index, pos, min(end, pos + step) - 1)]
        if not chunk:
            break
        found, read = list_scan_result(chunk, await redisio.call(redis, *list_scan(
            keys, chunk, want=limit - len(ids), state=flt.state or "", tenant=flt.tenant, stage=flt.stage or "",
            request_id=flt.request_id or "", since_ms=flt.since_ms)))
        pos += read
        scanned += read
        ids.extend(found)
        if read == 0:
            break
    return ids, pos, scanned


async def state_counts(redis: RedisClient, keys: Keys) -> dict[str, int]:
    """Workflows per state (ZCARD of each state index of each cell: O(1) each; pending: `inflight` less
    the running index, read back to back: a transition between the two reads moves it by one, as it
    moves the other counts of the pipeline; a MULTI could not span a cluster's cells)."""
    pipe = redis.pipeline(transaction=False)
    for cell in keys.all_cells:
        pipe.zcard(keys.inflight(cell))
        for state in INDEXED_STATES:
            pipe.zcard(keys.state_index(state.value, cell))
    counts = [int(n) for n in await pipe.execute()]
    width = 1 + len(INDEXED_STATES)
    out = {state.value: sum(counts[1 + i::width]) for i, state in enumerate(INDEXED_STATES)}
    out[WorkflowState.PENDING.value] = _pending(sum(counts[0::width]), out[WorkflowState.RUNNING.value])
    return {state: out[state] for state in STATES}


def _pending(live: int, running: int) -> int:
    """How many are pending of `live` workflows (`inflight`), `running` of them in the running index."""
    return max(0, int(live) - int(running))


async def live_ages(redis: RedisClient, keys: Keys, now: int, *, longest_ms: int) -> tuple[int, dict[str, int | None]]:
    """(how many live workflows are past their deadline at `now`, the creation ms of the oldest
    pending and of the oldest running one (None: none)) over the cells: one pipeline, then the walk
    of `oldest_pending` in the cells where some are pending. `longest_ms`: see `oldest_pending`."""
    pipe = redis.pipeline(transaction=False)
    for cell in keys.all_cells:
        pipe.zcount(keys.inflight(cell), "-inf", now)
        pipe.zcard(keys.inflight(cell))
        pipe.zrange(keys.state_index(WorkflowState.RUNNING.value, cell), 0, 0, withscores=True)
        pipe.zcard(keys.state_index(WorkflowState.RUNNING.value, cell))
    replies = await pipe.execute()
    pending = [await oldest_pending(redis, keys, cell, _pending(live, running), longest_ms=longest_ms)
               for cell, live, running in zip(keys.all_cells, replies[1::4], replies[3::4]) if _pending(live, running)]
    oldest = {WorkflowState.PENDING.value: min((ms for ms in pending if ms is not None), default=None),
              WorkflowState.RUNNING.value: min((int(reply[0][1]) for reply in replies[2::4] if reply), default=None)}
    return sum(int(n) for n in replies[0::4]), oldest


async def oldest_pending(redis: RedisClient, keys: Keys, cell: int, pending: int, *, longest_ms: int,
                         max_read: int = OLDEST_MAX_READ) -> int | None:
    """The creation ms of the cell's oldest pending workflow (None: none), `pending` of which are known
    to be there (`state_counts`). Pending has no index: the cell's `inflight` is walked by deadline (in
    steps of 64 records growing to `SCAN_STEP`) until all `pending` are seen, or a deadline so late that
    no workflow from there on can be older than the oldest seen (created >= deadline - `longest_ms`, the
    longest deadline a request may ask for), or `max_read` records (then: the oldest of those read)."""
    found, oldest, pos, step = 0, None, 0, 64      # (steps grow 4x: the walk mostly stops in the first)
    while found < pending and pos < max_read:
        chunk = await redis.zrange(keys.inflight(cell), pos, min(pos + step, max_read) - 1, withscores=True)
        step = min(SCAN_STEP, step * 4)
        if not chunk:
            break
        pipe = redis.pipeline(transaction=False)
        for wf_id, _deadline in chunk:
            pipe.hmget(keys.wf(s(wf_id)), ["state", "created_ms"])
        for (_wf_id, deadline), (state, created) in zip(chunk, await pipe.execute()):
            if oldest is not None and deadline - longest_ms >= oldest:
                return oldest
            if s(state) == WorkflowState.PENDING.value:
                found += 1
                oldest = int(created) if oldest is None else min(oldest, int(created))
        pos += len(chunk)
    return oldest


async def finished_before(redis: RedisClient, keys: Keys, states: tuple[str, ...], cutoff_ms: int, *,
                          count: int = 500) -> list[str]:
    """Up to `count` ids of workflows in `states` created before `cutoff_ms`, oldest first."""
    pipe = redis.pipeline(transaction=False)
    for cell in keys.all_cells:
        for state in states:
            pipe.zrangebyscore(keys.state_index(state, cell), "-inf", f"({cutoff_ms}", start=0, num=count,
                               withscores=True)
    found = sorted((score, s(x)) for reply in await pipe.execute() for x, score in reply)
    return [wf_id for _, wf_id in found[:count]]


async def trim(redis: RedisClient, keys: Keys, cutoff_ms: int) -> None:
    """Drop index entries created before `cutoff_ms` (their records have expired by then)."""
    pipe = redis.pipeline(transaction=False)
    for cell in keys.all_cells:
        pipe.smembers(keys.tenants(cell))
    tenants = [[s(t) for t in members] for members in await pipe.execute()]
    pipe = redis.pipeline(transaction=False)
    for cell in keys.all_cells:
        # (the pending index of the layout before: written by its submits, emptied here as its entries age)
        for key in (keys.all_wf(cell), *keys.state_indexes(cell), keys.state_index(WorkflowState.PENDING.value, cell),
                    *(keys.tenant_index(t, cell) for t in tenants[cell])):
            pipe.zremrangebyscore(key, "-inf", f"({cutoff_ms}")
    await pipe.execute()
