"""What a realtime session is, and what its state machine asks for (`omniflow.api.realtime.state`):
the persisted records (`SessionState` and its parts: items, responses, the audio turn being
spoken) and the effects the connection carries out, in order (see the state module's docstring).
Plain data: no I/O, no transitions."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, Field

from omniflow.api.realtime.config import SessionConfig

__all__ = ["AppendInput", "CancelTurn", "DetectSpeech", "DropInput", "Effect", "EndInput", "InputTurn", "Item",
           "OpenInput", "Response", "ResponseStatus", "Save", "Send", "SessionState", "StartTurn"]


class ResponseStatus(str, Enum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INCOMPLETE = "incomplete"


class InputTurn(BaseModel):
    """An audio turn being spoken: the workflow the input buffer streams into, and what it was
    submitted with (a response that answers it must ask for the same)."""

    item_id: str                         # the user item the commit will make
    request_id: str                      # the workflow's idempotency key (a resubmit meets the same one)
    wf_id: str = ""
    modalities: list[str]
    knobs: dict[str, Any] = Field(default_factory=dict)
    voice: str = ""
    committed: bool = False
    answered: bool = False               # a response follows its workflow already


class Item(BaseModel):
    """One conversation item: a user's text or committed audio, or an assistant's answer."""

    id: str
    role: Literal["user", "assistant"]
    kind: Literal["text", "audio"]
    text: str = ""                      # the user's text, or the answer's text / transcript
    transcript: str | None = None       # a user audio item's transcript, once known
    status: str = "completed"
    wf_id: str = ""                     # a user audio item's workflow (it heard the audio, and answers it)
    turn: InputTurn | None = None

    def view(self) -> dict[str, Any]:
        if self.role == "user":
            part = ({"type": "input_text", "text": self.text} if self.kind == "text"
                    else {"type": "input_audio", "transcript": self.transcript})
        else:
            part = ({"type": "output_audio", "transcript": self.text} if self.kind == "audio"
                    else {"type": "output_text", "text": self.text})
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": [part]}


class Response(BaseModel):
    """A response: its ids, what it answers, and its workflow once submitted."""

    id: str
    item_id: str
    modalities: list[str]
    prompt: str
    voice: str
    request_id: str                      # the workflow's idempotency key (a resubmit meets the same one)
    wf_id: str = ""
    in_conversation: bool = True         # conversation 'none': the answer is not added to the items
    metadata: dict[str, str] | None = None
    knobs: dict[str, Any] = Field(default_factory=dict)     # `omniflow.api.knobs` values this turn sets
    cancelling: bool = False
    status: ResponseStatus = ResponseStatus.IN_PROGRESS
    events: int = 0                      # once ended: how many events the turn has (a resume knows its end)


class SessionState(BaseModel):
    """Everything a session is, persisted after every change (`omniflow.client.realtime`)."""

    id: str
    model: str
    tenant: str
    created_at: int
    config: SessionConfig
    items: list[Item] = Field(default_factory=list)
    pending: list[str] = Field(default_factory=list)     # user items since the last response
    response: Response | None = None
    last_response: Response | None = None
    input: InputTurn | None = None                        # the audio turn being spoken (not committed yet)


@dataclass(frozen=True)
class Send:
    event: dict[str, Any]


@dataclass(frozen=True)
class Save:
    pass


@dataclass(frozen=True)
class StartTurn:
    response: Response


@dataclass(frozen=True)
class CancelTurn:
    response: Response


@dataclass(frozen=True)
class OpenInput:
    """Submit the workflow of an audio turn (its input left open); set `turn.wf_id`."""

    turn: InputTurn


@dataclass(frozen=True)
class AppendInput:
    """Stream pcm16 (24 kHz) into the open turn's workflow."""

    pcm: bytes


@dataclass(frozen=True)
class EndInput:
    """The turn was committed: end its workflow's input, and report its transcript once heard."""

    turn: InputTurn


@dataclass(frozen=True)
class DropInput:
    """The buffer was cleared: abort the open turn's workflow."""

    turn: InputTurn


@dataclass(frozen=True)
class DetectSpeech:
    """Server VAD: run the connection's speech detector over appended pcm16."""

    pcm: bytes


Effect = Send | Save | StartTurn | CancelTurn | OpenInput | AppendInput | EndInput | DropInput | DetectSpeech
