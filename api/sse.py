"""Server-sent events: framing, and a streaming response that notices disconnects.

Starlette's `StreamingResponse` only notices a client that went away when a
write fails (ASGI spec >= 2.4) — a stream waiting on a slow stage would not
notice for a long time. This response always listens for `http.disconnect`
and cancels the body iterator at once, so its `finally` blocks run (the
OpenAI stream aborts its workflow there).
"""
from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse_event(data: str, *, event: str | None = None, event_id: str | None = None) -> bytes:
    lines = []
    if event_id:
        lines.append(f"id: {event_id}")
    if event:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in data.splitlines() or [""])
    return ("\n".join(lines) + "\n\n").encode()


def event_schema(events: list[str], data: dict[str, Any] | None = None) -> dict[str, Any]:
    """OpenAPI 3.1 schema of ONE event of a text/event-stream response (what each event carries)."""
    return {"type": "object", "required": ["data"], "properties": {
        "id": {"type": "string"}, "event": {"type": "string", "enum": events},
        "data": {"type": "string", "contentMediaType": "application/json", **({"contentSchema": data} if data else {})},
    }}


def sse_comment(text: str) -> bytes:
    return f": {text}\n\n".encode()


class WatchedStreamingResponse(StreamingResponse):
    """A streaming response (chunked, unbuffered) that cancels its body iterator as soon as the
    client goes away, so the iterator's `finally` runs at once (SSE streams, streamed audio)."""

    def __init__(self, content: AsyncIterable[bytes], status_code: int = 200, *, media_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, status_code=status_code, media_type=media_type or self.media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


class EventStreamResponse(WatchedStreamingResponse):
    media_type = "text/event-stream"
