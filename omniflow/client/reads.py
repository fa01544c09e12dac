"""The workflow store's reads: the workflow document, its state, its event log (read, followed,
waited on to its end), its text outputs, the listings, and the fleet reads the API and the CLI
need. A part of `Store` (`omniflow.client.store`), which it is mixed into: its methods use the
store's connection, keys and catalog."""
from __future__ import annotations

import builtins
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from omniflow.catalog import Catalog
from omniflow.client.documents import text_stages, workflow_document
from omniflow.errors import WorkflowNotFound
from omniflow.models import TERMINAL_STATES, WorkflowState
from omniflow.storage import registry
from omniflow.storage.client import RedisClient
from omniflow.storage.keys import Keys
from omniflow.storage.queued import Pipeline
from omniflow.storage.redisio import translated
from omniflow.storage.schema import (
    RecordField, StageField, event_position, log_events, s, stages_in_record, text_fields,
)

if TYPE_CHECKING:
    from omniflow.storage.listing import ListFilter, ListPage

__all__ = ["LOG_ENTRY_LIMIT", "WorkflowReads"]

LOG_ENTRY_LIMIT = 10_000


class WorkflowReads:
    """`Store`'s reads (see the module docstring)."""

    # set by `Store.__init__`
    _redis: RedisClient
    keys: Keys
    catalog: Catalog
    _text_guess: tuple[str, ...] = ()      # the text stages of the last document read (see `document`)

    @translated
    async def document(self, wf_id: str, *, tenant: str | None = None) -> dict[str, Any]:
        """The workflow document (DESIGN §5): state, stages, outputs keyed by stage.

        One round trip: the text outputs are read with the record, for the stages whose output was
        text in the last document read here (the same few recur); a record that wants others gets
        them with a second one."""
        pipe = self._redis.pipeline(transaction=False)
        guess = self._document_reads(pipe, wf_id)
        rec_raw, *guessed = await pipe.execute()
        return await self._document_of(wf_id, rec_raw, guess, guessed, tenant)

    def _document_reads(self, pipe: Pipeline, wf_id: str) -> tuple[str, ...]:
        """Queue what the document is read from on `pipe` (the record, the text outputs guessed);
        the stages whose text is read."""
        guess = self._text_guess
        pipe.hgetall(self.keys.wf(wf_id))       # (the stage fields with it: `Keys.stages`)
        for name in guess:          # after the record: as new as it, or newer (as a read after it)
            pipe.get(self.keys.out(wf_id, name))
        return guess

    async def _document_of(self, wf_id: str, rec_raw: dict[bytes, bytes], guess: tuple[str, ...],
                           guessed: list[Any], tenant: str | None) -> dict[str, Any]:
        """The document from what `_document_reads` read (and what it did not guess, read now)."""
        if not rec_raw:
            raise WorkflowNotFound(f"no workflow {wf_id}")
        rec = text_fields(rec_raw)
        if tenant is not None and rec.get("tenant") != tenant:
            raise WorkflowNotFound(f"no workflow {wf_id}")
        st = rec
        if not stages_in_record(rec):      # a workflow of before
            st = text_fields(await self._redis.hgetall(self.keys.stages_legacy(wf_id)))
        wanted = text_stages(rec)
        texts = {name: s(v) for name, v in zip(guess, guessed) if name in wanted}
        missing = [name for name in wanted if name not in texts]
        if missing:
            vals = await self._redis.mget([self.keys.out(wf_id, name) for name in missing])
            texts.update({name: s(v) for name, v in zip(missing, vals)})
        if tuple(wanted) != guess:
            self._text_guess = tuple(wanted)
        webhook = await self._webhook_view(wf_id, rec.get("webhook") or "")
        return workflow_document(wf_id, rec, st, texts, webhook)

    async def _webhook_view(self, wf_id: str, url: str) -> dict[str, Any] | None:
        """The webhook part of the document: its URL, the delivery outcome so far and every attempt."""
        if not url:
            return None
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.webhook(wf_id))
        pipe.lrange(self.keys.webhook_attempts(wf_id), 0, -1)
        raw, attempts = await pipe.execute()
        rec = text_fields(raw)
        nxt = rec.get("next_attempt_ms") if rec.get("outcome") == "retried" else None
        return {"url": url, "outcome": rec.get("outcome") or "pending",
                "attempts": [json.loads(a) for a in attempts],
                "next_attempt_at": int(nxt) / 1000 if nxt else None}

    @translated
    async def state(self, wf_id: str) -> WorkflowState | None:
        raw = await self._redis.hget(self.keys.wf(wf_id), "state")
        return WorkflowState(s(raw)) if raw else None

    @translated
    async def last_event(self, wf_id: str) -> tuple[str, dict[str, str]] | None:
        """The newest event of the workflow's event log, with its id (None when it has none)."""
        last = await self._redis.xrevrange(self.keys.log(wf_id), count=1)
        return log_events(s(last[0][0]), last[0][1])[-1] if last else None

    @translated
    async def read_log(self, wf_id: str, *, after: str = "0-0", count: int = LOG_ENTRY_LIMIT,
                       block_ms: int | None = None, whole: bool = False) -> list[tuple[str, dict[str, str]]]:
        """Event-log events after the event `after` (an event id: `log_events`), from at most `count`
        entries; with `block_ms`, wait for the next ones when there are none yet. `whole`: every event
        of the entry of `after` has been read (the next one is in a later entry: one read less)."""
        key = self.keys.log(wf_id)
        entry = after.partition(".")[0]
        if after != "0-0" and not whole:
            # the entry of `after` itself too: the events it holds after that one
            cut = event_position(after)
            entries = await self._redis.xrange(key, min=entry, count=count)
            events = [ev for eid, fields in entries for ev in log_events(s(eid), fields)
                      if event_position(ev[0]) > cut]
            if events or block_ms is None:
                return events
        if block_ms is None:
            entries = await self._redis.xrange(key, min=f"({entry}" if entry != "0-0" else "-", count=count)
        else:
            reply = await self._redis.xread({key: entry}, count=count, block=block_ms)
            entries = reply[0][1] if reply else []
        return [ev for eid, fields in entries for ev in log_events(s(eid), fields)]

    async def follow(self, wf_id: str, *, after: str = "0-0", block_ms: int = 5_000,
                     timeout_s: float | None = None) -> AsyncIterator[tuple[str, dict[str, str]]]:
        """Every log event from `after` until (and including) the terminal one."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        whole = False           # every event of the entry of `after` read (after the first read)
        while True:
            wait = block_ms
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                wait = max(1, min(block_ms, int(left * 1000)))
            entries = await self.read_log(wf_id, after=after, block_ms=wait, whole=whole)
            if not entries and after == "0-0" and await self.state(wf_id) is None:
                raise WorkflowNotFound(f"no workflow {wf_id}")
            for eid, fields in entries:
                after = eid
                yield eid, fields
                if fields.get("t") == "terminal":
                    return
            whole = whole or bool(entries)

    @translated
    async def wait(self, wf_id: str, *, timeout_s: float | None = None, tenant: str | None = None) -> dict[str, Any]:
        """Block (no polling) until the workflow is terminal or the timeout passes; its document.

        Blocks on `<wf>:done`, which gets its one entry together with the terminal log entry:
        one wake-up per wait, however much the workflow logs meanwhile."""
        # is it there, visible, and still running? (the whole document only once it has ended)
        state, owner = await self._redis.hmget(self.keys.wf(wf_id), ["state", "tenant"])
        if state is None or (tenant is not None and s(owner) != tenant):
            raise WorkflowNotFound(f"no workflow {wf_id}")
        if WorkflowState(s(state)) in TERMINAL_STATES:
            return await self.document(wf_id, tenant=tenant)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_ms = 5_000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait_ms = max(1, min(wait_ms, int(left * 1000)))
            # the document is read in the same round trip, right after the blocking read is served
            # (a pipeline runs in order on its connection): the record as the terminal left it
            pipe = self._redis.pipeline(blocking=True)
            pipe.xread({self.keys.done(wf_id): "0-0"}, count=1, block=wait_ms)
            guess = self._document_reads(pipe, wf_id)
            ended, rec_raw, *guessed = await pipe.execute()
            if ended:
                return await self._document_of(wf_id, rec_raw, guess, guessed, tenant)
            if not rec_raw:       # expired or purged while we waited
                raise WorkflowNotFound(f"no workflow {wf_id}")
        return await self.document(wf_id, tenant=tenant)

    @translated
    async def text(self, wf_id: str, stage: str) -> str:
        """A final text stage's output so far: in the record (`StageField.text`), or for a workflow of
        before in its `out` key."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(self.keys.wf(wf_id), RecordField.KEY_OUTPUTS, StageField.text(stage))
        pipe.get(self.keys.out(wf_id, stage))
        (keyed, in_record), in_key = await pipe.execute()
        return s(in_record) if keyed is not None else s(in_key)

    @translated
    async def list_workflows(self, flt: ListFilter, *, offset: int = 0, limit: int = 50) -> ListPage:
        """One page of the workflows matching `flt` (the listing indexes: `omniflow.storage.listing`)."""
        from omniflow.storage import listing  # imported here: listing builds on this module's helpers

        return await listing.query(self._redis, self.keys, flt, offset=offset, limit=limit)

    @translated
    async def state_counts(self) -> dict[str, int]:
        """Workflows per state, from the listing indexes."""
        from omniflow.storage import listing

        return await listing.state_counts(self._redis, self.keys)

    async def list(self, *, state: str | None = None, tenant: str | None = None, offset: int = 0,
                   limit: int = 50) -> builtins.list[dict[str, Any]]:
        """One page of workflows, newest first (the rows of `list_workflows`)."""
        from omniflow.storage.listing import ListFilter

        return (await self.list_workflows(ListFilter(state=state, tenant=tenant), offset=offset, limit=limit)).rows

    # ---------------------------------------------------------------- for the API and the CLI
    @translated
    async def ping(self) -> None:
        """Raise `RedisUnavailable` unless Redis answers."""
        await self._redis.ping()

    @translated
    async def live_workers(self, *, claiming: bool = False) -> dict[str, int]:
        """Live workers per stage of the pipelines this store serves: members of `<p>:workers` whose
        lease (score, ms) is in the future and that claim from that stage's queue. A worker serving
        several stages (`--stage a,b`, `up --colocate`) counts for each. With several pipelines, a
        stage they share counts the workers of the pipeline that has fewest (each needs one).
        `claiming`: only those that take new work (not drained: readiness)."""
        served = await registry.served(self._redis, self.keys, claiming=claiming)
        counts: dict[str, int] = {}
        for pipe in self.catalog:
            for name in pipe.order:
                n = len(served.get(pipe.queue(name), ()))
                counts[name] = min(counts.get(name, n), n)
        return counts
