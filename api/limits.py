"""Request limits: body size (413) and the per-tenant submit rate (429).

The submit rate is a token bucket per tenant held in this process: with N API
replicas behind a balancer a tenant gets up to N x the rate (documented in
docs/api.md); admission (`max_in_flight`) is the global limit and lives in Redis.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omniflow.api.errors import error_body


DRAIN_FACTOR = 16


class BodySizeLimit:
    """Pure ASGI middleware: 413 when Content-Length or the streamed body passes `max_bytes`."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, upload_bytes: int | None = None,
                 upload_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.default_bytes = max_bytes
        self.upload_bytes = max(max_bytes, upload_bytes or max_bytes)
        self.upload_paths = frozenset(upload_paths)     # routes that take audio uploads: the larger limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_bytes if scope.get("path") in self.upload_paths else self.default_bytes
        await _Limited(self.app, limit)(scope, receive, send)


class _Limited:
    """One request under one byte limit."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if int(length) <= self.max_bytes * DRAIN_FACTOR:     # let the client finish sending, then answer
                more = True
                while more:
                    message = await receive()
                    more = message["type"] == "http.request" and message.get("more_body", False)
            await self._reject(send)
            return
        seen = 0
        exceeded = False
        body_done = False

        async def limited_receive() -> Message:
            # Past the limit the app sees the body end there; whatever it answers is replaced by a 413.
            nonlocal seen, exceeded, body_done
            if exceeded:
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max_bytes:
                    exceeded = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        replaced = False

        async def drain() -> None:
            # Read (and drop) the rest of a moderately oversized body before answering, so the client
            # is not cut off mid-upload and sees the 413; past DRAIN_FACTOR x the limit, just close.
            nonlocal body_done, seen
            while not body_done and seen <= self.max_bytes * DRAIN_FACTOR:
                message = await receive()
                if message["type"] != "http.request":
                    return
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)

        async def guarded_send(message: Message) -> None:
            nonlocal replaced
            if exceeded and message["type"] == "http.response.start":
                replaced = True
                await drain()
                await self._reject(send)
            elif not replaced:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _reject(self, send: Send) -> None:
        body = json.dumps(error_body(
            "body_too_large", f"request body is over the limit of {self.max_bytes} bytes", status=413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


@dataclass
class _Bucket:
    tokens: float
    stamp: float


class RateLimiter:
    """Token bucket per key: `rate_per_s` tokens a second, bursts up to `burst`."""

    def __init__(self, rate_per_s: float, *, burst: float | None = None) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst if burst is not None else max(1.0, rate_per_s)
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.rate_per_s > 0

    def acquire(self, key: str) -> float:
        """Take one token; returns 0 when granted, else the seconds until one is available."""
        if not self.enabled:
            return 0.0
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.setdefault(key, _Bucket(self.burst, now))
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.stamp) * self.rate_per_s)
            bucket.stamp = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return 0.0
            return (1.0 - bucket.tokens) / self.rate_per_s
