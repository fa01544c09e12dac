"""Operator actions behind the admin CLI and the API's admin routes (the dashboard); what they
read about the fleet is in `omniflow.ops.fleet`.

- `set_drain`: drain / undrain a worker (it reads the flag with its heartbeat).
- `retry_workflow`, `purge_finished`, `purge_all`, and the dead-letter streams
  (`dlq_entries`, `dlq_replay`, `dlq_drop`).
"""
from __future__ import annotations

import json
import time
from typing import Any

from omniflow.storage import listing
from omniflow.errors import InvalidRequest, ScriptError, UnknownPipeline, WorkflowNotFound
from omniflow.ops.fleet import entry_ms, list_workers
from omniflow.storage.keys import DLQ_EVENTS
from omniflow.models import TERMINAL_STATES, Priority, SubmitRequest, WorkflowInput, WorkflowState
from omniflow.catalog import Catalog
from omniflow.pipeline import Pipeline
from omniflow.storage import redisio
from omniflow.storage.redisio import translated
from omniflow.client.store import Store
from omniflow.storage.schema import WorkflowRecord, csv, decode_fields, now_ms, s
from omniflow.storage.scripts import LIBRARY_NAME, LIBRARY_PREFIX
from omniflow.storage.transitions.housekeeping import PurgeResult, purge, purge_code

PURGE_BATCH = 500
FINISHED_STATES = tuple(x.value for x in WorkflowState if x in TERMINAL_STATES)


@translated
async def set_drain(store: Store, worker_id: str, *, drain: bool) -> dict[str, Any]:
    """Drain (or undrain) a live worker: it stops claiming within a heartbeat; what it holds runs to the end."""
    score = await store.client.zscore(store.keys.workers, worker_id)
    if score is None or float(score) <= now_ms():
        raise InvalidRequest(f"no live worker {worker_id!r} (see `omniflow workers`)")
    info = store.keys.worker_info(worker_id)
    if drain:
        await store.client.hset(info, "drain", str(now_ms()))
    else:
        await store.client.hdel(info, "drain")
    return next(w for w in await list_workers(store) if w["id"] == worker_id)


@translated
async def retry_workflow(store: Store, wf_id: str, *, tenant: str | None = None) -> str:
    """Resubmit a failed/aborted workflow's input as a new workflow; returns the new id."""
    raw = await store.client.hgetall(store.keys.wf(wf_id))
    rec = WorkflowRecord.decode_raw(wf_id, raw)
    if not raw or (tenant is not None and rec.tenant != tenant):
        raise WorkflowNotFound(f"no workflow {wf_id} (it may have expired)")
    if rec.state not in ("failed", "aborted"):
        raise InvalidRequest(f"workflow {wf_id} is {rec.state}; only failed or aborted ones are retried")
    kinds = sorted(set(rec.kinds.values()))
    params = json.loads(rec.params or "{}")
    given = WorkflowInput.model_validate_json(rec.input)
    if given.audio is not None:
        raise InvalidRequest(f"workflow {wf_id} heard streamed audio, which is not kept once it ends: submit it "
                             "again with its audio")
    # on the pipeline of the same name (its current version: a retry is a new workflow)
    req = SubmitRequest(input=given, output_modalities=kinds,
                        stage_params=params, webhook_url=rec.webhook or None, pipeline=rec.pipeline or None)
    prio = Priority.parse(rec.priority or "api")
    return (await store.submit(req, tenant=rec.tenant or "default", priority=prio)).id


def finished_states(state: str | None) -> tuple[str, ...]:
    """The states `purge --older-than` may delete: the finished ones, or the one asked for."""
    if state is None:
        return FINISHED_STATES
    if state not in FINISHED_STATES:
        raise InvalidRequest(f"--state: {state!r} is not a finished state; one of {list(FINISHED_STATES)}")
    return (state,)


@translated
async def count_finished(store: Store, states: tuple[str, ...], older_than_s: float) -> int:
    """How many finished workflows in `states` were created more than `older_than_s` ago."""
    cutoff = now_ms() - int(older_than_s * 1000)
    pipe = store.client.pipeline(transaction=False)
    for cell in store.keys.all_cells:
        for state in states:
            pipe.zcount(store.keys.state_index(state, cell), "-inf", f"({cutoff}")
    return sum(int(n) for n in await pipe.execute())


@translated
async def purge_finished(store: Store, states: tuple[str, ...], older_than_s: float) -> int:
    """Delete finished workflows (records, logs, outputs, webhook records, idempotency keys, index
    entries) created more than `older_than_s` ago; live workflows are never touched. Returns how many."""
    redis, keys = store.client, store.keys
    cutoff = now_ms() - int(older_than_s * 1000)
    deleted = 0
    while True:
        ids = await listing.finished_before(redis, keys, states, cutoff, count=PURGE_BATCH)
        if not ids:
            return deleted
        pipe = redis.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hmget(keys.wf(wf_id), ["state", "tenant", "request_id", "finals"])
        records = await pipe.execute()
        calls: list[tuple[Any, ...]] = []
        for wf_id, (state, tenant, rid, finals) in zip(ids, records):
            if s(state) and s(state) not in FINISHED_STATES:
                continue            # the index said finished: never delete a live record on a stale entry
            # one script per workflow (its cell's keys, atomically; it re-checks the state), and its
            # webhook records apart (their own slot)
            calls += [purge(keys, wf_id, tenant=s(tenant), request_id=s(rid), finals=csv(finals)),
                      ("UNLINK", *keys.webhook_keys(wf_id))]
        replies = await redisio.execute(redis, calls)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        deleted += sum(1 for reply in replies[::2] if purge_code(reply) is PurgeResult.PURGED)


@translated
async def purge_all(store: Store) -> int:
    """Delete every key under the prefix (the whole deployment's state). Returns how many."""
    n = 0
    async for key in store.client.scan_iter(match=f"{store.keys.prefix}:*", count=1000):
        n += await store.client.unlink(key)
    return n


def _library_row(raw: list[Any]) -> dict[str, Any]:
    """One FUNCTION LIST entry (a flat name/value list: omniflow's clients speak RESP2) as {library, functions}."""
    fields = {s(k): v for k, v in zip(raw[::2], raw[1::2])}
    return {"library": s(fields.get("library_name", b"")), "functions": len(fields.get("functions") or [])}


@translated
async def script_libraries(store: Store) -> list[dict[str, Any]]:
    """omniflow's script libraries on the server, this version's first: one per version that has run
    against it (`omniflow.storage.scripts`: an upgrade loads its own beside the old one)."""
    rows = [_library_row(raw) for raw in await store.client.function_list(f"{LIBRARY_PREFIX}*")]
    for row in rows:
        row["current"] = row["library"] == LIBRARY_NAME
    return sorted(rows, key=lambda r: (not r["current"], r["library"]))


@translated
async def prune_script_libraries(store: Store, names: list[str]) -> list[str]:
    """Delete the libraries `names` of other omniflow versions (as `script_libraries` listed them;
    this version's is refused). A process of an old version still running is not harmed: its next
    call finds its function missing and loads its own library again. Returns those deleted."""
    if LIBRARY_NAME in names or any(not name.startswith(LIBRARY_PREFIX) for name in names):
        raise InvalidRequest(f"only other omniflow versions' libraries can be pruned, not {names}")
    deleted = []
    for name in names:
        try:
            await store.client.function_delete(name)
        except ScriptError as exc:      # gone since it was listed (another prune): nothing to do
            if "not found" not in str(exc).lower():
                raise
            continue
        deleted.append(name)
    return deleted


def dlq_names(pipeline: Pipeline | Store | Catalog, stage: str | None) -> list[str]:
    """The dead-letter streams meant by `stage` (None: all of them: one per stage name of every
    pipeline a store knows); unknown names are refused."""
    if isinstance(pipeline, Store):
        stages = list(pipeline.stage_queues())
    elif isinstance(pipeline, Catalog):
        stages = list(dict.fromkeys(st for p in pipeline for st in p.order))
    else:
        stages = list(pipeline.order)
    known = [*stages, DLQ_EVENTS]
    if stage is None:
        return known
    if stage not in known:
        raise InvalidRequest(f"unknown stage {stage!r}; dead-letter streams: {known}")
    return [stage]


@translated
async def dlq_entries(store: Store, stage: str | None, limit: int) -> list[dict[str, Any]]:
    """Dead letters, newest first per stream (of one stage, or of all, up to `limit` in total)."""
    rows: list[dict[str, Any]] = []
    for name in dlq_names(store, stage):
        for key in _dlq_keys(store, name):
            for eid, fields in await store.client.xrevrange(key, count=limit):
                rows.append({"stream": key, "dlq": name, "entry": s(eid), "at": (entry_ms(eid) or 0) / 1000,
                             **decode_fields(fields)})
    return rows[:limit]


def _dlq_keys(store: Store, name: str) -> list[str]:
    """One dead-letter stream per cell."""
    return [store.keys.dlq(name, cell) for cell in store.keys.all_cells]


@translated
async def dlq_replay(store: Store, stage: str | None, entry: str | None) -> list[dict[str, str]]:
    """Resubmit the workflows of dead letters as new workflows and drop the replayed entries."""
    out = []
    for name, key in ((n, k) for n in dlq_names(store, stage) for k in _dlq_keys(store, n)):
        entries = await store.client.xrange(key, entry, entry) if entry else await store.client.xrange(key, count=1000)
        for eid, fields in entries:
            row = {"dlq": name, "entry": s(eid), "wf": s(fields.get(b"wf"))}
            if not row["wf"]:
                row["skipped"] = "malformed entry: nothing to replay"
            else:
                try:
                    row["new_id"] = await retry_workflow(store, row["wf"])
                except (WorkflowNotFound, InvalidRequest, UnknownPipeline) as exc:
                    row["skipped"] = str(exc)
            if "new_id" in row:
                await store.client.xdel(key, eid)
            out.append(row)
    return out


@translated
async def dlq_count(store: Store, stage: str | None, entry: str | None) -> int:
    """How many dead letters `dlq_drop` would delete."""
    pipe = store.client.pipeline(transaction=False)
    for key in (k for name in dlq_names(store, stage) for k in _dlq_keys(store, name)):
        if entry:
            pipe.xrange(key, entry, entry)
        else:
            pipe.xlen(key)
    return sum(len(r) if isinstance(r, list) else int(r) for r in await pipe.execute())


@translated
async def dlq_drop(store: Store, stage: str | None, entry: str | None) -> int:
    """Delete dead letters (one entry, one stage's, or all); returns how many."""
    n = 0
    for key in (k for name in dlq_names(store, stage) for k in _dlq_keys(store, name)):
        if entry:
            n += await store.client.xdel(key, entry)
        else:
            n += await store.client.xlen(key)
            await store.client.unlink(key)
    return n


def parse_duration(text: str) -> float:
    """'90', '90s', '10m', '2h', '7d' -> seconds (> 0)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    raw = text.strip().lower()
    factor = units.get(raw[-1:], None)
    number = raw[:-1] if factor else raw
    try:
        value = float(number) * (factor or 1)
    except ValueError:
        raise InvalidRequest(f"{text!r} is not a duration like 90s, 10m, 2h or 7d") from None
    if not value > 0 or value != value or value == float("inf"):
        raise InvalidRequest(f"{text!r}: a duration must be positive")
    return value


def since_ms(seconds: float | None) -> int | None:
    """The creation-time bound of an age filter: now minus `seconds`."""
    return None if seconds is None else int((time.time() - seconds) * 1000)
