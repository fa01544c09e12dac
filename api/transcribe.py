"""Audio in: an upload decoded and streamed into a workflow that takes audio, and what its ASR heard.

`decode_upload` turns any file libsndfile reads (wav, mp3, flac, ogg, ...) into int16 mono at
the ASR's rate, off the event loop; `BadAudio` (empty, corrupt, over the size or duration limit)
becomes a 400 in the OpenAI error shape. `submit_audio` submits the workflow and appends the
samples to its `@input` in one call, ending the input (an upload is whole); a workflow whose
input cannot be appended is aborted, never left waiting. `heard` reads the transcript and its
segments back from the audio stage's usage (`timeline`), for stages whose text is not a final
output (omni-cpu's ASR feeds the Thinker).
"""
from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from omniflow.api.audio import BadAudio, DecodedAudio, decode
from omniflow.api.deps import ApiState, pipeline_ref
from omniflow.api.errors import ApiError
from omniflow.errors import OmniflowError
from omniflow.models import AudioInput, Priority, SubmitRequest, Submitted, WorkflowInput
from omniflow.pipeline import Pipeline

ASR_RATE = 16000                 # what Whisper hears: decoding to it sends a third of 48 kHz's bytes
CHUNK_S = 10.0                   # samples per input chunk of an upload


async def decode_upload(state: ApiState, data: bytes, *, param: str) -> DecodedAudio:
    """An upload as int16 mono at `ASR_RATE` (a 400 naming `param` when it is not usable audio)."""
    try:
        return await asyncio.to_thread(decode, data, sample_rate=ASR_RATE, max_bytes=state.settings.max_upload_bytes,
                                       max_seconds=state.settings.max_upload_s)
    except BadAudio as exc:
        raise ApiError(400, "invalid_value", f"{param}: {exc}", param=param) from None


async def submit_audio(state: ApiState, tenant: str, audio: DecodedAudio, *, modalities: list[str],
                       stage_params: dict[str, dict[str, Any]] | None = None, deadline_s: float | None = None,
                       text: str | None = None, pipeline: Pipeline | None = None, priority: Priority | None = None,
                       default_priority: Priority = Priority.API) -> Submitted:
    """Submit a workflow that takes `audio` (on `pipeline`, default the deployment's) and hand it all
    of it; returns what was submitted. `priority`: the request's class (None: `default_priority`,
    the entry point's)."""
    pipeline = pipeline or state.pipeline
    submitted = await state.store.submit(SubmitRequest(
        input=WorkflowInput(text=text, audio=AudioInput(sample_rate=audio.sample_rate)),
        output_modalities=modalities, stage_params=stage_params or {}, deadline_s=deadline_s,
        pipeline=pipeline_ref(pipeline), priority=priority), tenant=tenant, priority=default_priority)
    step = int(CHUNK_S * audio.sample_rate)
    chunks = [np.ascontiguousarray(audio.pcm[i:i + step]) for i in range(0, audio.pcm.size, step)]
    try:
        await state.store.append_input(submitted.id, chunks, final=True, sample_rate=audio.sample_rate,
                                       stage=pipeline.audio_stage)
    except (OmniflowError, asyncio.CancelledError):
        state.spawn(state.store.abort(submitted.id, reason="its audio input could not be appended"))
        raise
    return submitted


def segments(usage: dict[str, Any]) -> list[dict[str, Any]]:
    """The recognised segments `[{start, end, text}]` an ASR stage reported in its usage."""
    timeline = usage.get("timeline")
    if not isinstance(timeline, list):
        return []
    return [t for t in timeline if isinstance(t, dict) and isinstance(t.get("text"), str)]


def heard(doc: dict[str, Any], stage: str) -> str:
    """What `stage` (an ASR) heard: its final text, else its segments joined."""
    out = doc.get("outputs", {}).get(stage, {})
    if isinstance(out, dict) and out.get("text"):
        return str(out["text"])
    usage = doc.get("stages", {}).get(stage, {}).get("usage") or {}
    return " ".join(seg["text"] for seg in segments(usage))
