"""The workflows resource: submit, read (long-poll), list, abort, retry, events (SSE), timeline, audio."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request, Response
import numpy as np
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from omniflow.ops import admin
from omniflow.ops.admin import since_ms

from omniflow.api.audio import AudioFormat, encode, media_type
from omniflow.api.deps import ApiState, PrincipalDep, StateDep, SubmitterDep
from omniflow.api.errors import ApiError
from omniflow.api.hub import IDLE, is_stream_id, stream_id
from omniflow.api.schemas import (
    InputAppended,
    AUTH_ERRORS,
    AbortResponse,
    ErrorResponse,
    Links,
    SubmitResponse,
    Timeline,
    WorkflowDocument,
    WorkflowList,
    WorkflowSummary,
)
from omniflow.api.sse import EventStreamResponse, event_schema, sse_comment, sse_event
from omniflow.storage.listing import ListFilter
from omniflow.models import TERMINAL_STATES, SubmitRequest, WorkflowState
from omniflow.ops.timeline import gantt

MAX_WAIT_S = 60.0
SSE_KEEPALIVE_S = 15.0
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"

router = APIRouter(prefix="/v1/workflows", tags=["workflows"])

E = ErrorResponse
WorkflowId = Annotated[str, Path(pattern=ID_PATTERN, description="workflow id")]
_AUTH = AUTH_ERRORS
_NOT_FOUND = {404: {"model": E, "description": "no such workflow for this tenant"},
              422: {"model": E, "description": "bad parameters"}, **_AUTH}


def json_errors(responses: Mapping[int | str, Mapping[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """Error responses of a route whose success is not JSON (SSE, audio): errors are still JSON."""
    ref = {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
    return {code: {"description": r["description"], "content": {"application/json": ref}}
            for code, r in responses.items()}


def links(request: Request, wf_id: str) -> Links:
    base = str(request.url_for("get_workflow", wf_id=wf_id).path)
    return Links(self=base, events=f"{base}/events", audio=f"{base}/audio", abort=f"{base}/abort")


@router.post(
    "", status_code=202, response_model=SubmitResponse,
    responses={200: {"model": SubmitResponse | WorkflowDocument,
                     "description": "request_id matched an existing workflow (the submit response); with "
                                    "`wait`: the workflow document"},
               409: {"model": E, "description": "`retired`: the id or request_id belongs to a retired workflow; "
                                                "`idempotency_conflict`: the request_id was used with a different body"},
               404: {"model": E, "description": "`model_not_found`: `pipeline` names no pipeline (or version) served"},
               413: {"model": E, "description": "body too large"},
               422: {"model": E, "description": "bad input (field-level messages)"},
               429: {"model": E, "description": "over admission or the tenant's submit rate; see Retry-After"},
               **_AUTH},
    summary="Submit a workflow; with `wait`, answer with its document once it is terminal",
    description="Without `wait`: 202 (200 for a `request_id` that matched) and the submit response. With "
                "`wait` > 0: 200 and the workflow document (as `GET /v1/workflows/{id}` returns it) once the "
                "workflow is terminal, or its current document when `wait` seconds pass first: submit and "
                "wait in one request.",
)
async def submit_workflow(body: SubmitRequest, request: Request, state: StateDep, principal: SubmitterDep,
                          idempotency_key: Annotated[str | None, Header(
                              alias="Idempotency-Key", max_length=128,
                              description="the same as `request_id` (either, or both when equal)")] = None,
                          wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, description=(
                              "seconds to wait for a terminal state; the answer is then the document"))] = 0) -> Any:
    if idempotency_key is not None:
        body = _with_idempotency_key(body, idempotency_key)
    # a workflow submitted once the watcher is positioned ends after its read positions: watched
    # without a check of its state (omniflow.client.bulk.Completions.submitted)
    watcher = state.completions if wait > 0 and state.completions is not None and state.completions.positioned else None
    submitted = await state.store.submit(body, tenant=principal.tenant)
    payload = SubmitResponse(id=submitted.id, state=submitted.state, existing=submitted.existing,
                             links=links(request, submitted.id))
    if wait > 0:
        if watcher is not None and not submitted.existing:
            watcher.submitted(submitted.id)
        return JSONResponse(await _wait_document(state, submitted.id, principal.scope, wait),
                            headers={"Location": payload.links.self})
    status = 200 if submitted.existing else 202
    return JSONResponse(payload.model_dump(mode="json"), status_code=status,
                        headers={"Location": payload.links.self})


async def _wait_document(state: ApiState, wf_id: str, tenant: str | None, wait: float) -> dict[str, Any]:
    """The workflow's document once it is terminal, or its current one after `wait` seconds: through the
    API's one watcher of workflow ends (omniflow.client.bulk.Completions: one blocking read for every
    request waiting, woken once per workflow, not once per log entry)."""
    if state.completions is not None:
        try:
            return await asyncio.wait_for(asyncio.shield(state.completions.watch(wf_id)), wait)
        except TimeoutError:
            pass
    else:
        async with state.hub.follow(wf_id, timeout_s=wait) as events:
            async for _ in events:
                pass
    return await state.store.document(wf_id, tenant=tenant)


def _with_idempotency_key(body: SubmitRequest, key: str) -> SubmitRequest:
    """The `Idempotency-Key` header is honoured as the body's `request_id` (they must agree)."""
    if body.request_id is not None and body.request_id != key:
        raise ApiError(422, "invalid_request", "Idempotency-Key and request_id differ; send one, or both equal")
    try:
        return SubmitRequest.model_validate({**body.model_dump(exclude_unset=True), "request_id": key})
    except ValidationError as exc:
        raise ApiError(422, "invalid_request", f"Idempotency-Key: {exc.errors()[0]['msg']}") from None


@router.get("", response_model=WorkflowList, responses={422: {"model": E}, **_AUTH},
            summary="List workflows, newest first, filtered")
async def list_workflows(state: StateDep, principal: PrincipalDep,
                         status: Annotated[WorkflowState | None, Query(alias="state")] = None,
                         stage: Annotated[str | None, Query(pattern=r"^[a-z][a-z0-9_]{0,31}$",
                                                            description="the stage is in the workflow's plan")] = None,
                         tenant: Annotated[str | None, Query(max_length=128, description=(
                             "admins: one tenant's workflows; a tenant key only ever sees its own"))] = None,
                         since_s: Annotated[float | None, Query(gt=0, le=10 * 365 * 86400, description=(
                             "created in the last this many seconds"))] = None,
                         request_id: Annotated[str | None, Query(min_length=1, max_length=128, description=(
                             "substring of the request id (a bounded server-side scan)"))] = None,
                         offset: Annotated[int, Query(ge=0, le=100_000_000)] = 0,
                         limit: Annotated[int, Query(ge=1, le=500)] = 50) -> WorkflowList:
    if principal.scope is not None and tenant is not None and tenant != principal.scope:
        return WorkflowList(items=[], offset=offset, limit=limit, next_offset=None, total=0, scanned=0)
    flt = ListFilter(state=status.value if status else None, tenant=principal.scope or tenant, stage=stage,
                     since_ms=since_ms(since_s), request_id=request_id)
    page = await state.store.list_workflows(flt, offset=offset, limit=limit)
    return WorkflowList(items=[WorkflowSummary(**r) for r in page.rows], offset=offset, limit=limit,
                        next_offset=page.next_offset, total=page.total, scanned=page.scanned)


@router.get("/{wf_id}", response_model=WorkflowDocument, responses=_NOT_FOUND, name="get_workflow",
            summary="Read a workflow; `wait` long-polls until it is terminal")
async def get_workflow(wf_id: WorkflowId, state: StateDep, principal: PrincipalDep,
                       wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S,
                                                    description="seconds to wait for a terminal state")] = 0) -> Any:
    # answered as the store builds it: the very JSON a webhook carries (no field added or dropped)
    doc = await state.store.document(wf_id, tenant=principal.scope)
    if wait <= 0 or WorkflowState(doc["state"]) in TERMINAL_STATES:
        return JSONResponse(doc)
    last = await state.store.last_event(wf_id)
    if last is None or last[1].get("t") != "terminal":
        async with state.hub.follow(wf_id, after=last[0] if last else "0-0", timeout_s=wait) as events:
            async for _ in events:
                pass
    return JSONResponse(await state.store.document(wf_id, tenant=principal.scope))


@router.post("/{wf_id}/abort", response_model=AbortResponse, responses=_NOT_FOUND, summary="Abort a workflow")
async def abort_workflow(wf_id: WorkflowId, state: StateDep, principal: PrincipalDep) -> AbortResponse:
    final = await state.store.abort(wf_id, tenant=principal.scope, reason="aborted by client (HTTP)")
    return AbortResponse(id=wf_id, state=WorkflowState(final))


@router.post("/{wf_id}/input", response_model=InputAppended,
             responses={**_NOT_FOUND, 409: {"model": E, "description": "the input has ended, or the workflow has"},
                        413: {"model": E}, 422: {"model": E, "description": "the workflow takes no streamed input, or "
                                                                             "the body is not whole pcm16 samples"}},
             summary="Stream audio into a workflow submitted with input.audio")
async def append_input(wf_id: WorkflowId, request: Request, state: StateDep, principal: PrincipalDep,
                       final: Annotated[bool, Query(description="the input ends after this audio")] = False) -> Any:
    """The body is raw pcm16 (little-endian mono) at the rate the submit declared
    (`input.audio.sample_rate`); each call is one append, which the audio stage hears as it comes."""
    body = await request.body()
    if len(body) % 2:
        raise ApiError(422, "invalid_request", f"the body is {len(body)} bytes: not whole pcm16 samples")
    seq = await state.store.append_input(wf_id, np.frombuffer(body, dtype="<i2").astype(np.int16) if body else (),
                                         final=final, tenant=principal.scope)
    return InputAppended(id=wf_id, seq=seq, final=final)


@router.post("/{wf_id}/retry", status_code=202, response_model=SubmitResponse,
             responses={**_NOT_FOUND, 422: {"model": E, "description": "the workflow is not failed or aborted"},
                        429: {"model": E, "description": "over admission or the tenant's submit rate"}},
             summary="Run a failed or aborted workflow again, as a new workflow with the same input")
async def retry_workflow(wf_id: WorkflowId, request: Request, state: StateDep, principal: SubmitterDep) -> Any:
    new_id = await admin.retry_workflow(state.store, wf_id, tenant=principal.scope)
    payload = SubmitResponse(id=new_id, state=WorkflowState.PENDING, links=links(request, new_id))
    return JSONResponse(payload.model_dump(mode="json"), status_code=202, headers={"Location": payload.links.self})


@router.get("/{wf_id}/timeline", response_model=Timeline, responses=_NOT_FOUND,
            summary="The workflow's event log as Gantt lanes: attempts, replicas, output ticks, retries")
async def workflow_timeline(wf_id: WorkflowId, state: StateDep, principal: PrincipalDep) -> Any:
    doc = await state.store.document(wf_id, tenant=principal.scope)
    return gantt(await state.store.read_log(wf_id), doc)


@router.get(
    "/{wf_id}/events", response_class=EventStreamResponse,
    responses={200: {"content": {"text/event-stream": {"schema": event_schema(
                         ["state", "stage", "text", "audio", "retry", "restart", "terminal"])}},
                     "description": "Server-sent events; `id` is the event-log entry id (resume with Last-Event-ID); "
                                    "`event` is one of state, stage, text, audio, retry, terminal"},
               204: {"description": "resumed at or past the terminal event: nothing more will come "
                                    "(an EventSource stops reconnecting)"},
               **json_errors(_NOT_FOUND)},
    summary="Stream a workflow's events (SSE)",
)
async def workflow_events(wf_id: WorkflowId, state: StateDep, principal: PrincipalDep,
                          last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
                          after: Annotated[str | None, Query(description="resume after this event id")] = None,
                          ) -> Response:
    cursor = after or last_event_id or "0-0"
    if not is_stream_id(cursor):
        raise ApiError(422, "invalid_request", f"Last-Event-ID/after: {cursor!r} is not an event id like 1700000000000-0")
    await state.store.document(wf_id, tenant=principal.scope)
    if cursor != "0-0":
        last = await state.store.last_event(wf_id)
        if last is not None and last[1].get("t") == "terminal" and stream_id(last[0]) <= stream_id(cursor):
            return Response(status_code=204)
    return EventStreamResponse(_sse(state, wf_id, cursor))


async def _sse(state: ApiState, wf_id: str, after: str) -> AsyncIterator[bytes]:
    yield sse_comment("stream start")
    async with state.hub.follow(wf_id, after=after, idle_s=SSE_KEEPALIVE_S) as events:
        async for event in events:
            if event is IDLE:
                yield sse_comment("keep-alive")
                continue
            eid, fields = event
            yield sse_event(json.dumps({"id": eid, **fields}), event=fields.get("t", "message"), event_id=eid)


@router.get(
    "/{wf_id}/audio",
    response_class=Response,
    responses={200: {"content": {media_type(f): {"schema": {"type": "string", "format": "binary"}}
                                 for f in AudioFormat},
                     "description": "the encoded audio of the final audio stage"},
               **json_errors({409: {"description": "the audio is not ready yet"}, **_NOT_FOUND})},
    summary="Download the workflow's audio",
)
async def workflow_audio(wf_id: WorkflowId, state: StateDep, principal: PrincipalDep,
                         format: Annotated[AudioFormat, Query()] = AudioFormat.WAV,  # noqa: A002 - public name
                         stage: Annotated[str | None, Query(pattern=r"^[a-z][a-z0-9_]{0,31}$")] = None) -> Response:
    doc = await state.store.document(wf_id, tenant=principal.scope)
    audio = [name for name, out in doc["outputs"].items() if out["type"] == "audio"]
    if not audio or (stage is not None and stage not in audio):
        which = f" from stage {stage!r}" if stage is not None and audio else ""
        raise ApiError(404, "no_audio", f"workflow {wf_id} has no audio output{which} (its outputs: "
                                        f"{sorted(doc['outputs'])})")
    sample_rate, pcm = await state.store.audio(wf_id, stage)
    if sample_rate <= 0 or pcm.size == 0:
        raise ApiError(404, "no_audio", f"workflow {wf_id} produced no audio")
    body = encode(pcm, sample_rate, format)
    ext = "pcm" if format is AudioFormat.PCM16 else ("ogg" if format is AudioFormat.OPUS else format.value)
    return Response(body, media_type=media_type(format),
                    headers={"Content-Disposition": f'attachment; filename="{wf_id}.{ext}"'})
