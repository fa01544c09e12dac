"""OpenAI-compatible audio routes: `POST /v1/audio/speech` (text to speech, streamed as it is
produced) and `GET /v1/audio/voices` (the voices a request may name).

Speech is one workflow of the served pipeline, asked for its audio output only; its audio
stage's chunks are encoded and sent as they arrive (`omniflow.api.speech`), with chunked
transfer. `pcm` is raw 16-bit mono at 24 kHz, as OpenAI documents it (the voice's rate is
converted with a stateful resampler). The response carries the workflow's id in
`X-Omniflow-Workflow-Id`. A client that goes away before the end aborts the workflow.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from omniflow.api import knobs
from omniflow.api.audio import AudioFormat, BadAudio, media_type, speech_format
from omniflow.api.deps import ApiState, PrincipalDep, StateDep, SubmitterDep, pipeline_for, pipeline_ref
from omniflow.api.errors import ApiError
from omniflow.api.openai_schemas import SpeechRequest, VoiceCard, VoiceList
from omniflow.api.schemas import AUTH_ERRORS as _AUTH
from omniflow.api.schemas import ErrorResponse as E
from omniflow.api.speech import SpeechFailed, SpeechStream
from omniflow.api.sse import WatchedStreamingResponse
from omniflow.models import Priority, SubmitRequest, WorkflowInput
from omniflow.pipeline import Pipeline
from omniflow.workers import voices

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/audio", tags=["audio"])
DISCONNECT_REASON = "client disconnected"
WORKFLOW_HEADER = "X-Omniflow-Workflow-Id"
AUDIO_CONTENT = {media_type(f): {"schema": {"type": "string", "format": "binary"}} for f in AudioFormat}


@router.get("/voices", response_model=VoiceList, responses=_AUTH, summary="The voices a request may name")
async def list_voices(_: PrincipalDep) -> VoiceList:
    return VoiceList(data=[VoiceCard.model_validate(v) for v in voices.list_voices()])


async def _audio_stage(state: ApiState, model: str) -> tuple[Pipeline, str]:
    """The pipeline `model` names (404 naming the known ones) and its audio stage (400 when it has none)."""
    pipeline = await pipeline_for(state, model)
    stages = pipeline.modalities().get("audio")
    if not stages:
        raise ApiError(400, "unsupported_value", f"model {model!r} makes no audio (its outputs: "
                                                 f"{sorted(pipeline.modalities())})", param="model")
    return pipeline, stages[0]


def _check(body: SpeechRequest) -> AudioFormat:
    try:
        fmt = speech_format(body.response_format)
    except BadAudio as exc:
        raise ApiError(400, "unsupported_value", f"response_format: {exc}", param="response_format") from None
    try:
        voices.resolve(body.voice.model_dump() if not isinstance(body.voice, str) else body.voice)
    except voices.UnknownVoice as exc:
        raise ApiError(400, "invalid_value", f"voice: {exc}", param="voice") from None
    if body.instructions and body.instructions.strip():
        raise ApiError(400, "unsupported_parameter", "instructions: the shipped voices cannot follow instructions; "
                       "leave it unset", param="instructions")
    if body.stream_format == "sse":
        raise ApiError(400, "unsupported_value", "stream_format: only 'audio' (the file, streamed as it is produced)",
                       param="stream_format")
    if not body.input.strip():
        raise ApiError(400, "invalid_value", "input: nothing to say (only whitespace)", param="input")
    return fmt


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.post(
    "/speech", response_class=Response,
    responses={200: {"content": AUDIO_CONTENT, "description": "the audio, streamed as it is produced (chunked)"},
               400: {"model": E, "description": "unknown voice or format, or a parameter the model cannot honour"},
               404: {"model": E, "description": "unknown model"}, 413: {"model": E}, 422: {"model": E},
               429: {"model": E, "description": "over admission or submit rate; see Retry-After"},
               502: {"model": E, "description": "the workflow failed before it spoke"}, **_AUTH},
    summary="OpenAI-compatible text to speech (streamed)",
)
async def speech(body: SpeechRequest, request: Request, state: StateDep, principal: SubmitterDep) -> Any:
    pipeline, stage = await _audio_stage(state, body.model)
    fmt = _check(body)
    stage_params = knobs.stage_params(pipeline, {"speed": body.speed if body.speed != 1.0 else None})
    submitted = await state.store.submit(
        SubmitRequest(input=WorkflowInput(text=body.input), output_modalities=["audio"], stage_params=stage_params,
                      deadline_s=body.deadline_s, pipeline=pipeline_ref(pipeline), priority=body.priority),
        tenant=principal.tenant, priority=Priority.INTERACTIVE)
    stream = SpeechStream(state.store, state.hub, submitted.id, stage, fmt)
    first = asyncio.ensure_future(stream.first())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not first.done():
            first.cancel()
        await asyncio.gather(first, gone, return_exceptions=True)
    if first.cancelled():            # the client went away before the first byte
        state.spawn(state.store.abort(submitted.id, reason=DISCONNECT_REASON))
        await stream.aclose()
        return Response(status_code=499)
    try:
        head = first.result()
    except SpeechFailed as exc:
        await stream.aclose()
        raise ApiError(502, f"workflow_{exc.doc['state']}", str(exc)) from None
    return WatchedStreamingResponse(_body(state, stream, head), media_type=media_type(fmt),
                                    headers={WORKFLOW_HEADER: submitted.id})


async def _body(state: ApiState, stream: SpeechStream, head: bytes) -> AsyncIterator[bytes]:
    try:
        yield head
        async for data in stream.rest():
            yield data
    except SpeechFailed as exc:
        logger.warning("speech stream cut: %s", exc)
        raise
    finally:
        if not stream.finished:
            state.spawn(state.store.abort(stream.wf_id, reason=DISCONNECT_REASON))
        await stream.aclose()
