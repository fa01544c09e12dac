"""The workflows resource: submit, read (long-poll), list, abort, events (SSE), audio."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from omniflow.api.audio import AudioFormat, encode, media_type
from omniflow.api.deps import ApiState, PrincipalDep, StateDep, SubmitterDep
from omniflow.api.errors import ApiError
from omniflow.api.hub import IDLE, is_stream_id
from omniflow.api.schemas import (
    AUTH_ERRORS,
    AbortResponse,
    ErrorResponse,
    Links,
    SubmitResponse,
    WorkflowDocument,
    WorkflowList,
    WorkflowSummary,
)
from omniflow.api.sse import EventStreamResponse, sse_comment, sse_event
from omniflow.models import TERMINAL_STATES, SubmitRequest, WorkflowState
from omniflow.store import s

MAX_WAIT_S = 60.0
SSE_KEEPALIVE_S = 15.0
ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"

router = APIRouter(prefix="/v1/workflows", tags=["workflows"])

E = ErrorResponse
WorkflowId = Annotated[str, Path(pattern=ID_PATTERN, description="workflow id")]
_AUTH = AUTH_ERRORS
_NOT_FOUND = {404: {"model": E, "description": "no such workflow for this tenant"},
              422: {"model": E, "description": "bad parameters"}, **_AUTH}


def json_errors(responses: dict[int, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """Error responses of a route whose success is not JSON (SSE, audio): errors are still JSON."""
    ref = {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
    return {code: {"description": r["description"], "content": {"application/json": ref}}
            for code, r in responses.items()}


def links(request: Request, wf_id: str) -> Links:
    base = str(request.url_for("get_workflow", wf_id=wf_id).path)
    return Links(self=base, events=f"{base}/events", audio=f"{base}/audio", abort=f"{base}/abort")


@router.post(
    "", status_code=202, response_model=SubmitResponse,
    responses={200: {"model": SubmitResponse, "description": "request_id matched an existing workflow"},
               409: {"model": E, "description": "the id or request_id belongs to a retired workflow"},
               413: {"model": E, "description": "body too large"},
               422: {"model": E, "description": "bad input (field-level messages)"},
               429: {"model": E, "description": "over admission or the tenant's submit rate; see Retry-After"},
               **_AUTH},
    summary="Submit a workflow",
)
async def submit_workflow(body: SubmitRequest, request: Request, state: StateDep,
                          principal: SubmitterDep) -> Any:
    submitted = await state.store.submit(body, tenant=principal.tenant)
    payload = SubmitResponse(id=submitted.id, state=submitted.state, existing=submitted.existing,
                             links=links(request, submitted.id))
    status = 200 if submitted.existing else 202
    return JSONResponse(payload.model_dump(mode="json"), status_code=status,
                        headers={"Location": payload.links.self})


@router.get("", response_model=WorkflowList, responses={422: {"model": E}, **_AUTH},
            summary="List workflows, newest first")
async def list_workflows(state: StateDep, principal: PrincipalDep,
                         status: Annotated[WorkflowState | None, Query(alias="state")] = None,
                         offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
                         limit: Annotated[int, Query(ge=1, le=500)] = 50) -> WorkflowList:
    rows, next_offset = await state.store.list_page(state=status.value if status else None, tenant=principal.scope,
                                                    offset=offset, limit=limit)
    return WorkflowList(items=[WorkflowSummary(**r) for r in rows], offset=offset, limit=limit,
                        next_offset=next_offset)


@router.get("/{wf_id}", response_model=WorkflowDocument, responses=_NOT_FOUND, name="get_workflow",
            summary="Read a workflow; `wait` long-polls until it is terminal")
async def get_workflow(wf_id: WorkflowId, state: StateDep, principal: PrincipalDep,
                       wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S,
                                                    description="seconds to wait for a terminal state")] = 0) -> Any:
    doc = await state.store.document(wf_id, tenant=principal.scope)
    if wait <= 0 or WorkflowState(doc["state"]) in TERMINAL_STATES:
        return doc
    last = await state.redis.xrevrange(state.store.keys.log(wf_id), count=1)
    if last and s(last[0][1].get(b"t")) == "terminal":
        return await state.store.document(wf_id, tenant=principal.scope)
    after = s(last[0][0]) if last else "0-0"
    async with state.hub.follow(wf_id, after=after, timeout_s=wait) as events:
        async for _ in events:
            pass
    return await state.store.document(wf_id, tenant=principal.scope)


@router.post("/{wf_id}/abort", response_model=AbortResponse, responses=_NOT_FOUND, summary="Abort a workflow")
async def abort_workflow(wf_id: WorkflowId, state: StateDep, principal: PrincipalDep) -> AbortResponse:
    final = await state.store.abort(wf_id, tenant=principal.scope, reason="aborted by client (HTTP)")
    return AbortResponse(id=wf_id, state=WorkflowState(final))


@router.get(
    "/{wf_id}/events", response_class=EventStreamResponse,
    responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                     "description": "Server-sent events; `id` is the event-log entry id (resume with Last-Event-ID); "
                                    "`event` is one of state, stage, text, audio, retry, terminal"},
               **json_errors(_NOT_FOUND)},
    summary="Stream a workflow's events (SSE)",
)
async def workflow_events(wf_id: WorkflowId, state: StateDep, principal: PrincipalDep,
                          last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
                          after: Annotated[str | None, Query(description="resume after this event id")] = None,
                          ) -> EventStreamResponse:
    cursor = after or last_event_id or "0-0"
    if not is_stream_id(cursor):
        raise ApiError(422, "invalid_request", f"Last-Event-ID/after: {cursor!r} is not an event id like 1700000000000-0")
    await state.store.document(wf_id, tenant=principal.scope)
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
    await state.store.document(wf_id, tenant=principal.scope)
    sample_rate, pcm = await state.store.audio(wf_id, stage)
    if sample_rate <= 0 or pcm.size == 0:
        raise ApiError(404, "no_audio", f"workflow {wf_id} produced no audio")
    body = encode(pcm, sample_rate, format)
    ext = "pcm" if format is AudioFormat.PCM16 else ("ogg" if format is AudioFormat.OPUS else format.value)
    return Response(body, media_type=media_type(format),
                    headers={"Content-Disposition": f'attachment; filename="{wf_id}.{ext}"'})
