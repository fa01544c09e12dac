"""`POST /v1/audio/transcriptions`: OpenAI-compatible speech to text, as `openai`'s
`client.audio.transcriptions.create(file=..., model=...)` sends it (multipart form).

The upload (wav, mp3, flac, ogg, ... up to `max_upload_bytes` and `max_upload_s`) is decoded
to 16 kHz mono and streamed into one workflow of the pipeline's audio stage (`asr-cpu`), whose
text is the transcript. `response_format`: `json` (`{"text", "usage"}`), `text`, `verbose_json`
(language, duration and `segments` with their times), `srt` and `vtt`. With `stream=true` the
answer is a server-sent event stream of `transcript.text.delta` events as the stage recognises
the text and one `transcript.text.done` (OpenAI's streamed transcription events). `language`,
`prompt` and `temperature` go to the stage as its per-request params. A client that goes away
before the answer aborts the workflow.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Form, Request, UploadFile
from starlette.responses import JSONResponse, PlainTextResponse, Response

from omniflow.api.deps import ApiState, StateDep, SubmitterDep
from omniflow.api.errors import ApiError, error_body
from omniflow.api.routes.audio import WORKFLOW_HEADER
from omniflow.api.schemas import AUTH_ERRORS as _AUTH
from omniflow.api.schemas import ErrorResponse as E
from omniflow.api.selection import pipeline_for
from omniflow.api.sse import EventStreamResponse, sse_event
from omniflow.api.transcribe import decode_upload, segments, submit_audio
from omniflow.models import WorkflowState

router = APIRouter(prefix="/v1/audio", tags=["audio"])
DISCONNECT_REASON = "client disconnected"
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
MAX_PROMPT_CHARS = 4096


def _params(stage: str, language: str | None, prompt: str | None, temperature: float | None) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if language:
        params["language"] = language.strip().lower()
    if prompt:
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ApiError(400, "invalid_value", f"prompt: {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}",
                           param="prompt")
        params["prompt"] = prompt
    if temperature is not None:
        if not 0.0 <= temperature <= 1.0:
            raise ApiError(400, "invalid_value", f"temperature: must be in 0..1, got {temperature:g}",
                           param="temperature")
        params["temperature"] = temperature
    return {stage: params} if params else {}


@router.post(
    "/transcriptions",
    responses={200: {"content": {"application/json": {}, "text/plain": {}, "text/event-stream": {}},
                     "description": "the transcript (json, text, verbose_json, srt, vtt), or with stream=true "
                                    "transcript.text.delta / transcript.text.done events"},
               400: {"model": E, "description": "corrupt, empty, oversized or too long audio; unknown format"},
               404: {"model": E, "description": "unknown model"}, 413: {"model": E}, 422: {"model": E},
               429: {"model": E}, 502: {"model": E, "description": "the workflow failed"}, **_AUTH},
    summary="OpenAI-compatible speech to text",
)
async def transcriptions(
    request: Request, state: StateDep, principal: SubmitterDep,
    file: UploadFile, model: Annotated[str, Form(max_length=128)],
    language: Annotated[str | None, Form(max_length=16)] = None,
    prompt: Annotated[str | None, Form()] = None,
    response_format: Annotated[str, Form(max_length=32)] = "json",
    temperature: Annotated[float | None, Form()] = None,
    stream: Annotated[bool, Form()] = False,
    granularities: Annotated[list[str] | None, Form(alias="timestamp_granularities[]")] = None,
) -> Any:
    pipeline = await pipeline_for(state, model, takes="audio", makes="text")
    stage = pipeline.audio_stage
    if stage is None or stage not in pipeline.modalities().get("text", []):
        raise ApiError(400, "unsupported_value", f"model {model!r} does not transcribe: its audio stage's text is "
                       "not one of its outputs (use a speech-to-text pipeline such as asr-cpu)", param="model")
    if response_format not in FORMATS:
        raise ApiError(400, "unsupported_value", f"response_format: {response_format!r} is not one of "
                       f"{', '.join(FORMATS)}", param="response_format")
    if granularities and (set(granularities) - {"segment"} or response_format != "verbose_json"):
        raise ApiError(400, "unsupported_value", "timestamp_granularities: only 'segment', with verbose_json",
                       param="timestamp_granularities")
    stage_params = _params(stage, language, prompt, temperature)
    audio = await decode_upload(state, await file.read(state.settings.max_upload_bytes + 1), param="file")
    wf_id = (await submit_audio(state, principal.tenant, audio, modalities=["text"], stage_params=stage_params,
                                pipeline=pipeline)).id
    if stream:
        return EventStreamResponse(_stream(state, wf_id, stage), headers={WORKFLOW_HEADER: wf_id})
    doc = await _wait(state, request, wf_id)
    if doc["state"] != WorkflowState.COMPLETED.value:
        where = f" (stage {doc['error_stage']})" if doc.get("error_stage") else ""
        error = str(doc.get("error") or "")
        status = 400 if "asr:" in error else 502     # the stage refused the audio itself: the request's fault
        raise ApiError(status, "invalid_value" if status == 400 else f"workflow_{doc['state']}",
                       f"workflow {wf_id} {doc['state']}{where}: {error}", param="file" if status == 400 else None)
    return _render(response_format, doc, stage, wf_id)


def _render(fmt: str, doc: dict[str, Any], stage: str, wf_id: str) -> Response:
    text = doc["outputs"].get(stage, {}).get("text", "")
    usage = doc["stages"].get(stage, {}).get("usage") or {}
    seconds = float(usage.get("audio_seconds", 0.0))
    headers = {WORKFLOW_HEADER: wf_id}
    segs = segments(usage) or ([{"start": 0.0, "end": seconds, "text": text}] if text else [])
    if fmt == "text":
        return PlainTextResponse(text, headers=headers)
    if fmt in ("srt", "vtt"):
        return PlainTextResponse(_subtitles(segs, vtt=fmt == "vtt"), headers=headers,
                                 media_type="text/vtt" if fmt == "vtt" else "application/x-subrip")
    body: dict[str, Any] = {"text": text, "usage": {"type": "duration", "seconds": round(seconds, 3)}}
    if fmt == "verbose_json":
        body = {"task": "transcribe", "language": _language_name(usage.get("language")), "duration": seconds,
                "text": text, "usage": body["usage"],
                "segments": [{"id": n, "seek": 0, "start": float(seg["start"]), "end": float(seg["end"]),
                              "text": " " + seg["text"], "tokens": [], "temperature": 0.0, "avg_logprob": 0.0,
                              "compression_ratio": 0.0, "no_speech_prob": 0.0} for n, seg in enumerate(segs)]}
    return JSONResponse(body, headers=headers)


LANGUAGES = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian", "nl": "dutch",
             "pt": "portuguese", "ja": "japanese", "zh": "chinese", "ru": "russian"}


def _language_name(code: Any) -> str:
    """OpenAI's verbose_json names the language in words (`english`)."""
    return LANGUAGES.get(str(code), str(code or ""))


def _timestamp(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def _subtitles(segs: list[dict[str, Any]], *, vtt: bool) -> str:
    sep = "." if vtt else ","
    cues = [f"{'' if vtt else f'{n + 1}' + chr(10)}{_timestamp(float(s['start']), sep)} --> "
            f"{_timestamp(float(s['end']), sep)}\n{s['text']}\n" for n, s in enumerate(segs)]
    return ("WEBVTT\n\n" if vtt else "") + "\n".join(cues)


async def _wait(state: ApiState, request: Request, wf_id: str) -> dict[str, Any]:
    """The workflow's document once terminal; the workflow is aborted if the client goes away first."""
    waiter = asyncio.ensure_future(state.store.wait(wf_id))
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({waiter, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not waiter.done():
            waiter.cancel()
            state.spawn(state.store.abort(wf_id, reason=DISCONNECT_REASON))
        gone.cancel()
        await asyncio.gather(waiter, gone, return_exceptions=True)
    if waiter.cancelled():
        raise ApiError(499, "client_closed", "the client went away")
    return waiter.result()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(state: ApiState, wf_id: str, stage: str) -> AsyncIterator[bytes]:
    """`transcript.text.delta` per recognised segment, then `transcript.text.done` (or an error)."""
    parts: list[str] = []
    finished = False
    try:
        async with state.hub.follow(wf_id) as events:
            async for _eid, fields in events:
                kind = fields.get("t")
                if kind == "text" and fields.get("stage") == stage and fields.get("delta"):
                    parts.append(fields["delta"])
                    yield sse_event(json.dumps({"type": "transcript.text.delta", "delta": fields["delta"]}))
                elif kind == "terminal":
                    break
        doc = await state.store.document(wf_id)
        finished = True
        if doc["state"] != WorkflowState.COMPLETED.value:
            yield sse_event(json.dumps(error_body(f"workflow_{doc['state']}", f"workflow {wf_id} {doc['state']}: "
                                                  f"{doc.get('error')}", status=502)))
            return
        yield sse_event(json.dumps({"type": "transcript.text.done", "text": "".join(parts)}))
    finally:
        if not finished:
            state.spawn(state.store.abort(wf_id, reason=DISCONNECT_REASON))
