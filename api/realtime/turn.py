"""One turn's server events, numbered (pure: no I/O).

A turn is one response, answered by one workflow. Its events are built here in a fixed order —
`response.created`, the output item and content part, one delta per text entry and per audio
chunk of the workflow's log, the `.done` events, `response.done` — and each gets the id
`evt_<response id>_<n>`, n counting from 0. The same log gives the same events with the same
ids, so a client that reconnects with the id of the last event it received (`last_event_id`)
gets exactly the events after it: the connection builds the turn again from the log and sends
only those past `n` (`resume_after`).
"""
from __future__ import annotations

import base64
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from omniflow.api.realtime.config import PCM_FORMAT, PCM_RATE
from omniflow.api.realtime.events import server_event
from omniflow.api.realtime.records import Response, ResponseStatus
from omniflow.resample import StreamResampler

if TYPE_CHECKING:
    from omniflow.client.store import Store

EVENT_PREFIX = "evt_"


def event_id(response_id: str, n: int) -> str:
    return f"{EVENT_PREFIX}{response_id}_{n}"


def parse_event_id(value: str) -> tuple[str, int] | None:
    """(response id, n) of a turn event's id; None for any other id."""
    if not value.startswith(EVENT_PREFIX):
        return None
    response_id, _, n = value[len(EVENT_PREFIX):].rpartition("_")
    return (response_id, int(n)) if response_id and n.isdigit() else None


def response_view(response: Response, status: ResponseStatus, *, output: list[dict[str, Any]] | None = None,
                  details: dict[str, Any] | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `response` object of `response.created` and `response.done`."""
    return {"id": response.id, "object": "realtime.response", "status": status.value, "status_details": details,
            "output": output or [], "output_modalities": list(response.modalities),
            "audio": {"output": {"format": dict(PCM_FORMAT), "voice": response.voice}},
            "conversation_id": None, "metadata": response.metadata, "usage": usage}


class TurnEvents:
    """Builds one turn's events in order; `n` is how many were built."""

    def __init__(self, response: Response) -> None:
        self.response = response
        self.n = 0
        self.audio = "audio" in response.modalities
        self.text_parts: list[str] = []
        self.audio_bytes = 0

    @property
    def text(self) -> str:
        """The answer so far (its transcript, for audio)."""
        return "".join(self.text_parts)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = server_event(kind, event_id=event_id(self.response.id, self.n), **fields)
        self.n += 1
        return event

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.response.id, "item_id": self.response.item_id, "output_index": 0,
                "content_index": 0}

    def _item(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": status, "content": content}

    def start(self) -> list[dict[str, Any]]:
        part = {"type": "audio", "transcript": ""} if self.audio else {"type": "text", "text": ""}
        return [self._event("response.created", response=response_view(self.response, ResponseStatus.IN_PROGRESS)),
                self._event("response.output_item.added", response_id=self.response.id, output_index=0,
                            item=self._item("in_progress", [])),
                self._event("response.content_part.added", **self._where(), part=part)]

    def text_delta(self, delta: str) -> list[dict[str, Any]]:
        if not delta:
            return []
        self.text_parts.append(delta)
        kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
        return [self._event(kind, **self._where(), delta=delta)]

    def audio_delta(self, pcm: bytes) -> list[dict[str, Any]]:
        """pcm16 at 24 kHz (little-endian mono), base64 in the event."""
        if not self.audio or not pcm:
            return []
        self.audio_bytes += len(pcm)
        return [self._event("response.output_audio.delta", **self._where(), delta=base64.b64encode(pcm).decode())]

    def end(self, status: ResponseStatus, *, transcript: str | None = None, error: dict[str, Any] | None = None,
            usage: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """The closing events. `transcript` stands in for the text when the pipeline has no text
        output (a TTS pipeline speaks the prompt: that is its transcript)."""
        text = self.text or (transcript or "")
        where = self._where()
        events: list[dict[str, Any]] = []
        if self.audio:
            events.append(self._event("response.output_audio.done", **where))
            events.append(self._event("response.output_audio_transcript.done", **where, transcript=text))
            part = {"type": "audio", "transcript": text}
            content = [{"type": "output_audio", "transcript": text}]
        else:
            events.append(self._event("response.output_text.done", **where, text=text))
            part = {"type": "text", "text": text}
            content = [{"type": "output_text", "text": text}]
        item_status = "completed" if status is ResponseStatus.COMPLETED else "incomplete"
        item = self._item(item_status, content)
        events.append(self._event("response.content_part.done", **where, part=part))
        events.append(self._event("response.output_item.done", response_id=self.response.id, output_index=0,
                                  item=item))
        details: dict[str, Any] = {"type": status.value}
        if status is ResponseStatus.CANCELLED:
            details["reason"] = "client_cancelled"
        if error is not None:
            details["error"] = error
        events.append(self._event("response.done", response=response_view(
            self.response, status, output=[item], details=details, usage=usage)))
        return events


@dataclass(frozen=True)
class Resume:
    """Where a reconnecting client was: the last turn event it received."""

    response_id: str
    after: int

    @classmethod
    def parse(cls, last_event_id: str | None) -> Resume | None:
        parsed = parse_event_id(last_event_id) if last_event_id else None
        return cls(*parsed) if parsed else None


class AudioFeed:
    """A turn's audio: the audio stage's chunks in the order of its log entries, as pcm16 at 24 kHz."""

    def __init__(self, store: Store, wf_id: str, stage: str) -> None:
        self.store, self.wf_id, self.stage = store, wf_id, stage
        self._cursor = "-"
        self._queue: deque[tuple[bytes, int]] = deque()
        self._resampler: StreamResampler | None = None

    async def next(self) -> bytes:
        """The next chunk (the one the next audio log entry announces), converted."""
        if not self._queue:
            for entry_id, pcm, rate in await self.store.audio_chunks(self.wf_id, self.stage, after=self._cursor):
                self._cursor = entry_id
                self._queue.append((pcm, rate))
        if not self._queue:
            return b""
        pcm, rate = self._queue.popleft()
        if self._resampler is None:
            if rate == PCM_RATE:
                return pcm
            self._resampler = StreamResampler(rate, PCM_RATE)
        return np.asarray(self._resampler.push(np.frombuffer(pcm, dtype="<i2")), dtype="<i2").tobytes()

    def flush(self) -> bytes:
        """The resampler's last samples (it lags its input by about a millisecond)."""
        if self._resampler is None:
            return b""
        return np.asarray(self._resampler.flush(), dtype="<i2").tobytes()
