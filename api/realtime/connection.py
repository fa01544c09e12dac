"""The realtime transport: one WebSocket's loop, the state machine's effects carried out against
the store and the log hub, and each turn followed from its workflow's log.

One task reads the socket: each message is parsed, handed to the session state machine
(`omniflow.api.realtime.state`) and its effects run in order (send, save, submit a turn, abort
it). A turn is followed by a task of its own, which turns the workflow's log into the turn's
numbered events (`omniflow.api.realtime.turn`): text entries become text or transcript deltas,
audio entries the audio stage's chunks, resampled to pcm16 at 24 kHz by one stateful resampler
per turn (no clicks at chunk joins), and the terminal entry the closing events.

A closed socket does not end the turn: its workflow runs on, and a client that reconnects with
the session id (`?session_id=`, and `&last_event_id=` for where it was) is sent the rest of it,
built again from the log. After `response.cancel` the turn's deltas are no longer sent, and the
workflow is aborted on every stage (one `abort.lua` call; the workers' sessions are cancelled by
its pub/sub fan-out).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from starlette.websockets import WebSocket

from omniflow import tracing
from omniflow.api import knobs
from omniflow.api.deps import ApiState
from omniflow.api.realtime.config import PCM_RATE, Capabilities
from omniflow.api.realtime.events import ProtocolError, error_event, parse_client_event, server_event
from omniflow.api.realtime.records import (
    AppendInput,
    CancelTurn,
    DetectSpeech,
    DropInput,
    Effect,
    EndInput,
    InputTurn,
    OpenInput,
    Response,
    ResponseStatus,
    Save,
    Send,
    StartTurn,
)
from omniflow.api.realtime.state import RealtimeSession
from omniflow.api.realtime.vad import SpeechDetector
from omniflow.api.transcribe import heard
from omniflow.api.realtime.turn import AudioFeed, Resume, TurnEvents, parse_event_id
from omniflow.client.realtime import SaveResult
from omniflow.client.store import Store
from omniflow.errors import AdmissionRefused, InputClosed, OmniflowError
from omniflow.models import AudioInput, Priority, StageStatus, SubmitRequest, WorkflowInput, WorkflowState

logger = logging.getLogger(__name__)

TAKEN_CLOSE_CODE = 4000          # another connection claimed the session (not a code a client retries)
CANCEL_REASON = "response.cancel (realtime)"


class _Gone(Exception):
    """The socket is closed: nothing more can be sent on it."""


def _usage(doc: dict[str, Any]) -> dict[str, Any]:
    usages = [st.get("usage") or {} for st in doc.get("stages", {}).values()]
    prompt = sum(int(u.get("prompt_tokens", 0)) for u in usages)
    completion = sum(int(u.get("completion_tokens", 0)) for u in usages)
    return {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}


class Connection:
    """One WebSocket of one realtime session."""

    def __init__(self, ws: WebSocket, api: ApiState, session: RealtimeSession, *, owner: str,
                 resume: Resume | None = None) -> None:
        self.ws, self.api, self.session, self.owner, self.resume = ws, api, session, owner, resume
        self.caps: Capabilities = session.caps
        # the pipeline the session's model names (`?model=`; the registry knows every one served)
        self.pipeline = api.store.catalog.find(self.caps.model) or api.pipeline
        by_kind = self.pipeline.modalities()
        self.text_stage: str | None = by_kind["text"][0] if by_kind.get("text") else None
        self.audio_stage: str | None = by_kind["audio"][0] if by_kind.get("audio") else None
        self._send_lock = asyncio.Lock()
        self._save_lock = asyncio.Lock()
        self._follower: asyncio.Task[None] | None = None
        self._transcribers: set[asyncio.Task[None]] = set()
        self._detector: SpeechDetector | None = None
        self._closed = False

    @property
    def store(self) -> Store:
        return self.api.store

    # ------------------------------------------------------------ the loop
    async def run(self) -> None:
        try:
            await self.send(server_event("session.created",
                                         session=self.session.session_view(self.api.settings.realtime_session_ttl_s)))
            await self._resume()
            while not self._closed:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                await self._on_message(message)
        except _Gone:
            pass
        finally:
            self._closed = True
            tasks = [*self._transcribers, *([self._follower] if self._follower is not None else [])]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _on_message(self, message: Mapping[str, Any]) -> None:
        text = message.get("text")
        try:
            if text is None:
                raise ProtocolError("invalid_event", "binary messages are not events: send each event as JSON text")
            event = parse_client_event(text)
            effects = self.session.handle(event, ttl_s=self.api.settings.realtime_session_ttl_s)
        except ProtocolError as err:
            await self.send(error_event(err))
            return
        try:
            await self._apply(effects)
        except ProtocolError as err:         # an effect refused (the turn's workflow gone, no VAD here...)
            err.event_id = err.event_id or event.event_id
            await self.send(error_event(err))
        except OmniflowError as exc:         # Redis went away mid-event: say so, keep the connection
            logger.warning("realtime session %s: %s failed: %s", self.session.state.id, event.type, exc)
            await self.send(error_event(ProtocolError("server_error", f"{event.type} could not be carried out: {exc}",
                                                      event_id=event.event_id, kind="server_error")))

    async def _apply(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Send):
                await self.send(effect.event)
            elif isinstance(effect, Save):
                await self._save()
            elif isinstance(effect, StartTurn):
                await self._start_turn(effect.response)
            elif isinstance(effect, CancelTurn):
                await self._cancel_turn(effect.response)
            elif isinstance(effect, OpenInput):
                await self._open_input(effect.turn)
            elif isinstance(effect, AppendInput):
                await self._append_input(effect.pcm)
            elif isinstance(effect, EndInput):
                await self._end_input(effect.turn)
            elif isinstance(effect, DropInput):
                if effect.turn.wf_id:
                    await self.store.abort(effect.turn.wf_id, reason="input_audio_buffer.clear (realtime)")
            elif isinstance(effect, DetectSpeech):
                await self._detect(effect.pcm)

    async def send(self, event: dict[str, Any]) -> None:
        if self._closed:
            raise _Gone
        async with self._send_lock:
            try:
                await self.ws.send_text(json.dumps(event))
            except Exception as exc:  # noqa: BLE001 - any failure to write means the client is gone
                self._closed = True
                raise _Gone from exc

    async def _save(self) -> None:
        state = self.session.state
        async with self._save_lock:          # one write at a time, each of the state as it is now
            result = await self.store.realtime.save(state.id, owner=self.owner, tenant=state.tenant,
                                                    state=state.model_dump(mode="json"))
        if result is SaveResult.TAKEN:
            logger.info("realtime session %s: taken over by another connection; closing this one", state.id)
            self._closed = True
            with contextlib.suppress(Exception):
                await self.ws.close(TAKEN_CLOSE_CODE, "the session was taken over by another connection")
            raise _Gone
        if result is SaveResult.GONE:
            logger.warning("realtime session %s expired while connected; saving it again", state.id)
            await self.store.realtime.create(state.id, owner=self.owner, tenant=state.tenant,
                                             state=state.model_dump(mode="json"))

    # ------------------------------------------------------------ audio turns
    async def _open_input(self, turn: InputTurn) -> None:
        """Submit the workflow an audio turn streams into (its input stays open until the commit)."""
        tenant = self.session.state.tenant
        wait_s = self.api.submit_limiter.acquire(tenant)
        try:
            if wait_s > 0:
                raise AdmissionRefused(f"tenant {tenant!r} is over its submit rate; retry in {wait_s:.2f}s",
                                       retry_after_s=wait_s)
            submitted = await self.store.submit(SubmitRequest(
                input=WorkflowInput(audio=AudioInput(sample_rate=PCM_RATE)),
                output_modalities=self._workflow_modalities(turn.modalities),
                stage_params=knobs.stage_params(self.pipeline, turn.knobs), request_id=turn.request_id,
                pipeline=f"{self.pipeline.name}@{self.pipeline.digest}"),
                tenant=tenant, priority=Priority.INTERACTIVE)
        except OmniflowError as exc:
            self.session.state.input = None
            raise ProtocolError("input_audio_buffer_unavailable", f"the turn cannot start: {exc}",
                                param="audio", kind="server_error") from exc
        turn.wf_id = submitted.id

    async def _append_input(self, pcm: bytes) -> None:
        turn = self.session.state.input
        if turn is None or not turn.wf_id:
            return
        try:
            await self.store.append_input(turn.wf_id, np.frombuffer(pcm, dtype="<i2"), sample_rate=PCM_RATE,
                                          stage=self.pipeline.audio_stage)
        except InputClosed as exc:           # the turn's workflow ended (its audio refused, its deadline...)
            self.session.state.input, self.session.buffered = None, 0
            await self._save()
            raise ProtocolError("input_audio_buffer_closed", f"the turn in progress ended: {exc}; the buffer was "
                                "cleared, the next append starts a new turn", param="audio") from exc

    async def _end_input(self, turn: InputTurn) -> None:
        if not turn.wf_id:
            return
        with contextlib.suppress(InputClosed):        # ended already: the transcriber reports why
            await self.store.append_input(turn.wf_id, final=True, stage=self.pipeline.audio_stage)
        self._transcribe(turn.item_id, turn.wf_id)

    def _transcribe(self, item_id: str, wf_id: str) -> None:
        task = asyncio.create_task(self._transcriber(item_id, wf_id), name=f"realtime:heard:{item_id}")
        self._transcribers.add(task)
        task.add_done_callback(self._transcribers.discard)

    async def _transcriber(self, item_id: str, wf_id: str) -> None:
        """Report what the turn's ASR heard once it is done (`...input_audio_transcription.completed`)."""
        stage = self.pipeline.audio_stage or ""
        ended = {StageStatus.DONE.value, StageStatus.FAILED.value, StageStatus.ABORTED.value}
        try:
            async with self.api.hub.follow(wf_id) as entries:
                async for _eid, entry in entries:
                    if entry.get("t") == "terminal" or (entry.get("t") == "stage" and entry.get("stage") == stage
                                                        and entry.get("status") in ended):
                        break
            doc = await self.store.document(wf_id)
            status = doc["stages"].get(stage, {}).get("status")
            if status == StageStatus.DONE.value:
                usage = doc["stages"][stage].get("usage") or {}
                effects = self.session.transcribed(item_id, heard(doc, stage),
                                                   seconds=float(usage.get("audio_seconds", 0.0)))
            else:
                effects = self.session.transcribed(item_id, None, error=str(doc.get("error") or f"the ASR {status}"))
            await self._apply(effects)
        except (_Gone, asyncio.CancelledError):
            return
        except OmniflowError as exc:
            logger.warning("realtime %s: transcript of %s failed: %s", self.session.state.id, item_id, exc)

    async def _detect(self, pcm: bytes) -> None:
        """Server VAD: speech start opens the turn (and interrupts a response), speech stop commits it."""
        detection = self.session.state.config.turn_detection or {}
        if self._detector is None:
            self._detector = SpeechDetector.from_config(detection)
        try:
            events, prefix = await self._detector.push(pcm)
        except Exception as exc:  # noqa: BLE001 - the model missing or failing: say so, keep the connection
            raise ProtocolError("server_vad_unavailable", f"server VAD cannot run here: {exc}; set "
                                "turn_detection to null and commit by hand", kind="server_error") from exc
        if not events:
            await self._apply(self.session.speech(pcm) if self._detector.detector.speaking else [])
            return
        for kind, at_ms in events:
            if kind == "started":
                await self._apply(self.session.speech_started(prefix, at_ms))
            else:
                await self._apply(self.session.speech_stopped(at_ms))

    # ------------------------------------------------------------ turns
    def _workflow_modalities(self, modalities: list[str]) -> list[str]:
        if "audio" in modalities:
            return ["text", "audio"] if self.text_stage else ["audio"]
        return ["text"]

    async def _start_turn(self, response: Response, *, after: int = -1) -> None:
        if response.wf_id:                # an audio turn: its workflow runs since the user began speaking
            self._follower = asyncio.create_task(self._follow(response, after=after, live=True),
                                                 name=f"realtime:{response.id}")
            return
        tenant = self.session.state.tenant
        try:
            wait_s = self.api.submit_limiter.acquire(tenant)
            if wait_s > 0:
                raise AdmissionRefused(f"tenant {tenant!r} is over its submit rate; retry in {wait_s:.2f}s",
                                       retry_after_s=wait_s)
            # a span per turn (tracing on): the turn's workflow is its child, the connection its parent
            with tracing.span("realtime turn", attributes={"realtime.response.id": response.id}):
                submitted = await self.store.submit(SubmitRequest(
                    input=WorkflowInput(text=response.prompt),
                    output_modalities=self._workflow_modalities(response.modalities),
                    stage_params=knobs.stage_params(self.pipeline, response.knobs), request_id=response.request_id,
                    pipeline=f"{self.pipeline.name}@{self.pipeline.digest}"), tenant=tenant,
                    priority=Priority.INTERACTIVE)
        except OmniflowError as exc:
            await self._refuse_turn(response, exc)
            return
        await self._apply(self.session.turn_submitted(response.id, submitted.id))
        self._follower = asyncio.create_task(self._follow(response, after=after, live=True),
                                             name=f"realtime:{response.id}")

    async def _refuse_turn(self, response: Response, exc: OmniflowError) -> None:
        """A turn whose workflow could not be submitted: created, then done as failed."""
        turn = TurnEvents(response)
        code = getattr(exc, "code", None) or "server_error"
        events = [*turn.start(), *turn.end(ResponseStatus.FAILED,
                                           error={"type": "server_error", "code": code, "message": str(exc)})]
        for event in events:
            await self.send(event)
        await self._apply(self.session.turn_ended(response.id, ResponseStatus.FAILED, "", turn.n))

    async def _cancel_turn(self, response: Response) -> None:
        if not response.wf_id:
            return
        started = time.perf_counter()
        state = await self.store.abort(response.wf_id, reason=CANCEL_REASON)
        logger.info("realtime %s: response %s cancelled, workflow %s %s in %.1f ms", self.session.state.id,
                    response.id, response.wf_id, state, (time.perf_counter() - started) * 1000)

    async def _resume(self) -> None:
        """A reconnected session: the end of the last turn the client had not received, then the
        turn in progress (from where the client was, or from its start)."""
        state, resume = self.session.state, self.resume
        for item in state.items:          # committed audio whose transcript had not come yet
            if item.kind == "audio" and item.transcript is None and item.wf_id:
                self._transcribe(item.id, item.wf_id)
        last = state.last_response
        if resume and last and resume.response_id == last.id and resume.after < last.events - 1 and last.wf_id:
            await self._follow(last, after=resume.after, live=False)
        active = state.response
        if active is None:
            return
        after = resume.after if resume and resume.response_id == active.id else -1
        if not active.wf_id:           # saved, then the process died before the submit: submit it (idempotent)
            await self._start_turn(active, after=after)
        else:
            self._follower = asyncio.create_task(self._follow(active, after=after, live=True),
                                                 name=f"realtime:{active.id}")

    async def _follow(self, response: Response, *, after: int, live: bool) -> None:
        """Send the turn's events past `after`; with `live`, end the turn in the session at its end."""
        turn = TurnEvents(response)

        async def emit(events: list[dict[str, Any]], *, delta: bool = False) -> None:
            for event in events:
                n = parse_event_id(event["event_id"])
                if n is not None and n[1] <= after:
                    continue
                if delta and live and response.cancelling:
                    continue            # the client cancelled: no more of this answer
                await self.send(event)

        try:
            await emit(turn.start())
            status, error, doc = await self._pump(response, turn, emit)
            await emit(turn.end(status, transcript=None if self.text_stage else response.prompt, error=error,
                                usage=_usage(doc) if doc else None))
            if live:
                await self._apply(self.session.turn_ended(response.id, status, turn.text or (
                    "" if self.text_stage else response.prompt), turn.n))
        except _Gone:
            return
        except OmniflowError as exc:
            logger.warning("realtime %s: following response %s failed: %s", self.session.state.id, response.id, exc)
            with contextlib.suppress(_Gone):
                await self.send(error_event(ProtocolError("server_error", f"response {response.id}: {exc}",
                                                          kind="server_error")))

    async def _pump(self, response: Response, turn: TurnEvents, emit: Any
                    ) -> tuple[ResponseStatus, dict[str, Any] | None, dict[str, Any] | None]:
        """The workflow's log as deltas until its terminal: (status, error, the workflow document)."""
        wf_id = response.wf_id
        if await self.store.state(wf_id) is None:
            return ResponseStatus.FAILED, {"type": "server_error", "code": "turn_expired",
                                           "message": f"the turn's workflow {wf_id} is gone (expired)"}, None
        feed = AudioFeed(self.store, wf_id, self.audio_stage) if self.audio_stage and turn.audio else None
        terminal: dict[str, str] = {}
        async with self.api.hub.follow(wf_id) as entries:
            async for _eid, entry in entries:
                kind, stage = entry.get("t"), entry.get("stage")
                if kind == "text" and stage == self.text_stage:
                    await emit(turn.text_delta(entry.get("delta", "")), delta=True)
                elif kind == "audio" and feed is not None and stage == self.audio_stage:
                    await emit(turn.audio_delta(await feed.next()), delta=True)
                elif kind == "terminal":
                    terminal = entry
                    break
        if feed is not None:
            await emit(turn.audio_delta(feed.flush()), delta=True)
        doc = await self.store.document(wf_id)
        state = terminal.get("state") or doc["state"]
        if state == WorkflowState.COMPLETED.value:
            return ResponseStatus.COMPLETED, None, doc
        if state == WorkflowState.ABORTED.value and response.cancelling:
            return ResponseStatus.CANCELLED, None, doc
        where = f" (stage {doc['error_stage']})" if doc.get("error_stage") else ""
        return ResponseStatus.FAILED, {"type": "server_error", "code": f"workflow_{state}",
                                       "message": f"workflow {wf_id} {state}{where}: {doc.get('error')}"}, doc
