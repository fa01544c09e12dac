"""`/v1/realtime`: the OpenAI Realtime protocol over a WebSocket, as `openai`'s
`client.realtime.connect(model=...)` opens it (`ws[s]://<base>/v1/realtime?model=<model>`,
`Authorization: Bearer <key>`; browsers, which cannot set headers, may send the key as the
subprotocol `openai-insecure-api-key.<key>`, as OpenAI's own server accepts it).

Query parameters: `model` (the pipeline; optional while one is served), `session_id` (reconnect
to a session: its state comes back from Redis) and `last_event_id` (with `session_id`: the id of
the last turn event received, `evt_<response>_<n>`; the rest of that turn follows, exactly after it;
any other id, or none, has the turn in progress sent from its start).

A handshake that cannot be served is refused before the upgrade with an HTTP error in the OpenAI
shape: 401 (key), 404 `model_not_found` / `session_not_found`, 400 (`last_event_id` without `session_id`).
"""
from __future__ import annotations

import logging
import uuid

from fastapi import APIRouter, WebSocket
from starlette.responses import Response as HttpResponse

from omniflow.api import knobs
from omniflow.api.deps import ApiState, Principal, pipeline_for, principal_for
from omniflow.api.errors import ApiError, error_response
from omniflow.api.realtime.config import PCM_RATE, Capabilities
from omniflow.api.realtime.connection import Connection
from omniflow.api.realtime.turn import Resume
from omniflow.api.realtime.records import SessionState
from omniflow.api.realtime.state import RealtimeSession
from omniflow.errors import OmniflowError, UnknownPipeline
from omniflow.pipeline import Pipeline
from omniflow.workers import voices

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["realtime"])
KEY_SUBPROTOCOL = "openai-insecure-api-key."
SUBPROTOCOL = "realtime"


def capabilities(state: ApiState, pipeline: Pipeline | None = None) -> Capabilities:
    """What a served pipeline (default: the default one) offers a realtime session."""
    pipeline = pipeline or state.pipeline
    return Capabilities(
        model=pipeline.name, outputs=frozenset(pipeline.modalities()),
        voices={v["id"]: v["voice"] for v in voices.list_voices()},
        knobs=frozenset(k for k in knobs.KNOB_PARAMS if knobs.supports(pipeline, k)),
        audio_input=pipeline.audio_stage is not None,
        max_buffer_bytes=int(state.settings.realtime_max_buffer_s * PCM_RATE * 2),
        max_prompt_chars=state.settings.max_prompt_chars)


def _token(ws: WebSocket) -> str | None:
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    for proto in ws.scope.get("subprotocols", []):
        if isinstance(proto, str) and proto.startswith(KEY_SUBPROTOCOL):
            return proto[len(KEY_SUBPROTOCOL):]
    return None


async def _refuse(ws: WebSocket, err: ApiError) -> None:
    response: HttpResponse = error_response(err.status, err.code, err.message, headers=err.headers, param=err.param)
    try:
        await ws.send_denial_response(response)
    except RuntimeError:        # a server without the denial extension: close the handshake instead
        await ws.close(code=1008, reason=err.message[:120])


async def _open(ws: WebSocket, state: ApiState, principal: Principal, owner: str) -> RealtimeSession:
    model = ws.query_params.get("model")
    try:
        pipeline = await pipeline_for(state, model)     # `?model=` picks the pipeline (404 when unknown)
    except UnknownPipeline as exc:
        raise ApiError(404, exc.code, str(exc), param="model") from None
    caps = capabilities(state, pipeline)
    session_id = ws.query_params.get("session_id")
    if session_id is None:
        session = RealtimeSession.new(caps, tenant=principal.tenant)
        await state.store.realtime.create(session.state.id, owner=owner, tenant=principal.tenant,
                                          state=session.state.model_dump(mode="json"))
        return session
    raw = await state.store.realtime.claim(session_id[:128], owner=owner, tenant=principal.tenant)
    if raw is None:
        raise ApiError(404, "session_not_found", f"no realtime session {session_id!r} (it may have expired: sessions "
                       f"are kept {state.settings.realtime_session_ttl_s} s after their last change)",
                       param="session_id")
    restored = SessionState.model_validate(raw)
    if model is None and restored.model != caps.model:      # a reconnect without ?model= resumes its own
        try:
            caps = capabilities(state, await pipeline_for(state, restored.model))
        except UnknownPipeline:
            pass
    if restored.model != caps.model:
        raise ApiError(404, "session_not_found", f"session {session_id!r} belongs to model {restored.model!r}",
                       param="session_id")
    return RealtimeSession(restored, caps)


@router.websocket("/realtime")
async def realtime(ws: WebSocket) -> None:
    state: ApiState = ws.app.state.api
    owner = uuid.uuid4().hex
    last_event_id = ws.query_params.get("last_event_id")
    try:
        principal = principal_for(state, _token(ws))
        resume = Resume.parse(last_event_id)
        if last_event_id and "session_id" not in ws.query_params:
            raise ApiError(400, "invalid_value", "last_event_id: it needs the session_id it belongs to",
                           param="last_event_id")
        session = await _open(ws, state, principal, owner)
    except ApiError as err:
        await _refuse(ws, err)
        return
    except OmniflowError as exc:            # Redis unreachable: nothing to serve the session from
        await _refuse(ws, ApiError(503, "redis_unavailable", f"the session store is unavailable: {exc}",
                                   headers={"Retry-After": "1"}))
        return
    asked = ws.scope.get("subprotocols", [])
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in asked else None)
    logger.info("realtime session %s opened (%s) for tenant %s", session.state.id,
                "reconnect" if "session_id" in ws.query_params else "new", principal.tenant)
    await Connection(ws, state, session, owner=owner, resume=resume).run()
