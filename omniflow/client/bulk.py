"""Many workflows at once: pipelined submits, documents read together, and one blocking read for the
ends of many workflows (BullMQ's `QueueEvents`).

- `submit_many(store, requests)`: every request's `submit.lua` call in one round trip per
  `SUBMIT_BATCH` requests (a request refused for a full cell tries another cell once, together with
  the others refused in the same batch).
- `documents(store, ids)`: the documents of many workflows in two round trips (records and stage hashes,
  then the final text outputs), whatever their number.
- `Completions`: a watcher (BullMQ's `QueueEvents`). `watch(wf_id)` returns a future that resolves to
  the workflow's document once it is terminal. Every workflow's end is also written to its cell's
  `<cell>:ends` stream (`finalize` in `_lib.lua`), which the watcher reads with one blocking XREAD
  (one per cell on a cluster) from where it stood when the watcher started: one key per read however
  many workflows it watches. A newly watched workflow's state is checked once (those watched
  together, one round trip), so one that ended before is not waited for; not one submitted after
  the reader took its positions (`positioned` before the submit: its end is read after them, or has
  been, among the last `RECENT_ENDS` unwatched ends the reader keeps): `submitted(wf_id)`, which an
  `AsyncClient`'s `submit` calls for its own watchers and the API's `POST ?wait=` for its one. The documents of the
  workflows that end together are read together. Every `check_s` the watched ones are checked again:
  one whose end the reader missed (the stream keeps about the last 10,000; an omniflow of before
  wrote none) resolves then, and one that no longer exists (expired, purged) resolves to
  `WorkflowNotFound`.

    async with client.completions() as ends:
        futures = [ends.watch(wf) for wf in await client.submit_many(texts)]
        for doc in asyncio.as_completed(futures): ...
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from omniflow.client.documents import text_stages, workflow_document
from omniflow.client.store import Store, check_same_body
from omniflow.errors import AdmissionRefused, RedisRefused, WorkflowNotFound
from omniflow.models import TERMINAL_STATES, SubmitRequest, Submitted, WorkflowState
from omniflow.storage import redisio
from omniflow.storage.redisio import REDIS_ERRORS, translate
from omniflow.storage.schema import s, stages_in_record, text_fields
from omniflow.storage.transitions import Call
from omniflow.storage.transitions.admission import SubmitResult
from omniflow.storage.topology import read_groups
from omniflow.runtime import Backoff

logger = logging.getLogger(__name__)

SUBMIT_BATCH = 256          # submits per round trip
DEFAULT_CHECK_S = 5.0       # how often the watcher checks the workflows it waits for (ended unseen, or gone)
RECENT_ENDS = 4096          # ends read that nobody watched (yet): a fresh watch looks there first
FRESH_KEPT = 4096           # ids submitted after the positions, not watched yet (`submitted`)
ENDS_READ_COUNT = 512       # ends read per call


def _keep(ids: dict[str, None], wf_id: str, most: int) -> None:
    """Add `wf_id` to an insertion-ordered set of at most `most` ids (the oldest goes first)."""
    ids[wf_id] = None
    if len(ids) > most:
        del ids[next(iter(ids))]


# ---------------------------------------------------------------- submit
async def submit_many(store: Store, requests: Sequence[SubmitRequest], *, tenant: str = "default",
                      return_exceptions: bool = False) -> list[Submitted | BaseException]:
    """Submit every request, pipelined; the results in order. A request that fails (refused, invalid)
    is its exception in the list with `return_exceptions`, else the first one is raised once the whole
    batch it is in has been sent (the requests before it, and the others of its batch, are submitted)."""
    out: list[Submitted | BaseException] = []
    for start in range(0, len(requests), SUBMIT_BATCH):
        batch = requests[start:start + SUBMIT_BATCH]
        results = await _submit_batch(store, batch, tenant)
        out += results
        if not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
    if store.settings.wait_aof and any(isinstance(r, Submitted) and not r.existing for r in out):
        await redisio.call(store.client, "WAITAOF", 1, 0, 1000)
    return out


async def _submit_batch(store: Store, batch: Sequence[SubmitRequest], tenant: str) -> list[Submitted | BaseException]:
    results: list[Submitted | BaseException] = []
    calls: list[tuple[int, Call, str]] = []
    for i, req in enumerate(batch):
        results.append(AdmissionRefused("not sent"))
        try:
            call, wf_id = store.submit_call(req, tenant=tenant)
        except Exception as exc:  # noqa: BLE001 - an invalid request fails alone
            results[i] = exc
            continue
        calls.append((i, call, wf_id))
    retry: list[tuple[int, Call, str]] = []
    for (i, _call, tried), reply in zip(calls, await _scripts(store, calls)):
        req = batch[i]
        if (not isinstance(reply, BaseException) and s(reply[0]) == SubmitResult.BUSY and len(reply) == 2 and not req.request_id
                and store.keys.cells > 1):
            # that cell is full: one more try in another one (as `Store.submit` does)
            call, wf_id = store.submit_call(req, tenant=tenant, wf_id=store.other_cell_id(tried))
            retry.append((i, call, wf_id))
            continue
        results[i] = _result(store, reply, tenant)
    for (i, _call, _tried), reply in zip(retry, await _scripts(store, retry)):
        results[i] = _result(store, reply, tenant)
    for i, result in enumerate(results):
        if isinstance(result, Submitted) and result.existing:
            try:
                results[i] = await _existing(store, batch[i], result)
            except Exception as exc:  # noqa: BLE001 - retired, or the same key with another request
                results[i] = exc
    return results


async def _scripts(store: Store, calls: list[tuple[int, Call, str]]) -> list[Any]:
    if not calls:
        return []
    return await redisio.execute(store.client, [call for _, call, _ in calls])


def _result(store: Store, reply: Any, tenant: str) -> Submitted | BaseException:
    if isinstance(reply, RedisRefused):
        return store.refused(reply)
    if isinstance(reply, BaseException):
        return reply
    try:
        return store.submitted(reply, tenant=tenant)
    except Exception as exc:  # noqa: BLE001 - busy, retired: that request's answer
        return exc


async def _existing(store: Store, req: SubmitRequest, result: Submitted) -> Submitted:
    """A repeated request id: the workflow it made, if the request is the same and it is not retired."""
    pipe = store.client.pipeline(transaction=False)
    pipe.hmget(store.keys.wf(result.id), ["state", "body_hash"])
    pipe.exists(store.keys.tomb(result.id))
    try:
        (raw_state, stored_hash), retired = await pipe.execute()
    except REDIS_ERRORS as exc:
        raise translate(exc) from exc
    if retired:
        raise store.retired(result.id)
    check_same_body(result.id, req, s(stored_hash))
    return Submitted(id=result.id, state=WorkflowState(s(raw_state) or WorkflowState.PENDING.value), existing=True)


# ---------------------------------------------------------------- documents
async def documents(store: Store, wf_ids: Sequence[str], *, tenant: str | None = None
                    ) -> dict[str, dict[str, Any] | BaseException]:
    """The documents of `wf_ids` (`Store.document`'s), read together: `WorkflowNotFound` for one that
    does not exist (or belongs to another tenant)."""
    ids = list(dict.fromkeys(wf_ids))
    if not ids:
        return {}
    keys = store.keys
    try:
        pipe = store.client.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hgetall(keys.wf(wf_id))     # (the stage fields with it: `Keys.stages`)
        raw = await pipe.execute()
    except REDIS_ERRORS as exc:
        raise translate(exc) from exc
    out: dict[str, dict[str, Any] | BaseException] = {}
    found: list[tuple[str, dict[str, str], dict[str, str], list[str]]] = []
    legacy: list[str] = []          # workflows of before: their stage fields in `Keys.stages_legacy`
    for wf_id, rec_raw in zip(ids, raw):
        rec = text_fields(rec_raw)
        if not rec or (tenant is not None and rec.get("tenant") != tenant):
            out[wf_id] = WorkflowNotFound(f"no workflow {wf_id}")
            continue
        if not stages_in_record(rec):
            legacy.append(wf_id)
        found.append((wf_id, rec, rec, text_stages(rec)))
    if legacy:
        try:
            pipe = store.client.pipeline(transaction=False)
            for wf_id in legacy:
                pipe.hgetall(keys.stages_legacy(wf_id))
            old = dict(zip(legacy, await pipe.execute()))
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc
        found = [(wf_id, rec, text_fields(old[wf_id]) if wf_id in old else st, names)
                 for wf_id, rec, st, names in found]
    wanted = [(wf_id, names) for wf_id, _, _, names in found if names]
    texts: dict[str, dict[str, str]] = {}
    if wanted:
        try:
            pipe = store.client.pipeline(transaction=False)
            for wf_id, names in wanted:
                pipe.mget([keys.out(wf_id, name) for name in names])
            for (wf_id, names), vals in zip(wanted, await pipe.execute()):
                texts[wf_id] = {name: s(v) for name, v in zip(names, vals)}
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc
    for wf_id, rec, st, _ in found:
        if rec.get("webhook"):      # rare: the webhook's deliveries are read the one-by-one way
            out[wf_id] = await store.document(wf_id, tenant=tenant)
        else:
            out[wf_id] = workflow_document(wf_id, rec, st, texts.get(wf_id, {}), None)
    return out


# ---------------------------------------------------------------- the watcher
class Completions:
    """The ends of many workflows through one blocking read (see the module docstring)."""

    def __init__(self, store: Store, *, tenant: str | None = None, block_ms: int = 5_000,
                 check_s: float = DEFAULT_CHECK_S) -> None:
        self._store = store
        self._tenant = tenant
        self._groups = read_groups(store.client, store.keys.cells)
        self._block_ms = block_ms
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._ended: list[str] = []         # read in an ends stream, documents not read yet
        self._new: list[str] = []           # watched, not checked yet
        self._wake = asyncio.Event()
        self._check_s = check_s
        self._positioned = False            # every ends stream is read from a position taken before now
        self._recent: dict[str, None] = {}  # ends read that were not watched (oldest first, RECENT_ENDS)
        self._fresh: dict[str, None] = {}   # `submitted` ids, not watched yet (oldest first, FRESH_KEPT)
        self._tasks: list[asyncio.Task[None]] = []
        self.pokes = 0              # round trips that checked newly watched workflows
        self.reads = 0              # blocking reads of the ends streams

    async def __aenter__(self) -> Completions:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        if not self._tasks:
            positions: list[asyncio.Future[None]] = []
            for group in self._groups:
                fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                positions.append(fut)
                self._tasks.append(asyncio.create_task(self._read(group, fut), name=f"completions:{group[0]}"))
            self._tasks.append(asyncio.create_task(self._run(positions), name="completions"))

    @property
    def watched(self) -> int:
        return len(self._waiting)

    @property
    def positioned(self) -> bool:
        """Is every ends stream read from a position taken before now? A workflow submitted after
        this says True ends after those positions: watching it needs no check of its state (`fresh`)."""
        return self._positioned

    def submitted(self, wf_id: str) -> None:
        """`wf_id` was created (not found: a repeated request's workflow may have ended long ago) by a
        submit sent after `positioned` said True: when it is watched, its state is not checked, its end
        is read after the reader's positions or was (then it is among the recent ends): one command
        less per workflow. Said of one that is not so, its watch still resolves, at the periodic check
        (`check_s`)."""
        _keep(self._fresh, wf_id, FRESH_KEPT)

    def watch(self, wf_id: str) -> asyncio.Future[dict[str, Any]]:
        """A future for the workflow's document once it is terminal (the same one for the same id);
        its state is checked once unless it was `submitted` here."""
        self.start()
        fut = self._waiting.get(wf_id)
        if fut is not None:
            return fut
        fut = self._waiting[wf_id] = asyncio.get_running_loop().create_future()
        fut.add_done_callback(_retrieved)       # a waiter that gave up (a timeout) leaves no warning behind
        if wf_id not in self._fresh:
            self._new.append(wf_id)
        else:
            del self._fresh[wf_id]
            if wf_id not in self._recent:
                return fut                  # its end is still to be read
            del self._recent[wf_id]         # it ended, and the reader saw it before the watch
            self._ended.append(wf_id)
        self._wake.set()
        return fut

    async def wait(self, wf_ids: Iterable[str], *, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Every workflow's document once all are terminal, or when `timeout_s` passes (then the current
        document of those still running). Raises `WorkflowNotFound` for one that does not exist."""
        ids = list(dict.fromkeys(wf_ids))
        futures = {wf_id: self.watch(wf_id) for wf_id in ids}
        if futures:
            await asyncio.wait(list(futures.values()), timeout=timeout_s)
        late = [wf_id for wf_id, fut in futures.items() if not fut.done()]
        current = await documents(self._store, late, tenant=self._tenant) if late else {}
        out: dict[str, dict[str, Any]] = {}
        for wf_id in ids:
            fut = futures[wf_id]
            result = fut.result() if fut.done() else current[wf_id]
            if isinstance(result, BaseException):
                raise result
            out[wf_id] = result
        return out

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for fut in self._waiting.values():
            fut.cancel()
        self._waiting.clear()

    async def _read(self, group: tuple[int, ...], positioned: asyncio.Future[None]) -> None:
        """Read the ends streams of `group`'s cells from where they were when the watcher started,
        handing on the watched workflows among them."""
        redis, keys = self._store.client, self._store.keys
        backoff = Backoff()
        streams: dict[Any, Any] = {}
        while not streams:         # where each stream is now: what ends after this is read
            try:
                pipe = redis.pipeline(transaction=False)
                for cell in group:
                    pipe.xrevrange(keys.ends(cell), count=1)
                streams = {keys.ends(cell): (last[0][0] if last else "0-0")
                           for cell, last in zip(group, await pipe.execute())}
            except REDIS_ERRORS as exc:
                await backoff.wait(logger, "completions", translate(exc))
        positioned.set_result(None)
        while True:
            try:
                self.reads += 1
                reply = await redis.xread(streams, count=ENDS_READ_COUNT, block=self._block_ms)
                backoff.reset()
            except REDIS_ERRORS as exc:     # lost, BUSY, LOADING...: read again from where it was
                await backoff.wait(logger, "completions", translate(exc))
                continue
            for raw_key, entries in reply or []:
                if not entries:
                    continue
                streams[s(raw_key)] = entries[-1][0]
                for _, fields in entries:
                    wf_id = s(fields.get(b"wf"))
                    if wf_id in self._waiting:
                        self._ended.append(wf_id)
                    else:
                        _keep(self._recent, wf_id, RECENT_ENDS)
            if self._ended:
                self._wake.set()

    async def _run(self, positions: list[asyncio.Future[None]]) -> None:
        # a workflow is checked once every ends stream is read from a position taken before the check:
        # it ended before the check (the check sees it), or after (a read sees it)
        await asyncio.gather(*positions)
        self._positioned = True
        checked = time.monotonic()
        while True:
            if not self._ended and not self._new:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self._check_s)
                except TimeoutError:
                    pass
            ended, self._ended = self._ended, []
            new, self._new = self._new, []
            try:
                if new:
                    self.pokes += 1
                    ended += await self._not_live(new)
                if ended:
                    await self._resolve(ended)
                if time.monotonic() - checked >= self._check_s:
                    checked = time.monotonic()
                    await self._check()
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as exc:  # noqa: BLE001 - Redis away: those waiters hear it, the reader goes on
                for wf_id in [*ended, *new]:
                    self._settle(wf_id, exc)

    async def _not_live(self, ids: list[str]) -> list[str]:
        """Those of `ids` that are terminal or gone (one HGET of each record's state, pipelined)."""
        ids = [wf_id for wf_id in ids if wf_id in self._waiting]
        if not ids:
            return []
        pipe = self._store.client.pipeline(transaction=False)
        for wf_id in ids:
            pipe.hget(self._store.keys.wf(wf_id), "state")
        states = await pipe.execute()
        return [wf_id for wf_id, state in zip(ids, states)
                if state is None or WorkflowState(s(state)) in TERMINAL_STATES]

    async def _resolve(self, ended: list[str]) -> None:
        docs = await documents(self._store, [w for w in dict.fromkeys(ended) if w in self._waiting],
                               tenant=self._tenant)
        for wf_id, doc in docs.items():
            if isinstance(doc, BaseException) or WorkflowState(doc["state"]) in TERMINAL_STATES:
                self._settle(wf_id, doc)

    async def _check(self) -> None:
        """Every `check_s`: the watched workflows that ended unseen (their end trimmed from a stream
        the reader fell behind on, or ended by an omniflow of before, which wrote no end there) or are
        gone (expired, purged)."""
        try:
            late = await self._not_live(list(self._waiting))
        except REDIS_ERRORS as exc:
            logger.warning("completions: state check failed: %s", translate(exc))
            return
        if late:
            await self._resolve(late)

    def _settle(self, wf_id: str, result: dict[str, Any] | BaseException) -> None:
        fut = self._waiting.pop(wf_id, None)
        if fut is None or fut.done():
            return
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
