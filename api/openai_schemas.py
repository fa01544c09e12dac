"""Request and response shapes of the OpenAI-compatible chat API (what the `openai` client parses)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omniflow.api.audio import AudioFormat
from omniflow.models import PriorityName


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(..., max_length=32)
    content: str | list[dict[str, Any]] | None = None


class AudioParams(BaseModel):
    model_config = ConfigDict(extra="allow")

    voice: str = Field("alloy", max_length=64, description="an OpenAI voice name or a shipped one (GET /v1/audio/voices); "
                       "an unknown one is refused (400)")
    format: AudioFormat = AudioFormat.WAV


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatRequest(BaseModel):
    """`POST /v1/chat/completions`. `n` other than 1 and `tools`/`functions` are refused (422);
    other unknown OpenAI parameters (temperature, top_p, ...) are accepted and ignored."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(..., max_length=128)
    messages: list[ChatMessage] = Field(..., min_length=1)
    modalities: list[Literal["text", "audio"]] | None = Field(None, description="default ['text']")
    audio: AudioParams | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stage_params: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="omniflow extension: per-stage parameter overrides")
    deadline_s: float | None = Field(None, gt=0, description="omniflow extension: workflow deadline")
    priority: PriorityName | None = Field(
        None, description="omniflow extension: priority class (interactive, api, batch), capped by the tenant's "
                          "allowance")
    n: int | None = Field(None, description="choices to generate: only 1 is supported (anything else: 422)")
    tools: list[dict[str, Any]] | None = Field(
        None, description="not supported: a request with tools (or functions) is refused with 422")
    functions: list[dict[str, Any]] | None = Field(None, description="not supported (the legacy name of tools)")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value != 1:
            raise ValueError("only n=1 is supported: one workflow gives one answer")
        return value

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value:
            raise ValueError("tool and function calls are not supported by this pipeline")
        return value


class ChatAudio(BaseModel):
    id: str
    data: str = Field(..., description="base64 of the encoded audio (format as requested)")
    transcript: str
    expires_at: int


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    audio: ChatAudio | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    finish_reason: Literal["stop", "length"] = "stop"


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Degradation(BaseModel):
    """omniflow extension: the request ran with fewer outputs than asked (deadline-aware shedding)."""

    reason: str
    dropped: list[str]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    degraded: Degradation | None = Field(
        None, description="omniflow extension: set when the queues predicted a miss of the deadline and the "
                          "pipeline degraded the request (e.g. text only)")


class ModelCard(BaseModel):
    """One pipeline the deployment serves (OpenAI's model object, with what it takes and makes)."""

    id: str = Field(..., description="the pipeline's name: what `model` (and `pipeline`) names")
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omniflow"
    version: str | None = Field(None, description="the content hash of the pipeline new workflows run on")
    input_modalities: list[str] = Field(default_factory=list, description="what it takes: text, audio")
    output_modalities: list[str] = Field(default_factory=list, description="what it makes: text, audio")
    stages: list[str] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


MAX_SPEECH_INPUT_CHARS = 4096          # OpenAI's limit for `input`


class VoiceRef(BaseModel):
    id: str = Field(..., max_length=64)


class SpeechRequest(BaseModel):
    """`POST /v1/audio/speech` (what `client.audio.speech.create` sends)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(..., max_length=128, description="the pipeline (GET /v1/models); it must make audio")
    input: str = Field(..., min_length=1, max_length=MAX_SPEECH_INPUT_CHARS, description="the text to speak")
    voice: str | VoiceRef = Field(..., description="an OpenAI voice name or a shipped one (GET /v1/audio/voices)")
    instructions: str | None = Field(
        None, max_length=4096, description="not honoured by the shipped voices: a non-empty value is refused (400)")
    response_format: str = Field("mp3", max_length=16, description="mp3, opus, flac, wav or pcm (raw 24 kHz pcm16)")
    speed: float = Field(1.0, ge=0.25, le=4.0, description="0.25-4; honoured where the pipeline declares `speed`")
    stream_format: Literal["audio", "sse"] = Field(
        "audio", description="`audio` (the default: the file, streamed as it is produced); `sse` is refused")
    deadline_s: float | None = Field(None, gt=0, description="omniflow extension: workflow deadline")
    priority: PriorityName | None = Field(
        None, description="omniflow extension: priority class (interactive, api, batch), capped by the tenant's "
                          "allowance")


class VoiceCard(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["audio.voice"] = "audio.voice"
    name: str
    voice: str = Field(..., description="the shipped voice that speaks it")


class VoiceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VoiceCard]
