"""The workflow store: what clients (the Python client, the API, the CLI, the
batch runner) do with workflows.

Submit and abort (the two transitions a client triggers directly) run their
Lua scripts here; the workflow document, event log, outputs, listings and the
fleet reads the API needs are read here. Every method talks to Redis through
`omniflow.storage.redisio`, so its errors come out translated (`omniflow.errors`).
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator
import builtins
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from redis.asyncio import Redis

from omniflow.storage import cells, redisio, scripts
from omniflow.storage.batcher import Batcher
from omniflow.config import Settings
from omniflow.errors import (AdmissionRefused, ConfigError, FairShareRefused, IdempotencyConflict, InvalidRequest, NotReady,
                             DeadlineUnmeetable, PriorityNotAllowed, RedisRefused, ScriptError, WorkflowNotFound, WorkflowRetired)
from omniflow.storage.keys import Keys, finalize_suffixes
from omniflow.fairness import allowed, cap, parse_allowances
from omniflow.models import TERMINAL_STATES, Priority, SubmitRequest, Submitted, WorkflowState
from omniflow.storage.fairshare import FairShare
from omniflow.client.shedding import Predictor
from omniflow.pipeline import ShedMode
from omniflow.pipeline import Pipeline, Plan
from omniflow.storage.redisio import connect, translated
from omniflow.client.documents import text_stages, workflow_document
from omniflow.client.realtime import RealtimeSessions
from omniflow.storage.schema import csv, decode_fields, now_ms, s

if TYPE_CHECKING:
    from omniflow.storage.listing import ListFilter, ListPage

__all__ = ["LOG_ENTRY_LIMIT", "Store", "abort_call", "connect", "new_id"]

LOG_ENTRY_LIMIT = 10_000
#: a submit refused for memory is over capacity, like one over `max_in_flight`
SUBMIT_OOM_RETRY_AFTER_S = 1.0


def new_id(cell: int = 0) -> str:
    """A fresh workflow id in `cell` (`omniflow.storage.cells`)."""
    return cells.new_id(cell)


def body_hash(req: SubmitRequest) -> str:
    """A digest of everything a request asks for except its idempotency key (canonical JSON)."""
    body = json.dumps(req.model_dump(mode="json", exclude={"request_id"}), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def check_same_body(wf_id: str, req: SubmitRequest, stored_hash: str) -> None:
    """A reused idempotency key must come with the same request (records without a hash predate the check)."""
    if stored_hash and stored_hash != body_hash(req):
        raise IdempotencyConflict(
            f"request_id {req.request_id!r} was used for workflow {wf_id} with a different request; "
            "use a fresh request_id for a different request")


def abort_call(keys: Keys, settings: Settings, final_suffixes: tuple[str, ...], wf_id: str, *,
               state: WorkflowState, reason: str, stage: str = "") -> tuple[Any, ...]:
    """The `abort.lua` call retiring `wf_id` (a client's abort, the reconciler's deadline sweep);
    `final_suffixes`: `keys.finalize_suffixes` of the pipeline."""
    return scripts.evalsha_args(
        "abort", [keys.wf(wf_id), keys.inflight(keys.cell_of(wf_id)), *keys.finalize_keys(wf_id, final_suffixes)],
        [settings.prefix, now_ms(), state.value, reason, stage, settings.tombstone_ttl_s, settings.result_ttl_s])


def limit_note(settings: Settings, priority: Priority) -> str:
    """How much of the limit a class may fill, when that is not all of it."""
    limit = settings.admission_limit(priority)
    return "" if limit >= settings.max_in_flight else f" ({priority.value} requests may fill {limit} of it)"


@dataclass(frozen=True)
class Degraded:
    """A request that runs with fewer outputs than it asked for (deadline shedding)."""

    reason: str
    kept: tuple[str, ...]
    dropped: tuple[str, ...]


@dataclass(frozen=True)
class _PlanParts:
    plan: Plan
    fields: tuple[str, ...]        # record fields fixed by the plan (flat name/value pairs)
    stages: str
    admit: str
    params: str                    # the stages' params JSON when the request overrides none


class Store:
    """Client-side operations on workflows (used by the client, API, CLI and batch runner)."""

    def __init__(self, redis: Redis, settings: Settings, pipeline: Pipeline, *, batcher: Batcher | None = None) -> None:
        self._plans: dict[tuple[str, ...] | None, _PlanParts] = {}
        self._egress: Any = None        # the webhook egress policy, built on first use
        self.redis = redis
        self.batcher = batcher          # when set, submits are group-committed (many callers, few round trips)
        self.settings = settings
        self.pipeline = pipeline
        self.keys = Keys.of(settings, redis)
        redisio.require_replicas(redis, settings.wait_replicas, settings.wait_timeout_ms)
        if settings.max_in_flight < self.keys.cells:
            raise ConfigError(f"OMNIFLOW_MAX_IN_FLIGHT={settings.max_in_flight} is below the number of cells "
                              f"({self.keys.cells}): every cell must admit at least one workflow")
        self._final_suffixes = finalize_suffixes(pipeline)
        self.allowances = parse_allowances(settings.tenant_priorities)
        self.fair = FairShare(redis, settings, self.keys)
        self.predictor = Predictor(self)
        self.realtime = RealtimeSessions(redis, self.keys, ttl_s=settings.realtime_session_ttl_s)

    # ---------------------------------------------------------------- submit
    @translated
    async def submit(self, req: SubmitRequest, *, tenant: str = "default", wf_id: str | None = None,
                     priority: Priority = Priority.API) -> Submitted:
        """Create, admit and pre-submit a workflow (one `submit.lua` call). `priority`: the entry
        point's default class, used when the request names none (`req.priority`).

        A server out of memory refuses it like admission control does: `AdmissionRefused` (busy);
        so does a tenant over its fair share while the deployment is busy; a priority above the
        tenant's allowance is `PriorityNotAllowed`."""
        if self.settings.fair_share:
            if self.fair.must_refresh:      # shares are being enforced: decide on a fresh view
                await self.fair.refresh()
            elif self.fair.stale:
                self.fair.refresh_soon()
        shed = None
        if self.pipeline.spec.shedding.on_late is not ShedMode.OFF:
            shed = await self._shed(req, tenant, priority)
        keys, args = self.submit_call(req, tenant=tenant, wf_id=wf_id, priority=priority, degraded=shed)
        try:
            reply = await self._submit_script(keys, args)
            if (s(reply[0]) == scripts.SubmitResult.BUSY and len(reply) == 2 and wf_id is None
                    and not req.request_id and self.keys.cells > 1):
                # this cell is full: one more try in another (the limit is shared evenly by cells)
                keys, args = self.submit_call(req, tenant=tenant, wf_id=self.other_cell_id(args[1]),
                                              priority=priority, degraded=shed)
                reply = await self._submit_script(keys, args)
        except RedisRefused as exc:
            raise self.refused(exc) from exc
        try:
            result = self.submitted(reply, tenant=tenant, priority=self.priority_of(req, tenant, priority))
        except AdmissionRefused:
            await self.fair.refused(tenant)
            raise
        if result.existing:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(self.keys.wf(result.id), ["state", "body_hash"])
            pipe.exists(self.keys.tomb(result.id))
            (raw_state, stored_hash), retired = await pipe.execute()
            if retired:
                raise self.retired(result.id)
            check_same_body(result.id, req, s(stored_hash))
            state = s(raw_state) or WorkflowState.PENDING.value
            return Submitted(id=result.id, state=WorkflowState(state), existing=True)
        if self.settings.wait_aof:
            await self._wait_aof()
        if shed is not None:
            result = result.model_copy(update={"degraded": shed.reason, "dropped": list(shed.dropped)})
        return result

    async def _shed(self, req: SubmitRequest, tenant: str, default: Priority) -> Degraded | None:
        """Deadline-aware shedding (the pipeline's `shedding`): None when the queues predict the
        request meets its deadline; a `Degraded` (fewer outputs) when that one would and the pipeline
        degrades; else `DeadlineUnmeetable`."""
        shed = self.pipeline.spec.shedding
        prio = self.priority_of(req, tenant, default)
        deadline_s = req.deadline_s or self.settings.default_deadline_s
        limit_s = deadline_s * shed.margin
        await self.predictor.refresh()
        asked = list(req.output_modalities) if req.output_modalities is not None else sorted(self.pipeline.modalities())
        predicted = self.predictor.predict_s(self._plan_parts(tuple(asked)).plan.stages, prio)
        if predicted <= limit_s:
            return None
        why = (f"the stage queues predict {predicted:.1f}s to {'+'.join(asked)}, over the deadline of "
               f"{deadline_s:g}s")
        if shed.on_late is ShedMode.DEGRADE:
            kept = [m for m in asked if m in shed.degrade_to]
            if kept and kept != asked:
                if self.predictor.predict_s(self._plan_parts(tuple(kept)).plan.stages, prio) <= limit_s:
                    dropped = tuple(m for m in asked if m not in kept)
                    return Degraded(reason=f"{why}: runs without {'+'.join(dropped)}", kept=tuple(kept),
                                    dropped=dropped)
        raise DeadlineUnmeetable(f"{why}; retry later or with a longer deadline_s",
                                 retry_after_s=max(1.0, min(30.0, predicted - limit_s)))

    def other_cell_id(self, refused_id: Any) -> str:
        """A fresh id in a cell other than that of `refused_id` (its cell was full)."""
        taken = cells.cell_of(s(refused_id))
        return new_id((taken + 1 + cells.pick_cell(self.keys.cells - 1)) % self.keys.cells)

    async def _submit_script(self, keys: list[str], args: list[Any]) -> Any:
        if self.batcher is not None:
            return await self.batcher.script("submit", keys, args, retry_refused=False)
        return await redisio.script(self.redis, "submit", keys, args)

    def priority_of(self, req: SubmitRequest, tenant: str, default: Priority = Priority.API) -> Priority:
        """The class a request runs in: the one it names (refused over the tenant's allowance), else
        the entry point's default lowered to the allowance."""
        allowance = self.allowances.get(tenant, Priority(self.settings.default_max_priority))
        if req.priority is None:
            return cap(default, allowance)
        if not allowed(req.priority, allowance):
            raise PriorityNotAllowed(f"priority {req.priority.value!r} is above what tenant {tenant!r} may ask for "
                                     f"({allowance.value!r} and below)")
        return req.priority

    def submit_call(self, req: SubmitRequest, *, tenant: str = "default", wf_id: str | None = None,
                    priority: Priority = Priority.API,
                    degraded: Degraded | None = None) -> tuple[list[str], list[Any]]:
        """Validate a request and build the KEYS and ARGV of its `submit.lua` call (no I/O but the
        fair-share view's, read beforehand by `submit`). `degraded`: run it with fewer outputs."""
        prio = self.priority_of(req, tenant, priority)
        original = req
        if degraded is not None:
            req = req.model_copy(update={"output_modalities": list(degraded.kept)})
        parts = self._plan_parts(tuple(req.output_modalities) if req.output_modalities is not None else None)
        if len(req.input.text) > self.settings.max_prompt_chars:
            raise InvalidRequest(f"input.text: {len(req.input.text)} characters; the limit is {self.settings.max_prompt_chars}")
        unknown = sorted(set(req.stage_params) - set(self.pipeline.stages))
        if unknown:
            raise InvalidRequest(f"stage_params: unknown stage(s) {unknown}; stages are {list(self.pipeline.order)}")
        deadline_s = req.deadline_s or self.settings.default_deadline_s
        if deadline_s > self.settings.max_deadline_s:
            raise InvalidRequest(f"deadline_s: {deadline_s} is over the limit of {self.settings.max_deadline_s}")
        if wf_id is None:
            # a request id fixes the cell (a repeated request must meet its workflow); else any cell
            cell = (self.keys.idem_cell(tenant, req.request_id) if req.request_id
                    else cells.pick_cell(self.keys.cells))
            wf_id = new_id(cell)
        cell = cells.cell_of(wf_id)
        now = now_ms()
        if req.stage_params:
            params = json.dumps({st: {**self.pipeline.stages[st].params, **req.stage_params.get(st, {})}
                                 for st in parts.plan.stages})
        else:
            params = parts.params
        record = [
            "tenant", tenant,
            "request_id", req.request_id or "",
            "input", req.input.model_dump_json(),
            "params", params,
            "webhook", req.webhook_url or "",
            "prio", prio.value,
            *parts.fields,
        ]
        if req.webhook_url:
            self._check_webhook(req.webhook_url)
        if req.request_id:     # what a reuse of the key is compared with (409 idempotency_conflict)
            record += ["body_hash", body_hash(original)]
        if degraded is not None:
            record += ["degraded", degraded.reason, "dropped", ",".join(degraded.dropped)]
        idem_key = self.keys.idem(tenant, req.request_id or "-", cell)
        wf = self.keys.wf(wf_id)
        keys = [wf, f"{wf}:stages", f"{wf}:log", self.keys.inflight(cell), self.keys.tomb(wf_id), idem_key,
                self.keys.all_wf(cell), self.keys.tenant_index(tenant, cell), self.keys.tenants(cell),
                self.keys.state_index(WorkflowState.PENDING.value, cell), self.keys.tenant_inflight(cell),
                *(self.keys.tasks(st, cell, prio.value) for st in parts.plan.admit)]
        args = [self.settings.prefix, wf_id, now, now + int(deadline_s * 1000),
                cells.cell_limit(self.settings.admission_limit(prio), self.keys.cells, cell),
                self.settings.idempotency_ttl_s if req.request_id else 0,
                parts.stages, parts.admit, len(record) // 2, *record, *self.fair.submit_args(tenant, cell)]
        return keys, args

    def _check_webhook(self, url: str) -> None:
        """Refuse a webhook URL that can never be delivered, as far as that is knowable without DNS."""
        from omniflow.jobs.egress import EgressPolicy, EgressRefused, check_url_static

        if self._egress is None:
            self._egress = EgressPolicy.from_settings(self.settings)
        try:
            check_url_static(url, self._egress)
        except EgressRefused as exc:
            raise InvalidRequest(f"webhook_url: {exc}") from None

    def _plan_parts(self, modalities: tuple[str, ...] | None) -> _PlanParts:
        """What a submit writes that depends only on the pipeline and the requested modalities
        (computed once per modality set: submits are the one hot call a client makes)."""
        parts = self._plans.get(modalities)
        if parts is None:
            plan = self.pipeline.plan(modalities)
            edges = [f"{e.src}:{e.dst}" for st in plan.stages for e in self.pipeline.upstream(st, plan.stages)]
            kinds = [f"{st}={self.pipeline.stages[st].final_output}" for st in plan.finals]
            fields = ("pipeline", self.pipeline.name, "pipeline_hash", self.pipeline.digest,
                      "stages", ",".join(plan.stages), "finals", ",".join(plan.finals), "kinds", ",".join(kinds),
                      "edges", ",".join(edges), "groups", plan.record_groups())
            parts = _PlanParts(plan=plan, fields=fields, stages=",".join(plan.stages), admit=",".join(plan.admit),
                               params=json.dumps({st: dict(self.pipeline.stages[st].params) for st in plan.stages}))
            if len(self._plans) < 64:
                self._plans[modalities] = parts
        return parts

    @staticmethod
    def refused(exc: RedisRefused) -> Exception:
        """What a submit refused by the server means to its caller: busy when out of memory."""
        if exc.refusal == "OOM":
            return AdmissionRefused("Redis is out of memory (maxmemory reached); retry later",
                                    retry_after_s=SUBMIT_OOM_RETRY_AFTER_S)
        return exc

    def submitted(self, reply: Any, *, tenant: str = "default", priority: Priority = Priority.API) -> Submitted:
        """Map a `submit.lua` reply to the result, or to the error it means."""
        code, ident = s(reply[0]), s(reply[1])
        if code == scripts.SubmitResult.OK:
            if len(reply) > 2:
                self.fair.admitted(cells.cell_of(ident), int(reply[2]))
            return Submitted(id=ident, state=WorkflowState.PENDING)
        if code == scripts.SubmitResult.EXISTING:
            return Submitted(id=ident, state=WorkflowState.PENDING, existing=True)
        if code == scripts.SubmitResult.RETIRED:
            raise self.retired(ident)
        if code == scripts.SubmitResult.EXISTS:
            raise InvalidRequest(f"workflow id {ident} already exists")
        if len(reply) > 2 and s(reply[2]) == "tenant":
            held = s(reply[3]) if self.keys.cells == 1 else str(self.fair.live(tenant))
            raise FairShareRefused(
                f"tenant {tenant!r} is over its fair share: it holds {held} live "
                f"workflow(s) and may hold {min(self.fair.share(tenant), self.fair.cap())} of max_in_flight "
                f"{self.settings.max_in_flight} while the deployment is busy; retry later",
                retry_after_s=1.0)
        where = "" if self.keys.cells == 1 else f" in the cell tried (max_in_flight is split over {self.keys.cells} cells)"
        raise AdmissionRefused(
            f"{ident} workflows in flight{where}, the limit is {self.settings.max_in_flight}"
            f"{limit_note(self.settings, priority)}; retry later",
            retry_after_s=1.0,
        )

    @staticmethod
    def retired(wf_id: str) -> WorkflowRetired:
        return WorkflowRetired(f"workflow {wf_id} is retired (aborted or failed) and cannot be resubmitted; "
                               "submit again with a fresh request_id")

    async def _wait_aof(self) -> None:
        try:
            await redisio.call(self.redis, "WAITAOF", 1, 0, 1000)
        except ScriptError as exc:      # servers before 7.2 lack it
            raise ConfigError(f"wait_aof is on but the server refused WAITAOF: {exc}") from exc

    # ---------------------------------------------------------------- abort
    @translated
    async def abort(self, wf_id: str, *, tenant: str | None = None, reason: str = "aborted by client",
                    state: WorkflowState = WorkflowState.ABORTED, stage: str = "") -> str:
        """Abort a live workflow. Returns the state it ends in (already-terminal ones are left as they are)."""
        if tenant is not None:
            await self._check_tenant(wf_id, tenant)
        reply = await redisio.call(self.redis, *abort_call(self.keys, self.settings, self._final_suffixes, wf_id,
                                                           state=state, reason=reason, stage=stage))
        code = s(reply[0])
        if code == "gone":
            raise WorkflowNotFound(f"no workflow {wf_id}")
        return state.value if code == "ok" else s(reply[1])

    async def _check_tenant(self, wf_id: str, tenant: str) -> None:
        owner = await self.redis.hget(self.keys.wf(wf_id), "tenant")
        if owner is None or s(owner) != tenant:
            raise WorkflowNotFound(f"no workflow {wf_id}")

    # ---------------------------------------------------------------- read
    @translated
    async def document(self, wf_id: str, *, tenant: str | None = None) -> dict[str, Any]:
        """The workflow document (DESIGN §5): state, stages, outputs keyed by stage."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.wf(wf_id))
        pipe.hgetall(self.keys.stages(wf_id))
        rec_raw, stages_raw = await pipe.execute()
        if not rec_raw:
            raise WorkflowNotFound(f"no workflow {wf_id}")
        rec = {s(k): s(v) for k, v in rec_raw.items()}
        if tenant is not None and rec.get("tenant") != tenant:
            raise WorkflowNotFound(f"no workflow {wf_id}")
        st = {s(k): s(v) for k, v in stages_raw.items()}
        wanted = text_stages(rec)
        texts = {}
        if wanted:
            vals = await self.redis.mget([self.keys.out(wf_id, name) for name in wanted])
            texts = {name: s(v) for name, v in zip(wanted, vals)}
        webhook = await self._webhook_view(wf_id, rec.get("webhook") or "")
        return workflow_document(wf_id, rec, st, texts, webhook)

    async def _webhook_view(self, wf_id: str, url: str) -> dict[str, Any] | None:
        """The webhook part of the document: its URL, the delivery outcome so far and every attempt."""
        if not url:
            return None
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.webhook(wf_id))
        pipe.lrange(self.keys.webhook_attempts(wf_id), 0, -1)
        raw, attempts = await pipe.execute()
        rec = {s(k): s(v) for k, v in (raw or {}).items()}
        nxt = rec.get("next_attempt_ms") if rec.get("outcome") == "retried" else None
        return {"url": url, "outcome": rec.get("outcome") or "pending",
                "attempts": [json.loads(a) for a in attempts],
                "next_attempt_at": int(nxt) / 1000 if nxt else None}

    @translated
    async def state(self, wf_id: str) -> WorkflowState | None:
        raw = await self.redis.hget(self.keys.wf(wf_id), "state")
        return WorkflowState(s(raw)) if raw else None

    @translated
    async def last_event(self, wf_id: str) -> tuple[str, dict[str, str]] | None:
        """The newest entry of the workflow's event log (None when it has none)."""
        last = await self.redis.xrevrange(self.keys.log(wf_id), count=1)
        return (s(last[0][0]), decode_fields(last[0][1])) if last else None

    @translated
    async def read_log(self, wf_id: str, *, after: str = "0-0", count: int = LOG_ENTRY_LIMIT,
                       block_ms: int | None = None) -> list[tuple[str, dict[str, str]]]:
        """Event-log entries after `after`; with `block_ms`, wait for the next ones."""
        key = self.keys.log(wf_id)
        if block_ms is None:
            entries = await self.redis.xrange(key, min=f"({after}" if after != "0-0" else "-", count=count)
        else:
            reply = await self.redis.xread({key: after}, count=count, block=block_ms)
            entries = reply[0][1] if reply else []
        return [(s(eid), decode_fields(fields)) for eid, fields in entries]

    async def follow(self, wf_id: str, *, after: str = "0-0", block_ms: int = 5_000,
                     timeout_s: float | None = None) -> AsyncIterator[tuple[str, dict[str, str]]]:
        """Every log entry from `after` until (and including) the terminal one."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait = block_ms
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                wait = max(1, min(block_ms, int(left * 1000)))
            entries = await self.read_log(wf_id, after=after, block_ms=wait)
            if not entries and after == "0-0" and await self.state(wf_id) is None:
                raise WorkflowNotFound(f"no workflow {wf_id}")
            for eid, fields in entries:
                after = eid
                yield eid, fields
                if fields.get("t") == "terminal":
                    return

    @translated
    async def wait(self, wf_id: str, *, timeout_s: float | None = None, tenant: str | None = None) -> dict[str, Any]:
        """Block (no polling) until the workflow is terminal or the timeout passes; its document.

        Blocks on `<wf>:done`, which gets its one entry together with the terminal log entry:
        one wake-up per wait, however much the workflow logs meanwhile."""
        doc = await self.document(wf_id, tenant=tenant)
        if WorkflowState(doc["state"]) in TERMINAL_STATES:
            return doc
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_ms = 5_000
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait_ms = max(1, min(wait_ms, int(left * 1000)))
            if await self.redis.xread({self.keys.done(wf_id): "0-0"}, count=1, block=wait_ms):
                break
            if await self.state(wf_id) is None:       # expired or purged while we waited
                raise WorkflowNotFound(f"no workflow {wf_id}")
        return await self.document(wf_id, tenant=tenant)

    @translated
    async def text(self, wf_id: str, stage: str) -> str:
        return s(await self.redis.get(self.keys.out(wf_id, stage)))

    @translated
    async def audio(self, wf_id: str, stage: str | None = None) -> tuple[int, np.ndarray]:
        """(sample_rate, int16 PCM) of a final audio stage; `NotReady` while it is still running."""
        doc = await self.document(wf_id)
        audio = {k: v for k, v in doc["outputs"].items() if v["type"] == "audio"}
        if not audio:
            raise WorkflowNotFound(f"workflow {wf_id} has no audio output")
        stage = stage or next(iter(audio))
        if stage not in audio:
            raise WorkflowNotFound(f"workflow {wf_id} has no audio output from stage {stage!r}")
        if audio[stage]["partial"] and doc["state"] in ("pending", "running"):
            raise NotReady(f"audio of workflow {wf_id} is not ready (stage {stage} is {doc['stages'][stage]['status']})")
        entries = await self.redis.xrange(self.keys.out(wf_id, stage))
        pcm = [np.frombuffer(f[b"pcm"], dtype="<i2") for _, f in entries]
        samples = np.concatenate(pcm) if pcm else np.zeros(0, dtype="<i2")
        return int(audio[stage]["sample_rate"] or 0), samples

    @translated
    async def list_workflows(self, flt: ListFilter, *, offset: int = 0, limit: int = 50) -> ListPage:
        """One page of the workflows matching `flt` (the listing indexes: `omniflow.storage.listing`)."""
        from omniflow.storage import listing  # imported here: listing builds on this module's helpers

        return await listing.query(self.redis, self.keys, flt, offset=offset, limit=limit)

    @translated
    async def state_counts(self) -> dict[str, int]:
        """Workflows per state, from the listing indexes."""
        from omniflow.storage import listing

        return await listing.state_counts(self.redis, self.keys)

    async def list(self, *, state: str | None = None, tenant: str | None = None, offset: int = 0,
                   limit: int = 50) -> builtins.list[dict[str, Any]]:
        """One page of workflows, newest first (the rows of `list_workflows`)."""
        from omniflow.storage.listing import ListFilter

        return (await self.list_workflows(ListFilter(state=state, tenant=tenant), offset=offset, limit=limit)).rows

    # ---------------------------------------------------------------- reads for the API and the CLI
    @translated
    async def ping(self) -> None:
        """Raise `RedisUnavailable` unless Redis answers."""
        await self.redis.ping()

    @translated
    async def audio_chunks(self, wf_id: str, stage: str, *, after: str = "-") -> builtins.list[tuple[str, bytes, int]]:
        """Audio chunks of a final stage after entry `after` (exclusive unless '-'): (entry id, PCM, rate)."""
        start = after if after == "-" else f"({after}"
        return [(s(eid), bytes(f[b"pcm"]), int(s(f.get(b"sr")) or 0))
                for eid, f in await self.redis.xrange(self.keys.out(wf_id, stage), min=start)]

    @translated
    async def live_workers(self, *, claiming: bool = False) -> dict[str, int]:
        """Live workers per stage of the pipeline: members of `<p>:workers` whose lease (score, ms) is
        in the future. A worker serving several stages (`--stage a,b`, `up --colocate`) counts for each.
        `claiming`: only those that take new work (not drained: readiness)."""
        ids = await self.redis.zrangebyscore(self.keys.workers, f"({now_ms()}", "+inf")
        counts = dict.fromkeys(self.pipeline.order, 0)
        if ids:
            pipe = self.redis.pipeline(transaction=False)
            for worker_id in ids:
                pipe.hmget(self.keys.worker_info(s(worker_id)), "stage", "drain")
            for served, drain in await pipe.execute():
                if claiming and drain:
                    continue
                for name in csv(served):
                    if name in counts:
                        counts[name] += 1
        return counts
