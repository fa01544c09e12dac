"""OpenAI-compatible chat completions and models, served by the workflow engine.

A chat request becomes one workflow (prompt = the last user message). A user message with an
`input_audio` part (base64 wav or mp3) is heard: the audio is streamed into a workflow that
starts at the pipeline's audio stage (omni-cpu: ASR -> Thinker -> Talker -> Code2Wav), and the
message's text parts, if any, go before what was heard. Text is
returned in `message.content` (streamed as `delta.content`), audio in
`message.audio` (`{id, data, transcript, expires_at}`; streamed as
`delta.audio.data`, raw pcm16 little-endian mono). A client that goes away
before the answer is complete aborts its workflow.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.types import Receive

from omniflow.api.audio import AudioFormat, DecodedAudio, encode
from omniflow.api.deps import ApiState, PrincipalDep, StateDep, SubmitterDep, pipeline_ref
from omniflow.api.errors import ApiError, error_body
from omniflow.api.openai_schemas import (
    ChatAudio,
    ChatChoice,
    ChatCompletion,
    Degradation,
    ChatRequest,
    ChatResponseMessage,
    ModelCard,
    ModelList,
    Usage,
)
from omniflow.api.schemas import AUTH_ERRORS as _AUTH
from omniflow.api.schemas import ErrorResponse as E
from omniflow.api.selection import pipeline_for
from omniflow.api.sse import EventStreamResponse, sse_event
from omniflow.api.transcribe import decode_upload, submit_audio
from omniflow.models import Priority, SubmitRequest, WorkflowInput, WorkflowState
from omniflow.pipeline import Pipeline
from omniflow.workers import voices

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"])
DISCONNECT_REASON = "client disconnected"


def prompt_of(body: ChatRequest) -> str:
    """The text of the last user message (string content or its text parts)."""
    text, _audio = user_turn(body)
    if text is None:
        raise ApiError(422, "invalid_request", "messages: no user message with text content")
    return text


def user_turn(body: ChatRequest) -> tuple[str | None, tuple[str, str, int] | None]:
    """The last user message with content: its text (None if it has none) and its `input_audio`
    part as (base64 data, format, part index), if it has one."""
    for message in reversed(body.messages):
        if message.role != "user":
            continue
        if isinstance(message.content, str):
            if message.content.strip():
                return message.content, None
            continue
        parts = message.content or []
        text = " ".join(str(p.get("text", "")) for p in parts if p.get("type") == "text")
        audio = [(n, p.get("input_audio")) for n, p in enumerate(parts) if p.get("type") == "input_audio"]
        if len(audio) > 1:
            raise ApiError(400, "invalid_value", "messages: one input_audio part per message",
                           param=f"messages.content.{audio[1][0]}")
        if audio:
            n, spec = audio[0]
            if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
                raise ApiError(400, "invalid_value", "input_audio: needs {data: base64, format: wav|mp3}",
                               param=f"messages.content.{n}.input_audio")
            fmt = str(spec.get("format", "wav"))
            if fmt not in ("wav", "mp3"):
                raise ApiError(400, "invalid_value", f"input_audio.format: {fmt!r}; use wav or mp3",
                               param=f"messages.content.{n}.input_audio.format")
            return (text if text.strip() else None), (spec["data"], fmt, n)
        if text.strip():
            return text, None
    return None, None


async def _audio_in(state: ApiState, data: str, n: int) -> DecodedAudio:
    param = f"messages.content.{n}.input_audio.data"
    if len(data) > state.settings.max_upload_bytes * 4 // 3 + 4:
        raise ApiError(400, "invalid_value", f"input_audio: over the limit of {state.settings.max_upload_bytes} "
                       "bytes", param=param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, "invalid_value", "input_audio.data: not base64", param=param) from None
    return await decode_upload(state, raw, param=param)


def _stage_of(pipeline: Pipeline, kind: str) -> str | None:
    stages = pipeline.modalities().get(kind, [])
    return stages[0] if stages else None


def _usage(doc: dict[str, Any]) -> Usage:
    prompt = sum(int((st.get("usage") or {}).get("prompt_tokens", 0)) for st in doc["stages"].values())
    completion = sum(int((st.get("usage") or {}).get("completion_tokens", 0)) for st in doc["stages"].values())
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _failure(doc: dict[str, Any]) -> ApiError:
    where = f" (stage {doc['error_stage']})" if doc.get("error_stage") else ""
    return ApiError(502, f"workflow_{doc['state']}", f"workflow {doc['id']} {doc['state']}{where}: {doc.get('error')}")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@router.get("/models", response_model=ModelList, responses=_AUTH,
            summary="Every pipeline the deployment serves, as a model, with its input and output modalities")
async def list_models(state: StateDep, _: PrincipalDep) -> ModelList:
    now = int(time.time())
    return ModelList(data=[ModelCard(id=p.name, created=now, version=p.digest, input_modalities=p.input_modalities,
                                     output_modalities=p.output_modalities, stages=list(p.order))
                           for p in await state.store.pipelines()])


@router.post(
    "/chat/completions", response_model=ChatCompletion,
    responses={200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                     "description": "a chat.completion, or with stream=true a stream of chat.completion.chunk"},
               404: {"model": E, "description": "unknown model"},
               409: {"model": E}, 413: {"model": E}, 422: {"model": E},
               429: {"model": E, "description": "over admission or submit rate; see Retry-After"},
               502: {"model": E, "description": "the workflow failed or was aborted"}, **_AUTH},
    summary="OpenAI-compatible chat completion (text and audio)",
)
async def chat_completions(body: ChatRequest, request: Request, state: StateDep, principal: SubmitterDep) -> Any:
    pipeline = await pipeline_for(state, body.model)        # unknown: 404 naming the models served
    if body.audio is not None:
        try:
            voices.resolve(body.audio.voice)
        except voices.UnknownVoice as exc:
            raise ApiError(400, "invalid_value", f"audio.voice: {exc}", param="audio.voice") from None
    modalities = list(dict.fromkeys(body.modalities or ["text"]))
    if "audio" in modalities and "text" not in modalities and _stage_of(pipeline, "text"):
        modalities.insert(0, "text")          # the transcript comes from the text stage
    text, audio_part = user_turn(body)
    entry_priority = Priority.INTERACTIVE if body.stream else Priority.API
    if audio_part is not None:
        pipeline = await pipeline_for(state, body.model, takes="audio", param="messages")
        heard = await _audio_in(state, audio_part[0], audio_part[2])
        submitted = await submit_audio(state, principal.tenant, heard, modalities=modalities, text=text,
                                       stage_params=body.stage_params, deadline_s=body.deadline_s, pipeline=pipeline,
                                       priority=body.priority, default_priority=entry_priority)
    elif text is None:
        raise ApiError(422, "invalid_request", "messages: no user message with text or audio content")
    else:
        submitted = await state.store.submit(
            SubmitRequest(input=WorkflowInput(text=text), output_modalities=modalities, stage_params=body.stage_params,
                          deadline_s=body.deadline_s, pipeline=pipeline_ref(pipeline), priority=body.priority),
            tenant=principal.tenant, priority=entry_priority)
    fmt = body.audio.format if body.audio else AudioFormat.WAV
    degraded = Degradation(reason=submitted.degraded, dropped=submitted.dropped) if submitted.degraded else None
    modalities = [m for m in modalities if m not in submitted.dropped]
    if body.stream:
        return EventStreamResponse(_stream(state, pipeline, body, submitted.id, modalities, degraded))
    reply = await _complete(state, pipeline, body, request, submitted.id, modalities, fmt)
    reply.degraded = degraded
    return reply


async def _complete(state: ApiState, pipeline: Pipeline, body: ChatRequest, request: Request, wf_id: str,
                    modalities: list[str], fmt: AudioFormat) -> ChatCompletion:
    waiter = asyncio.ensure_future(_wait_terminal(state, wf_id))
    gone = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not waiter.done():
            waiter.cancel()
            state.spawn(state.store.abort(wf_id, reason=DISCONNECT_REASON))
        gone.cancel()
        await asyncio.gather(waiter, gone, return_exceptions=True)
    doc = await state.store.document(wf_id)
    if doc["state"] != WorkflowState.COMPLETED.value:
        raise _failure(doc)
    text_stage, audio_stage = _stage_of(pipeline, "text"), _stage_of(pipeline, "audio")
    text = doc["outputs"].get(text_stage or "", {}).get("text", "")
    audio = None
    if "audio" in modalities and audio_stage:
        sample_rate, pcm = await state.store.audio(wf_id, audio_stage)
        audio = ChatAudio(id=f"audio_{wf_id}", data=base64.b64encode(encode(pcm, sample_rate, fmt)).decode(),
                          transcript=text, expires_at=_expires_at(state, doc))
    return ChatCompletion(
        id=f"chatcmpl-{wf_id}", created=int(doc["created_at"]), model=body.model,
        choices=[ChatChoice(message=ChatResponseMessage(content=text if "text" in modalities else None, audio=audio))],
        usage=_usage(doc))


def _expires_at(state: ApiState, doc: dict[str, Any]) -> int:
    return int((doc.get("finished_at") or time.time()) + state.settings.result_ttl_s)


async def _wait_terminal(state: ApiState, wf_id: str) -> None:
    async with state.hub.follow(wf_id) as events:
        async for _ in events:
            pass


def _chunk(wf_id: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None,
           usage: Usage | None = None, degraded: Degradation | None = None) -> bytes:
    payload: dict[str, Any] = {
        "id": f"chatcmpl-{wf_id}", "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [] if usage is not None else [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if degraded is not None:        # omniflow extension, on the first chunk (as on the whole reply)
        payload["degraded"] = degraded.model_dump()
    if usage is not None:
        payload["usage"] = usage.model_dump()
    return sse_event(json.dumps(payload))


async def _stream(state: ApiState, pipeline: Pipeline, body: ChatRequest, wf_id: str, modalities: list[str],
                  degraded: Degradation | None = None) -> AsyncIterator[bytes]:
    created = int(time.time())
    text_stage, audio_stage = _stage_of(pipeline, "text"), _stage_of(pipeline, "audio")
    want_audio = "audio" in modalities and audio_stage is not None
    out_cursor = "-"
    transcript: list[str] = []
    finished = False
    try:
        yield _chunk(wf_id, body.model, created, {"role": "assistant", "content": ""}, degraded=degraded)
        async with state.hub.follow(wf_id) as events:
            async for _eid, fields in events:
                kind = fields.get("t")
                if kind == "text" and fields.get("stage") == text_stage:
                    transcript.append(fields.get("delta", ""))
                    yield _chunk(wf_id, body.model, created, {"content": fields.get("delta", "")})
                elif kind == "audio" and want_audio and fields.get("stage") == audio_stage:
                    for entry_id, pcm, rate in await state.store.audio_chunks(wf_id, audio_stage or "",
                                                                              after=out_cursor):
                        out_cursor = entry_id
                        data = base64.b64encode(pcm).decode()
                        yield _chunk(wf_id, body.model, created,
                                     {"audio": {"id": f"audio_{wf_id}", "data": data, "sample_rate": rate}})
                elif kind == "terminal":
                    break
        doc = await state.store.document(wf_id)
        finished = True
        if doc["state"] != WorkflowState.COMPLETED.value:
            err = _failure(doc)
            yield sse_event(json.dumps(error_body(err.code, err.message, status=err.status)))
            yield sse_event("[DONE]")
            return
        final: dict[str, Any] = {}
        if want_audio:
            final["audio"] = {"id": f"audio_{wf_id}", "transcript": "".join(transcript),
                              "expires_at": _expires_at(state, doc)}
        yield _chunk(wf_id, body.model, created, final, finish="stop")
        if body.stream_options and body.stream_options.include_usage:
            yield _chunk(wf_id, body.model, created, {}, usage=_usage(doc))
        yield sse_event("[DONE]")
    finally:
        if not finished:
            logger.info("chat stream for workflow %s ended early; aborting it", wf_id)
            state.spawn(state.store.abort(wf_id, reason=DISCONNECT_REASON))
