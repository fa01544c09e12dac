"""The realtime session state machine (pure: no I/O). Client events in, effects out.

    idle ──response.create──► responding ──(the turn's workflow ends)──► idle
                                 │ response.cancel: the turn is aborted, then it ends as `cancelled`

State (persisted, `SessionState`): the configuration, the conversation items, the user items not
yet answered, the active response (with its workflow once submitted) and the last finished one
(so a client that reconnects can still get the end of it).

Audio turns (a pipeline that takes audio): the input buffer is not held here but streamed into
the workflow that will answer it. The first append of a buffer (with server VAD: the start of
speech, with `prefix_padding_ms` of what came before) opens the turn (`OpenInput`: the workflow
is submitted, its input left open, persisted as `SessionState.input`); every append goes to it
(`AppendInput`), so the ASR stage hears the user while they speak; the commit ends its input
(`EndInput`) and makes the user item, whose transcript arrives when the ASR stage is done
(`transcribed`). A `response.create` that answers just that item follows the workflow that is
already running; anything else (text items, several items) is answered by a new workflow from
the items' text. `input_audio_buffer.clear` aborts the open turn (`DropInput`). New speech while
a response plays (server VAD's speech start, or a manual commit) cancels the response first
(barge-in), and a `response.create` that arrives while the cancelled turn is still ending waits
for its end.

Effects the connection carries out, in order: `Send` a server event, `Save` the state, start a
turn (`StartTurn`: submit its workflow, then follow it) or cancel it (`CancelTurn`: abort it).
Every refused event raises `ProtocolError`; the state is then unchanged.
The records and the effects are plain data, in `omniflow.api.realtime.records` (imported from here too).
"""
from __future__ import annotations

import base64
import binascii
import time
from typing import Any

from pydantic import ValidationError

from omniflow.api.realtime.config import Capabilities, SessionConfig, apply_update, check_knob, check_modalities, resolve_voice
from omniflow.api.realtime.records import (
    AppendInput,
    CancelTurn,
    DetectSpeech,
    DropInput,
    Effect,
    EndInput,
    InputTurn,
    Item,
    OpenInput,
    Response,
    ResponseStatus,
    Save,
    Send,
    SessionState,
    StartTurn,
)
from omniflow.api.realtime.events import (
    AudioAppend,
    AudioClear,
    AudioCommit,
    ClientEvent,
    MAX_ITEMS,
    ItemBody,
    ItemCreate,
    ProtocolError,
    ResponseBody,
    ResponseCancel,
    ResponseCreate,
    SessionUpdate,
    error_event,
    new_id,
    server_event,
    validation_error,
)

__all__ = ["MAX_ITEMS", "MIN_COMMIT_BYTES", "RealtimeSession", "session_id"]

MIN_COMMIT_BYTES = 2 * 2400        # 100 ms of pcm16 at 24 kHz: less is refused, as OpenAI does


def session_id() -> str:
    return new_id("sess")


class RealtimeSession:
    """One session's state machine; `state` is what gets persisted."""

    def __init__(self, state: SessionState, caps: Capabilities) -> None:
        self.state, self.caps = state, caps
        self.buffer = bytearray()          # input audio (pcm16 24 kHz) since the last commit or clear (text-only)
        self.buffered = 0                  # bytes streamed into the open audio turn
        self.queued: ResponseCreate | None = None     # a response.create waiting for a cancelled turn's end

    @classmethod
    def new(cls, caps: Capabilities, *, tenant: str) -> RealtimeSession:
        state = SessionState(id=session_id(), model=caps.model, tenant=tenant, created_at=int(time.time()),
                             config=SessionConfig.default(caps))
        return cls(state, caps)

    def session_view(self, ttl_s: int) -> dict[str, Any]:
        return self.state.config.view(session_id=self.state.id, model=self.state.model,
                                      expires_at=int(time.time()) + ttl_s)

    # ------------------------------------------------------------ client events
    def handle(self, event: ClientEvent, *, ttl_s: int) -> list[Effect]:
        """The effects of one client event; ProtocolError (state unchanged) when it is refused."""
        try:
            if isinstance(event, SessionUpdate):
                self.state.config = apply_update(self.state.config, event.session, self.caps, event_id=event.event_id)
                return [Save(), Send(server_event("session.updated", session=self.session_view(ttl_s)))]
            if isinstance(event, AudioAppend):
                return self._append(event)
            if isinstance(event, AudioCommit):
                return self._commit()
            if isinstance(event, AudioClear):
                return self._clear()
            if isinstance(event, ItemCreate):
                return self._create_item(event)
            if isinstance(event, ResponseCreate):
                return self._create_response(event)
            if isinstance(event, ResponseCancel):
                return self._cancel(event)
        except ProtocolError as err:
            err.event_id = err.event_id or event.event_id
            raise
        raise ProtocolError("unknown_event_type", f"event type {event.type!r} is not supported", param="type",
                            event_id=event.event_id)

    def _append(self, event: AudioAppend) -> list[Effect]:
        pcm = self._decode_append(event)
        if not self.caps.audio_input:
            self.buffer += pcm
            return []
        if self.detects_speech:
            return [DetectSpeech(pcm)]
        return self._speech_audio(pcm)

    @property
    def detects_speech(self) -> bool:
        detection = self.state.config.turn_detection
        return bool(self.caps.audio_input and detection and detection.get("type") == "server_vad")

    def _open_input(self) -> list[Effect]:
        config = self.state.config
        turn = InputTurn(item_id=new_id("item"), request_id=new_id("turn"), modalities=list(config.output_modalities),
                         knobs={k: v for k, v in config.knobs().items() if v is not None}, voice=config.voice)
        self.state.input = turn
        return [OpenInput(turn), Save()]

    def _speech_audio(self, pcm: bytes) -> list[Effect]:
        """Audio of the turn being spoken: opens it if it is the first, then streams it in."""
        effects: list[Effect] = [] if self.state.input is not None else self._open_input()
        if self.buffered + len(pcm) > self.caps.max_buffer_bytes:
            limit_s = self.caps.max_buffer_bytes / 48000
            raise ProtocolError("input_audio_buffer_too_large", f"audio: the input buffer would hold more than "
                                f"{limit_s:g} s of audio; commit or clear it first", param="audio")
        self.buffered += len(pcm)
        return [*effects, AppendInput(pcm)] if pcm else effects

    # ------------------------------------------------------------ server VAD (the connection's detector)
    def speech_started(self, prefix: bytes, audio_start_ms: int) -> list[Effect]:
        """Speech began (`prefix`: the audio before it that the turn keeps): open the turn, and
        interrupt a response that is playing (barge-in)."""
        effects = self._barge_in()
        effects += self._speech_audio(prefix) if prefix else ([] if self.state.input else self._open_input())
        assert self.state.input is not None
        effects.append(Send(server_event("input_audio_buffer.speech_started", audio_start_ms=audio_start_ms,
                                         item_id=self.state.input.item_id)))
        return effects

    def speech(self, pcm: bytes) -> list[Effect]:
        """Audio while the user speaks (server VAD)."""
        return self._speech_audio(pcm) if self.state.input is not None else []

    def speech_stopped(self, audio_end_ms: int) -> list[Effect]:
        """Speech ended: commit the turn and, unless the session says not to, answer it."""
        if self.state.input is None:
            return []
        detection = self.state.config.turn_detection or {}
        effects: list[Effect] = [Send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms,
                                                   item_id=self.state.input.item_id))]
        effects += self._commit()
        if detection.get("create_response", True):
            effects += self._create_response(ResponseCreate(type="response.create"))
        return effects

    def _barge_in(self) -> list[Effect]:
        response = self.state.response
        detection = self.state.config.turn_detection or {}
        if response is None or response.cancelling or (not detection.get("interrupt_response", True) and \
                self.detects_speech):
            return []
        response.cancelling = True
        return [CancelTurn(response), Save()]

    def _decode_append(self, event: AudioAppend) -> bytes:
        try:
            pcm = base64.b64decode(event.audio, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("invalid_value", "audio: not base64", param="audio") from None
        if len(pcm) % 2:
            raise ProtocolError("invalid_value", f"audio: {len(pcm)} bytes is not whole pcm16 samples "
                                "(16-bit little-endian mono at 24 kHz)", param="audio")
        if len(self.buffer) + len(pcm) > self.caps.max_buffer_bytes:
            limit_s = self.caps.max_buffer_bytes / 48000
            raise ProtocolError("input_audio_buffer_too_large", f"audio: the input buffer would hold more than "
                                f"{limit_s:g} s of audio; commit or clear it first", param="audio")
        return pcm

    def _commit(self) -> list[Effect]:
        held = self.buffered if self.caps.audio_input else len(self.buffer)
        if held < MIN_COMMIT_BYTES:
            raise ProtocolError("input_audio_buffer_commit_empty", f"the input audio buffer holds "
                                f"{held / 48:.0f} ms of audio; a commit needs at least 100 ms")
        effects: list[Effect] = []
        turn = self.state.input
        if turn is not None:
            effects = self._barge_in()            # a new turn while a response plays: the user interrupts it
            item = Item(id=turn.item_id, role="user", kind="audio", transcript=None, wf_id=turn.wf_id,
                        turn=turn.model_copy(update={"committed": True}))
            self.state.input = None
            effects.append(EndInput(turn))
        else:
            item = Item(id=new_id("item"), role="user", kind="audio", transcript=None)
        previous = self._add_item(item)
        self.buffer.clear()
        self.buffered = 0
        return [*effects, Save(),
                Send(server_event("input_audio_buffer.committed", item_id=item.id, previous_item_id=previous)),
                *self._item_events(item, previous)]

    def _clear(self) -> list[Effect]:
        self.buffer.clear()
        self.buffered = 0
        turn, self.state.input = self.state.input, None
        dropped: list[Effect] = [DropInput(turn), Save()] if turn is not None else []
        return [*dropped, Send(server_event("input_audio_buffer.cleared"))]

    def transcribed(self, item_id: str, transcript: str | None, *, seconds: float = 0.0,
                    error: str | None = None) -> list[Effect]:
        """What the ASR heard of a committed audio item (None and `error`: it heard nothing)."""
        item = next((i for i in self.state.items if i.id == item_id), None)
        if transcript is None:
            return [Send(server_event("conversation.item.input_audio_transcription.failed", item_id=item_id,
                                      content_index=0, error={"type": "transcription_error",
                                                              "code": "transcription_failed",
                                                              "message": error or "nothing was heard"}))]
        effects: list[Effect] = []
        if item is not None:
            item.transcript = transcript
            effects.append(Save())
        return [*effects, Send(server_event("conversation.item.input_audio_transcription.completed", item_id=item_id,
                                            content_index=0, transcript=transcript,
                                            usage={"type": "duration", "seconds": round(seconds, 3)}))]

    def _add_item(self, item: Item) -> str | None:
        previous = self.state.items[-1].id if self.state.items else None
        self.state.items.append(item)
        if item.role == "user":
            self.state.pending.append(item.id)
        del self.state.items[:-MAX_ITEMS]
        kept = {i.id for i in self.state.items}
        self.state.pending = [i for i in self.state.pending if i in kept]
        return previous

    @staticmethod
    def _item_events(item: Item, previous: str | None) -> list[Effect]:
        return [Send(server_event("conversation.item.added", previous_item_id=previous, item=item.view())),
                Send(server_event("conversation.item.done", previous_item_id=previous, item=item.view()))]

    def _parse_item(self, raw: dict[str, Any], param: str) -> Item:
        try:
            body = ItemBody.model_validate(raw)
        except ValidationError as exc:
            raise validation_error(exc, prefix=param) from None
        texts = []
        for n, part in enumerate(body.content):
            if part.type == "input_audio":
                how = ("stream audio with input_audio_buffer.append and .commit" if self.caps.audio_input
                       else f"model {self.caps.model!r} takes text only; send input_text")
                raise ProtocolError("unsupported_value", f"{param}.content.{n}: audio in an item is not taken: {how}",
                                    param=f"{param}.content.{n}.type")
            texts.append(part.text or "")
        text = " ".join(t for t in texts if t)
        if not text.strip():
            raise ProtocolError("invalid_value", f"{param}.content: no text", param=f"{param}.content")
        if len(text) > self.caps.max_prompt_chars:
            raise ProtocolError("invalid_value", f"{param}.content: {len(text)} characters; the limit is "
                                f"{self.caps.max_prompt_chars}", param=f"{param}.content")
        if body.id and any(i.id == body.id for i in self.state.items):
            raise ProtocolError("invalid_value", f"{param}.id: an item {body.id!r} exists already", param=f"{param}.id")
        return Item(id=body.id or new_id("item"), role="user", kind="text", text=text)

    def _create_item(self, event: ItemCreate) -> list[Effect]:
        item = self._parse_item(event.item, "item")
        if event.previous_item_id is not None and event.previous_item_id != "root" and not any(
                i.id == event.previous_item_id for i in self.state.items):
            raise ProtocolError("item_not_found", f"previous_item_id: no item {event.previous_item_id!r}",
                                param="previous_item_id")
        previous = self._add_item(item)
        return [Save(), *self._item_events(item, previous)]

    def _create_response(self, event: ResponseCreate) -> list[Effect]:
        if self.state.response is not None and self.state.response.cancelling and self.queued is None:
            self.queued = event            # the interrupted turn is ending: answer once it has
            return []
        if self.state.response is not None:
            raise ProtocolError("conversation_already_has_active_response",
                                f"response {self.state.response.id} is in progress; cancel it or wait for its "
                                "response.done")
        try:
            body = ResponseBody.model_validate(event.response or {})
        except ValidationError as exc:
            raise validation_error(exc, prefix="response") from None
        if body.tools:
            raise ProtocolError("unsupported_parameter", "response.tools: the pipelines make no tool calls",
                                param="response.tools")
        if body.conversation not in (None, "auto", "none"):
            raise ProtocolError("unsupported_value", "response.conversation: only 'auto' and 'none'",
                                param="response.conversation")
        config = self.state.config
        modalities = (check_modalities(list(body.output_modalities), self.caps, "response.output_modalities")
                      if body.output_modalities else config.output_modalities)
        voice = config.voice
        out = (body.audio or {}).get("output") if isinstance(body.audio, dict) else None
        if isinstance(out, dict) and out.get("voice") is not None:
            raw = out["voice"]
            voice = resolve_voice(raw if isinstance(raw, str) else str(dict(raw).get("id", "")), self.caps,
                                  "response.audio.output.voice")
        knobs = config.knobs()
        if body.instructions is not None:
            knobs["instructions"] = body.instructions or None
            check_knob("instructions", knobs["instructions"], self.caps, param="response.instructions")
        if "max_output_tokens" in body.model_fields_set:
            knobs["max_output_tokens"] = body.max_output_tokens if isinstance(body.max_output_tokens, int) else None
            check_knob("max_output_tokens", knobs["max_output_tokens"], self.caps, param="response.max_output_tokens")
        knobs = {k: v for k, v in knobs.items() if v is not None}
        heard = self._spoken_turn(body)
        prompt = "" if heard is not None else self._prompt(body)
        response_id = new_id("resp")
        if heard is not None and heard.turn is not None:
            turn = heard.turn
            # its workflow makes what the session asked for when the user began speaking: text from it
            # always, audio if that was asked then
            for name, differs in (("output_modalities", "audio" in modalities and "audio" not in turn.modalities),
                                  ("instructions", knobs != turn.knobs)):
                if differs:
                    raise ProtocolError("unsupported_value", f"response.{name}: item {heard.id}'s workflow was "
                                        "started with the session's configuration when the user began speaking; "
                                        "set it with session.update before speaking", param=f"response.{name}")
            turn.answered = True
        response = Response(id=response_id, item_id=new_id("item"), modalities=modalities, prompt=prompt, voice=voice,
                            request_id=response_id, in_conversation=body.conversation != "none",
                            metadata=body.metadata, knobs=knobs, wf_id=heard.wf_id if heard is not None else "")
        if response.in_conversation:
            self.state.pending = []
        self.state.response = response
        return [Save(), StartTurn(response)]

    def _spoken_turn(self, body: ResponseBody) -> Item | None:
        """The audio item whose running workflow answers this response: the one item to answer,
        committed audio whose workflow no response follows yet."""
        if body.input or not self.caps.audio_input:
            return None
        by_id = {i.id: i for i in self.state.items}
        chosen = [by_id[i] for i in self.state.pending if i in by_id]
        if len(chosen) == 1 and chosen[0].wf_id and chosen[0].turn is not None and not chosen[0].turn.answered:
            return chosen[0]
        return None

    def _prompt(self, body: ResponseBody) -> str:
        """The text a turn answers: the response's own `input`, else the user items not answered yet,
        else the last user item again."""
        if body.input:
            return "\n".join(self._parse_item(raw, f"response.input.{n}").text for n, raw in enumerate(body.input))
        by_id = {i.id: i for i in self.state.items}
        chosen = [by_id[i] for i in self.state.pending if i in by_id]
        if not chosen:
            users = [i for i in self.state.items if i.role == "user"]
            chosen = users[-1:]
        if not chosen:
            raise ProtocolError("no_input", "there is nothing to respond to: add a user item "
                                "(conversation.item.create) first")
        if any(i.kind == "audio" and i.transcript is None for i in chosen):
            if self.caps.audio_input:
                raise ProtocolError("transcript_not_ready", "a committed audio item is not transcribed yet: answer "
                                    "it alone (response.create right after its commit), or wait for its "
                                    "conversation.item.input_audio_transcription.completed")
            raise ProtocolError("unsupported_value", f"model {self.caps.model!r} takes text only: it cannot "
                                "answer committed audio (clear it, or add a text item)", param="input_audio_buffer")
        return "\n".join(i.text if i.kind == "text" else (i.transcript or "") for i in chosen)

    def _cancel(self, event: ResponseCancel) -> list[Effect]:
        response = self.state.response
        if response is None or response.cancelling:
            raise ProtocolError("response_cancel_not_active", "there is no response in progress to cancel")
        if event.response_id and event.response_id != response.id:
            raise ProtocolError("response_cancel_not_active", f"response_id: {event.response_id!r} is not the "
                                f"response in progress ({response.id})", param="response_id")
        response.cancelling = True
        return [CancelTurn(response), Save()]          # the abort first: it is what barge-in waits for

    # ------------------------------------------------------------ the turn's side
    def turn_submitted(self, response_id: str, wf_id: str) -> list[Effect]:
        response = self.state.response
        if response is None or response.id != response_id:
            return []
        response.wf_id = wf_id
        return [Save()]

    def turn_ended(self, response_id: str, status: ResponseStatus, text: str, events: int) -> list[Effect]:
        """The turn's last event was sent: the answer joins the conversation, the session is idle."""
        response = self.state.response
        if response is None or response.id != response_id:
            return []
        response.status, response.events = status, events
        if response.in_conversation and (text or status is ResponseStatus.COMPLETED):
            self._add_item(Item(id=response.item_id, role="assistant", kind="audio" if "audio" in response.modalities
                                else "text", text=text,
                                status="completed" if status is ResponseStatus.COMPLETED else "incomplete"))
        self.state.last_response, self.state.response = response, None
        queued, self.queued = self.queued, None
        if queued is not None:             # a response.create that waited for this turn to end
            try:
                return [Save(), *self._create_response(queued)]
            except ProtocolError as err:
                err.event_id = err.event_id or queued.event_id
                return [Save(), Send(error_event(err))]
        return [Save()]
