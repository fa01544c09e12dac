"""A realtime session's configuration: what `session.update` may set, checked against what the
pipeline can do (`Capabilities`), and the `session` object the server reports.

An update is all or nothing: the whole body is checked first and a single bad field refuses it
(an `error` event naming the field), the configuration unchanged. Only the fields present in
the update change (`null` clears a field that can be cleared, such as `turn_detection`).
Audio is pcm16 at 24 kHz both ways (the only format the protocol's `audio/pcm` has).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omniflow.api.realtime.events import ProtocolError, validation_error

PCM_RATE = 24000
PCM_FORMAT = {"type": "audio/pcm", "rate": PCM_RATE}
DEFAULT_VOICE = "alloy"


@dataclass(frozen=True)
class Capabilities:
    """What the served pipeline can do, as far as a realtime session is concerned."""

    model: str
    outputs: frozenset[str]                      # "text", "audio": the pipeline's final kinds
    voices: Mapping[str, str]                    # voice name a client may ask for -> the voice that speaks it
    knobs: frozenset[str] = frozenset()          # `omniflow.api.knobs` names some stage declares
    audio_input: bool = False                    # the pipeline takes audio (turns from the input buffer)
    max_buffer_bytes: int = 120 * PCM_RATE * 2
    max_prompt_chars: int = 32_000

    @property
    def default_modalities(self) -> list[str]:
        return ["audio"] if "audio" in self.outputs else ["text"]


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["audio/pcm"] = "audio/pcm"
    rate: Literal[24000] = 24000


class _VoiceRef(BaseModel):
    id: str = Field(..., max_length=64)


class _AudioOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: _Format | None = None
    voice: str | _VoiceRef | None = Field(None)
    speed: float | None = Field(None, ge=0.25, le=4.0)


class _TurnDetection(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["server_vad", "semantic_vad"]
    threshold: float | None = Field(None, gt=0, lt=1)
    prefix_padding_ms: int | None = Field(None, ge=0, le=5000)
    silence_duration_ms: int | None = Field(None, ge=32, le=10_000)
    create_response: bool | None = None
    interrupt_response: bool | None = None


class _AudioIn(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: _Format | None = None
    transcription: dict[str, Any] | None = None
    turn_detection: _TurnDetection | None = None
    noise_reduction: dict[str, Any] | None = None


class _Audio(BaseModel):
    model_config = ConfigDict(extra="allow")

    input: _AudioIn | None = None
    output: _AudioOut | None = None


class SessionBody(BaseModel):
    """The `session` of a `session.update` (the GA shape of `openai`'s `RealtimeSessionCreateRequest`)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["realtime"] = "realtime"
    model: str | None = Field(None, max_length=128)
    output_modalities: list[Literal["text", "audio"]] | None = Field(None, min_length=1, max_length=2)
    instructions: str | None = Field(None, max_length=64_000)
    audio: _Audio | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    prompt: Any = None


class SessionConfig(BaseModel):
    """The effective configuration (persisted with the session's state)."""

    output_modalities: list[str]
    instructions: str = ""
    voice: str = DEFAULT_VOICE
    speed: float = 1.0
    max_output_tokens: int | None = None
    turn_detection: dict[str, Any] | None = None
    transcription: dict[str, Any] | None = None

    @classmethod
    def default(cls, caps: Capabilities) -> SessionConfig:
        return cls(output_modalities=caps.default_modalities)

    def knobs(self) -> dict[str, Any]:
        """The knobs (`omniflow.api.knobs`) this configuration sets to something else than neutral."""
        return {"speed": self.speed if self.speed != 1.0 else None, "instructions": self.instructions or None,
                "max_output_tokens": self.max_output_tokens}

    def view(self, *, session_id: str, model: str, expires_at: int) -> dict[str, Any]:
        """The `session` object of `session.created` / `session.updated`."""
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": model,
            "output_modalities": list(self.output_modalities), "instructions": self.instructions,
            "audio": {"input": {"format": dict(PCM_FORMAT), "transcription": self.transcription,
                                "turn_detection": self.turn_detection, "noise_reduction": None},
                      "output": {"format": dict(PCM_FORMAT), "voice": self.voice, "speed": self.speed}},
            "tools": [], "tool_choice": "auto",
            "max_output_tokens": self.max_output_tokens if self.max_output_tokens is not None else "inf",
            "expires_at": expires_at,
        }


KNOB_PARAMS = {"speed": "session.audio.output.speed", "instructions": "session.instructions",
               "max_output_tokens": "session.max_output_tokens"}


def check_modalities(modalities: list[str], caps: Capabilities, param: str) -> list[str]:
    """The output modalities asked for, if the pipeline has them (text+audio is audio with its transcript)."""
    wanted = list(dict.fromkeys(modalities))
    missing = [m for m in wanted if m not in caps.outputs]
    if missing:
        raise ProtocolError("unsupported_value", f"{param}: model {caps.model!r} has no {missing[0]} output; it "
                            f"gives {sorted(caps.outputs)}", param=param)
    return ["audio"] if "audio" in wanted else ["text"]


def resolve_voice(voice: str, caps: Capabilities, param: str) -> str:
    if voice not in caps.voices:
        raise ProtocolError("unsupported_value", f"{param}: unknown voice {voice!r}; the voices are "
                            f"{', '.join(caps.voices)} (GET /v1/audio/voices)", param=param)
    return voice


def check_knob(knob: str, value: Any, caps: Capabilities, *, param: str | None = None) -> None:
    """ProtocolError when `value` is set and no stage of the pipeline takes the knob (`omniflow.api.knobs`)."""
    if value is not None and knob not in caps.knobs:
        param = param or KNOB_PARAMS[knob]
        raise ProtocolError("unsupported_parameter", f"{param}: model {caps.model!r} cannot honour it (no stage of "
                            "the pipeline takes it); leave it unset", param=param)


def apply_update(config: SessionConfig, raw: dict[str, Any], caps: Capabilities, *,
                 event_id: str | None = None) -> SessionConfig:
    """The configuration after `session.update` with `raw` as its `session`; ProtocolError (and
    nothing changed) when any field is bad."""
    try:
        body = SessionBody.model_validate(raw)
    except ValidationError as exc:
        raise validation_error(exc, prefix="session", event_id=event_id) from None
    try:
        return _apply(config, body, caps)
    except ProtocolError as err:
        err.event_id = event_id
        raise


def _apply(config: SessionConfig, body: SessionBody, caps: Capabilities) -> SessionConfig:
    new = config.model_copy(deep=True)
    given = body.model_fields_set
    if body.model and body.model != caps.model:
        raise ProtocolError("invalid_value", f"session.model: this connection serves {caps.model!r}; connect with "
                            f"?model={body.model} to use another", param="session.model")
    if body.tools:
        raise ProtocolError("unsupported_parameter", "session.tools: the pipelines make no tool calls",
                            param="session.tools")
    if body.prompt is not None:
        raise ProtocolError("unsupported_parameter", "session.prompt: stored prompts are not supported",
                            param="session.prompt")
    if body.output_modalities is not None:
        new.output_modalities = check_modalities(list(body.output_modalities), caps, "session.output_modalities")
    if "instructions" in given:
        new.instructions = body.instructions or ""
    if "max_output_tokens" in given:
        new.max_output_tokens = body.max_output_tokens if isinstance(body.max_output_tokens, int) else None
        if new.max_output_tokens is not None and new.max_output_tokens < 1:
            raise ProtocolError("invalid_value", "session.max_output_tokens: must be at least 1 (or 'inf')",
                                param="session.max_output_tokens")
    audio = body.audio
    if audio is not None and audio.output is not None:
        out, out_given = audio.output, audio.output.model_fields_set
        if out.voice is not None:
            name = out.voice if isinstance(out.voice, str) else out.voice.id
            new.voice = resolve_voice(name, caps, "session.audio.output.voice")
        if "speed" in out_given:
            new.speed = out.speed if out.speed is not None else 1.0
    if audio is not None and audio.input is not None:
        inp, in_given = audio.input, audio.input.model_fields_set
        if "turn_detection" in in_given:
            detection = inp.turn_detection.model_dump(exclude_none=True) if inp.turn_detection is not None else None
            if detection is not None and detection["type"] == "semantic_vad":
                raise ProtocolError("unsupported_value", "session.audio.input.turn_detection.type: only server_vad "
                                    "(a pause after speech ends the turn)", param="session.audio.input.turn_detection.type")
            if detection is not None and not caps.audio_input:
                raise ProtocolError("unsupported_value", f"session.audio.input.turn_detection: model {caps.model!r} "
                                    "takes text only, so there is no speech to detect; send null",
                                    param="session.audio.input.turn_detection")
            new.turn_detection = detection
        if "transcription" in in_given:
            new.transcription = inp.transcription
    for knob, value in new.knobs().items():
        check_knob(knob, value, caps)
    return new
