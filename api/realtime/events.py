"""Realtime events: client events parsed and checked, server events built.

Every client event that is not valid JSON, not an object, of an unknown type or with bad fields
raises `ProtocolError`, which the connection turns into an `error` event naming the offending
event's id; the connection stays usable. Server events get fresh ids here (`event_<hex>`),
except a turn's, which `omniflow.api.realtime.turn` numbers so that a reconnect can resume them.
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_EVENT_ID_CHARS = 256


class ProtocolError(Exception):
    """A client event the session refuses: becomes an `error` event (`invalid_request_error`)."""

    def __init__(self, code: str, message: str, *, param: str | None = None, event_id: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.event_id, self.kind = code, message, param, event_id, kind


def new_id(kind: str) -> str:
    """A fresh id of `kind` (`event`, `item`, `resp`, `sess`)."""
    return f"{kind}_{uuid.uuid4().hex[:24]}"


class ClientEvent(BaseModel):
    """Fields every client event has."""

    model_config = ConfigDict(extra="allow")

    type: str
    event_id: str | None = Field(None, max_length=MAX_EVENT_ID_CHARS)


class SessionUpdate(ClientEvent):
    type: Literal["session.update"]
    session: dict[str, Any]


class AudioAppend(ClientEvent):
    type: Literal["input_audio_buffer.append"]
    audio: str


class AudioCommit(ClientEvent):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(ClientEvent):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(ClientEvent):
    type: Literal["conversation.item.create"]
    item: dict[str, Any]
    previous_item_id: str | None = None


class ResponseCreate(ClientEvent):
    type: Literal["response.create"]
    response: dict[str, Any] | None = None


class ResponseCancel(ClientEvent):
    type: Literal["response.cancel"]
    response_id: str | None = None


EVENT_TYPES: dict[str, type[ClientEvent]] = {
    "session.update": SessionUpdate,
    "input_audio_buffer.append": AudioAppend,
    "input_audio_buffer.commit": AudioCommit,
    "input_audio_buffer.clear": AudioClear,
    "conversation.item.create": ItemCreate,
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
}


def loc_of(err: Any, prefix: str = "") -> str:
    """A pydantic error's location as a dotted param name (`session.audio.output.voice`)."""
    parts = [prefix] if prefix else []
    parts += [str(p) for p in err.get("loc", ())]
    return ".".join(p for p in parts if p)


def validation_error(exc: ValidationError, *, prefix: str = "", event_id: str | None = None) -> ProtocolError:
    """The first problem of a pydantic validation as a `ProtocolError` naming its field."""
    err = exc.errors()[0]
    param = loc_of(err, prefix)
    return ProtocolError("invalid_value", f"{param or 'event'}: {err.get('msg', 'invalid')}", param=param or None,
                         event_id=event_id)


def parse_client_event(raw: str | bytes) -> ClientEvent:
    """One WebSocket message as a client event, or `ProtocolError`."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("invalid_json", f"the message is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("invalid_event", "an event is a JSON object with a `type`")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    if not isinstance(kind, str) or not kind:
        raise ProtocolError("invalid_event", "the event has no `type`", param="type", event_id=event_id)
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ProtocolError("unknown_event_type", f"event type {kind!r} is not supported; the supported ones are "
                            f"{', '.join(sorted(EVENT_TYPES))}", param="type", event_id=event_id)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, event_id=event_id) from None


def server_event(kind: str, *, event_id: str | None = None, **fields: Any) -> dict[str, Any]:
    """A server event of type `kind` (a fresh id unless given)."""
    return {"type": kind, "event_id": event_id or new_id("event"), **fields}


def error_event(err: ProtocolError) -> dict[str, Any]:
    """The `error` event for a refused client event (its `event_id` names the offending event)."""
    return server_event("error", error={"type": err.kind, "code": err.code, "message": err.message,
                                        "param": err.param, "event_id": err.event_id})


MAX_ITEMS = 64                     # conversation items kept (the oldest go first)


class ResponseBody(BaseModel):
    """`response.create`'s `response` (per-response overrides)."""

    model_config = ConfigDict(extra="allow")

    output_modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1, max_length=2)
    instructions: str | None = Field(None, max_length=64_000)
    max_output_tokens: int | Literal["inf"] | None = None
    conversation: str | None = None
    input: list[dict[str, Any]] | None = Field(None, max_length=MAX_ITEMS)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    audio: dict[str, Any] | None = None
    tools: list[Any] | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["input_text", "input_audio", "text"]
    text: str | None = None
    audio: str | None = None


class ItemBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["message"]
    role: Literal["user"]
    id: str | None = Field(None, min_length=1, max_length=64)
    content: list[ContentPart] = Field(..., min_length=1, max_length=16)
