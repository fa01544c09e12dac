"""Liveness and readiness over HTTP for the processes that serve no API: workers, reconcilers,
the job runner (`OMNIFLOW_HEALTH_PORT`; 0, the default, serves nothing).

- `GET /healthz`: 200 while the process's event loop answers. A loop blocked for longer than the
  orchestrator's probe timeout (a stuck executor, a deadlock) fails it, and the process is
  restarted; its sessions were already re-queued when its lease lapsed.
- `GET /readyz`: 200 once the process has started and its last round trip to Redis succeeded
  recently (`ready()` of the process); 503 otherwise, with the reason.

A few lines of asyncio, not a web framework: these processes must stay lean, and the probe must
not depend on anything but the loop it checks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

logger = logging.getLogger(__name__)

ReadyCheck = Callable[[], tuple[bool, str]]
DEFAULT_READ_TIMEOUT_S = 2.0
MAX_REQUEST_LINE_BYTES = 4096


class HealthServer:
    """Serves `/healthz` and `/readyz` on `host:port` beside a long-running process."""

    def __init__(self, *, port: int, ready: ReadyCheck, host: str = "0.0.0.0") -> None:
        self.host, self.port, self.ready = host, port, ready
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        sockets = self._server.sockets
        if sockets and not self.port:
            self.port = int(sockets[0].getsockname()[1])
        logger.info("health endpoints on %s:%d (/healthz, /readyz)", self.host, self.port)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    def response(self, path: str) -> tuple[int, str]:
        """(status, body) for a request path."""
        if path == "/healthz":
            return 200, "ok"
        if path == "/readyz":
            ok, why = self.ready()
            return (200, "ready") if ok else (503, why or "not ready")
        return 404, "not found"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), DEFAULT_READ_TIMEOUT_S)
            parts = line[:MAX_REQUEST_LINE_BYTES].decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            status, body = self.response(path) if parts[:1] in (["GET"], ["HEAD"]) else (405, "GET only")
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}[status]
            payload = body.encode()
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
                         f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
            await writer.drain()
        except (TimeoutError, OSError, UnicodeDecodeError):
            pass      # a client that sends nothing or hangs up: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def with_health(main: Callable[[asyncio.Event], Coroutine[Any, Any, None]], *, port: int,
                ready: ReadyCheck) -> Callable[[asyncio.Event], Coroutine[Any, Any, None]]:
    """`main(stop)` with the health endpoints served beside it while it runs (port 0: none)."""
    if not port:
        return main

    async def run(stop: asyncio.Event) -> None:
        server = HealthServer(port=port, ready=ready)
        await server.start()
        try:
            await main(stop)
        finally:
            await server.close()
    return run
