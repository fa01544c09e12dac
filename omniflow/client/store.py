"""The workflow store: what clients (the Python client, the API, the CLI, the
batch runner) do with workflows.

Submit and abort (the two transitions a client triggers directly) run their
Lua scripts here; the workflow document, event log, outputs, listings and the
fleet reads the API needs are read by `Store` too, in two parts mixed into it:
`omniflow.client.reads` (the document, the log, waits, listings) and
`omniflow.client.media` (streamed audio input, audio outputs). Every method talks
to Redis through `omniflow.storage.redisio`, so its errors come out translated
(`omniflow.errors`).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow import tracing
from omniflow.catalog import Catalog
from omniflow.storage import cells, redisio, registry
from omniflow.storage.batcher import Batcher
from omniflow.config import Settings
from omniflow.errors import (AdmissionRefused, ConfigError, DeadlineUnmeetable, FairShareRefused, IdempotencyConflict,
                             InvalidRequest, PriorityNotAllowed, RedisRefused, UnknownPipeline, ScriptError,
                             WorkflowNotFound, WorkflowRetired)
from omniflow.storage.keys import FinalizePlan, Keys, finalize_plan
from omniflow.fairness import allowed, cap, parse_allowances
from omniflow.models import Priority, SubmitRequest, Submitted, WorkflowState
from omniflow.storage.fairshare import FairShare
from omniflow.client.shedding import Predictor
from omniflow.pipeline import INPUT_SRC, Pipeline, Plan, ShedMode
from omniflow.storage.redisio import connect, translated
from omniflow.client.media import StreamedMedia
from omniflow.client.reads import LOG_ENTRY_LIMIT, WorkflowReads
from omniflow.client.realtime import RealtimeSessions
from omniflow.storage.schema import RecordField, now_ms, s
from omniflow.storage.transitions import Call, admission
from omniflow.storage.transitions.admission import AbortResult, SubmitResult

__all__ = ["LOG_ENTRY_LIMIT", "Store", "abort_call", "connect", "new_id"]

#: a submit refused for memory is over capacity, like one over `max_in_flight`
SUBMIT_OOM_RETRY_AFTER_S = 1.0
FAIR_RETRY_AFTER_S = 1.0           # what a tenant over its fair share is told to wait (Retry-After)


def new_id(cell: int = 0) -> str:
    """A fresh workflow id in `cell` (`omniflow.storage.cells`)."""
    return cells.new_id(cell)


def body_hash(req: SubmitRequest) -> str:
    """A digest of everything a request asks for except its idempotency key (canonical JSON)."""
    raw = req.model_dump(mode="json", exclude={"request_id"})
    if raw["input"].get("audio") is None:       # text requests hash as they did before audio input existed
        raw["input"].pop("audio", None)
    body = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def check_same_body(wf_id: str, req: SubmitRequest, stored_hash: str) -> None:
    """A reused idempotency key must come with the same request (records without a hash predate the check)."""
    if stored_hash and stored_hash != body_hash(req):
        raise IdempotencyConflict(
            f"request_id {req.request_id!r} was used for workflow {wf_id} with a different request; "
            "use a fresh request_id for a different request")


def abort_call(keys: Keys, settings: Settings, plan: FinalizePlan, wf_id: str, *,
               state: WorkflowState, reason: str, stage: str = "") -> Call:
    """The `abort.lua` call retiring `wf_id` (a client's abort, the reconciler's deadline sweep);
    `plan`: `finalize_plan` of the pipeline."""
    return admission.abort(keys, plan, wf_id, now_ms=now_ms(), state=state, reason=reason, stage=stage,
                           tombstone_ttl_s=settings.tombstone_ttl_s, result_ttl_s=settings.result_ttl_s)


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
    queues: tuple[str, ...]        # the task queues of the admitted stages (`Pipeline.queue`)


class Store(WorkflowReads, StreamedMedia):
    """Client-side operations on workflows (used by the client, API, CLI and batch runner)."""

    def __init__(self, redis: RedisClient, settings: Settings, pipeline: Pipeline | Catalog, *,
                 batcher: Batcher | None = None) -> None:
        self._plans: dict[tuple[str, tuple[str, ...] | None, str], _PlanParts] = {}
        self._egress: Any = None        # the webhook egress policy, built on first use
        self._redis = redis
        self.batcher = batcher          # when set, submits are group-committed (many callers, few round trips)
        self.settings = settings
        # the pipelines it submits to (the first is the default); others registered later are learnt
        self.catalog = pipeline if isinstance(pipeline, Catalog) else Catalog.of(pipeline)
        self.pipeline = self.catalog.default
        self.keys = Keys.of(settings, redis)
        redisio.require_replicas(redis, settings.wait_replicas, settings.wait_timeout_ms)
        if settings.max_in_flight < self.keys.cells:
            raise ConfigError(f"OMNIFLOW_MAX_IN_FLIGHT={settings.max_in_flight} is below the number of cells "
                              f"({self.keys.cells}): every cell must admit at least one workflow")
        self._finalize_plan = finalize_plan(self.pipeline)
        self._input_consumers: dict[tuple[str, int], str] = {}     # (stage, cell) -> the replica reading its input
        self.allowances = parse_allowances(settings.tenant_priorities)
        self.fair = FairShare(redis, settings, self.keys)
        self.predictor = Predictor(self)
        self.realtime = RealtimeSessions(redis, self.keys, ttl_s=settings.realtime_session_ttl_s)

    @property
    def client(self) -> RedisClient:
        """The Redis client this store talks through (errors translated; see `omniflow.storage.client`)."""
        return self._redis

    # ---------------------------------------------------------------- submit
    @translated
    async def submit(self, req: SubmitRequest, *, tenant: str = "default", wf_id: str | None = None,
                     priority: Priority = Priority.API) -> Submitted:
        """Create, admit and pre-submit a workflow (one `submit.lua` call). `priority`: the entry
        point's default class, used when the request names none (`req.priority`).

        A server out of memory refuses it like admission control does: `AdmissionRefused` (busy);
        so does a tenant over its fair share while the deployment is busy; a priority above the
        tenant's allowance is `PriorityNotAllowed`."""
        if req.pipeline and self.catalog.find(req.pipeline) is None:
            await self.pipeline_named(req.pipeline, param="pipeline")
        if self.settings.fair_share:
            held = None if wf_id is not None or req.request_id else self.fair.held(tenant)
            if held is not None:            # refused as over its share a moment ago: still is, here
                raise FairShareRefused(held, retry_after_s=FAIR_RETRY_AFTER_S)
            if self.fair.must_refresh or self.fair.never_read:
                # shares are being enforced, or this process has no view yet (a fresh API process
                # would admit its first burst as if its tenant were alone): decide on a fresh view
                await self.fair.refresh_shared()
            elif self.fair.stale:
                self.fair.refresh_soon()
        shed = None
        if self.catalog.resolve(req.pipeline, param="pipeline").spec.shedding.on_late is not ShedMode.OFF:
            shed = await self._shed(req, tenant, priority)
        call, tried = self.submit_call(req, tenant=tenant, wf_id=wf_id, priority=priority, degraded=shed)
        try:
            reply = await self._submit_script(call)
            if (s(reply[0]) == SubmitResult.BUSY and len(reply) == 2 and wf_id is None
                    and not req.request_id and self.keys.cells > 1):
                # this cell is full: one more try in another (the limit is shared evenly by cells)
                call, tried = self.submit_call(req, tenant=tenant, wf_id=self.other_cell_id(tried),
                                               priority=priority, degraded=shed)
                reply = await self._submit_script(call)
        except RedisRefused as exc:
            raise self.refused(exc) from exc
        try:
            result = self.submitted(reply, tenant=tenant, priority=self.priority_of(req, tenant, priority))
        except AdmissionRefused as exc:
            if isinstance(exc, FairShareRefused):
                self.fair.hold(tenant, str(exc))
            await self.fair.refused(tenant)
            raise
        if result.existing:
            pipe = self._redis.pipeline(transaction=False)
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
        pipeline = self.catalog.resolve(req.pipeline, param="pipeline")
        shed = pipeline.spec.shedding
        prio = self.priority_of(req, tenant, default)
        deadline_s = req.deadline_s or self.settings.default_deadline_s
        limit_s = deadline_s * shed.margin
        await self.predictor.refresh()
        asked = list(req.output_modalities) if req.output_modalities is not None else sorted(pipeline.modalities())
        predicted = self.predictor.predict_s(self._plan_parts(pipeline, tuple(asked), req.input.kind).plan.stages, prio)
        if predicted <= limit_s:
            return None
        why = (f"the stage queues predict {predicted:.1f}s to {'+'.join(asked)}, over the deadline of "
               f"{deadline_s:g}s")
        if shed.on_late is ShedMode.DEGRADE:
            kept = [m for m in asked if m in shed.degrade_to]
            if kept and kept != asked:
                if self.predictor.predict_s(self._plan_parts(pipeline, tuple(kept), req.input.kind).plan.stages, prio) <= limit_s:
                    dropped = tuple(m for m in asked if m not in kept)
                    return Degraded(reason=f"{why}: runs without {'+'.join(dropped)}", kept=tuple(kept),
                                    dropped=dropped)
        raise DeadlineUnmeetable(f"{why}; retry later or with a longer deadline_s",
                                 retry_after_s=max(1.0, min(30.0, predicted - limit_s)))

    def other_cell_id(self, refused_id: Any) -> str:
        """A fresh id in a cell other than that of `refused_id` (its cell was full)."""
        taken = cells.cell_of(s(refused_id))
        return new_id((taken + 1 + cells.pick_cell(self.keys.cells - 1)) % self.keys.cells)

    async def _submit_script(self, call: Call) -> Any:
        if self.batcher is not None:
            return await self.batcher.send(*call, retry_refused=False)
        return await redisio.call(self._redis, *call)

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
                    priority: Priority = Priority.API, degraded: Degraded | None = None) -> tuple[Call, str]:
        """Validate a request and build its `submit.lua` call (no I/O but the fair-share view's, read
        beforehand by `submit`); the call and the id it submits. `degraded`: run it with fewer outputs."""
        prio = self.priority_of(req, tenant, priority)
        original = req
        if degraded is not None:
            req = req.model_copy(update={"output_modalities": list(degraded.kept)})
        pipeline = self.catalog.resolve(req.pipeline, param="pipeline")
        parts = self._plan_parts(pipeline, tuple(req.output_modalities) if req.output_modalities is not None else None,
                                 req.input.kind)
        if len(req.input.text or "") > self.settings.max_prompt_chars:
            raise InvalidRequest(f"input.text: {len(req.input.text or '')} characters; the limit is "
                                 f"{self.settings.max_prompt_chars}")
        unknown = sorted(set(req.stage_params) - set(pipeline.stages))
        if unknown:
            raise InvalidRequest(f"stage_params: unknown stage(s) {unknown}; stages of {pipeline.name} are "
                                 f"{list(pipeline.order)}")
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
            params = json.dumps({st: {**pipeline.stages[st].params, **req.stage_params.get(st, {})}
                                 for st in parts.plan.stages})
        else:
            params = parts.params
        # the fields the scripts read on every call first (a small hash is scanned from its front:
        # submit.lua), the request's own after them; `tenant` is the first pair submit.lua reads
        record = [
            "tenant", tenant,
            "prio", prio.value,
            *parts.fields,
            "request_id", req.request_id or "",
            "input", req.input.model_dump_json(exclude_none=True),
            "params", params,
            "webhook", req.webhook_url or "",
        ]
        if req.webhook_url:
            self._check_webhook(req.webhook_url)
        if req.request_id:     # what a reuse of the key is compared with (409 idempotency_conflict)
            record += ["body_hash", body_hash(original)]
        if degraded is not None:
            record += ["degraded", degraded.reason, "dropped", ",".join(degraded.dropped)]
        if tracing.tracer is not None:     # the request's trace, continued by every process (omniflow.tracing)
            record += tracing.record_fields(wf_id)
        call = admission.submit(
            self.keys, wf_id, tenant=tenant, request_id=req.request_id or "",
            admit=parts.queues, priority=prio.value,
            now_ms=now, deadline_ms=now + int(deadline_s * 1000),
            cell_limit=cells.cell_limit(self.settings.admission_limit(prio), self.keys.cells, cell),
            idempotency_ttl_s=self.settings.idempotency_ttl_s if req.request_id else 0,
            stages_csv=parts.stages, admit_csv=parts.admit, record=record,
            fair=self.fair.submit_args(tenant, cell))
        return call, wf_id

    def _check_webhook(self, url: str) -> None:
        """Refuse a webhook URL that can never be delivered, as far as that is knowable without DNS."""
        from omniflow.jobs.egress import EgressPolicy, EgressRefused, check_url_static

        if self._egress is None:
            self._egress = EgressPolicy.from_settings(self.settings)
        try:
            check_url_static(url, self._egress)
        except EgressRefused as exc:
            raise InvalidRequest(f"webhook_url: {exc}") from None

    def _plan_parts(self, pipeline: Pipeline, modalities: tuple[str, ...] | None, input_kind: str = "text") -> _PlanParts:
        """What a submit writes that depends only on the pipeline, the requested modalities and the
        input kind (computed once per combination: submits are the one hot call a client makes)."""
        parts = self._plans.get((pipeline.digest, modalities, input_kind))
        if parts is None:
            plan = pipeline.plan(modalities, input_kind=input_kind)
            edges = [f"{e.src}:{e.dst}" for st in plan.stages for e in pipeline.upstream(st, plan.stages)]
            if plan.input_stage:           # the client's streamed input: freed with the other edge logs
                edges.append(f"{INPUT_SRC}:{plan.input_stage}")
            kinds = [f"{st}={pipeline.stages[st].final_output}" for st in plan.finals]
            keyed = [st for st in plan.finals if pipeline.stages[st].final_output != "text"]
            fields = ("pipeline", pipeline.name, "pipeline_hash", pipeline.digest,
                      "stages", ",".join(plan.stages), "finals", ",".join(plan.finals),
                      "groups", plan.record_groups(), RecordField.KEY_OUTPUTS, ",".join(keyed),
                      "edges", ",".join(edges), "kinds", ",".join(kinds))
            parts = _PlanParts(plan=plan, fields=fields, stages=",".join(plan.stages), admit=",".join(plan.admit),
                               params=json.dumps({st: dict(pipeline.stages[st].params) for st in plan.stages}),
                               queues=tuple(pipeline.queue(st) for st in plan.admit))
            if len(self._plans) < 64:
                self._plans[(pipeline.digest, modalities, input_kind)] = parts
        return parts

    @translated
    async def pipeline_named(self, ref: str | None, *, param: str = "model") -> Pipeline:
        """The pipeline `ref` names (`name` or `name@version`): one this store was given, else one
        the registry has (a pipeline added to the running deployment: learnt for next time), else
        `UnknownPipeline` naming every pipeline known."""
        found = self.catalog.find(ref)
        if found is not None:
            return found
        assert ref
        name, _, version = ref.partition("@")
        pipe = (await registry.fetch(self._redis, self.keys, version) if version
                else await registry.current(self._redis, self.keys, name))
        if pipe is None or pipe.name != name:
            known = sorted(set(self.catalog.names) | set(await registry.names(self._redis, self.keys)))
            what = f"pipeline {name!r} version {version}" if version else f"pipeline {name!r}"
            raise UnknownPipeline(f"unknown {what}; this deployment serves {known}", known=known, param=param)
        self.catalog.add(pipe, serve_name=not version)
        return pipe

    async def pipelines(self) -> list[Pipeline]:
        """Every pipeline new workflows can name: this store's, then those only the registry has
        (registered by processes started since), in that order."""
        out = list(self.catalog)
        for name, version in (await registry.names(self._redis, self.keys)).items():
            if name not in self.catalog.pipelines:
                pipe = self.catalog.version(version) or await registry.fetch(self._redis, self.keys, version)
                if pipe is not None:
                    self.catalog.add(pipe)
                    out.append(pipe)
        return out

    def tasks_key(self, stage: str, cell: int, pipeline: Pipeline | None = None) -> str:
        """The task stream of `stage` of `pipeline` (default: the default pipeline) in `cell`."""
        return self.keys.tasks((pipeline or self.pipeline).queue(stage), cell)

    def stage_queues(self) -> dict[str, list[str]]:
        """Stage name -> its task queues in every pipeline version this store knows (`Pipeline.queue`),
        stage names in the order the pipelines list them: what `stats` adds up per stage."""
        out: dict[str, list[str]] = {}
        for pipe in [*self.catalog, *self.catalog.versions.values()]:
            for stage in pipe.order:
                queues = out.setdefault(stage, [])
                if pipe.queue(stage) not in queues:
                    queues.append(pipe.queue(stage))
        return out

    @staticmethod
    def refused(exc: RedisRefused) -> Exception:
        """What a submit refused by the server means to its caller: busy when out of memory."""
        if exc.refusal == "OOM":
            return AdmissionRefused("Redis is out of memory (maxmemory reached); retry later",
                                    retry_after_s=SUBMIT_OOM_RETRY_AFTER_S)
        return exc

    def submitted(self, reply: Any, *, tenant: str = "default", priority: Priority = Priority.API) -> Submitted:
        """Map a `submit.lua` reply to the result, or to the error it means."""
        code, ident = admission.submit_result(reply)
        if code is SubmitResult.OK:
            if len(reply) > 2:
                self.fair.admitted(cells.cell_of(ident), int(reply[2]))
            return Submitted(id=ident, state=WorkflowState.PENDING)
        if code is SubmitResult.EXISTING:
            return Submitted(id=ident, state=WorkflowState.PENDING, existing=True)
        admission.raise_for_submit(code, ident)
        if len(reply) > 2 and s(reply[2]) == "tenant":
            held = s(reply[3]) if self.keys.cells == 1 else str(self.fair.live(tenant))
            raise FairShareRefused(
                f"tenant {tenant!r} is over its fair share: it holds {held} live "
                f"workflow(s) and may hold {min(self.fair.share(tenant), self.fair.cap())} of max_in_flight "
                f"{self.settings.max_in_flight} while the deployment is busy; retry later",
                retry_after_s=FAIR_RETRY_AFTER_S)
        where = "" if self.keys.cells == 1 else f" in the cell tried (max_in_flight is split over {self.keys.cells} cells)"
        raise AdmissionRefused(
            f"{ident} workflows in flight{where}, the limit is {self.settings.max_in_flight}"
            f"{limit_note(self.settings, priority)}; retry later",
            retry_after_s=1.0,
        )

    @staticmethod
    def retired(wf_id: str) -> WorkflowRetired:
        return admission.retired(wf_id)

    async def _wait_aof(self) -> None:
        try:
            await redisio.call(self._redis, "WAITAOF", 1, 0, 1000)
        except ScriptError as exc:      # servers before 7.2 lack it
            raise ConfigError(f"wait_aof is on but the server refused WAITAOF: {exc}") from exc

    # ---------------------------------------------------------------- abort
    @translated
    async def abort(self, wf_id: str, *, tenant: str | None = None, reason: str = "aborted by client",
                    state: WorkflowState = WorkflowState.ABORTED, stage: str = "") -> str:
        """Abort a live workflow. Returns the state it ends in (already-terminal ones are left as they are)."""
        if tenant is not None:
            await self._check_tenant(wf_id, tenant)
        reply = await redisio.call(self._redis, *abort_call(self.keys, self.settings, self._finalize_plan, wf_id,
                                                           state=state, reason=reason, stage=stage))
        if tracing.tracer is not None and admission.abort_code(reply) is AbortResult.OK:
            tracing.aborted(wf_id, traceparent=s(reply[-1]), reason=reason)
        return admission.abort_result(wf_id, reply, state)

    async def _check_tenant(self, wf_id: str, tenant: str) -> None:
        owner = await self._redis.hget(self.keys.wf(wf_id), "tenant")
        if owner is None or s(owner) != tenant:
            raise WorkflowNotFound(f"no workflow {wf_id}")
