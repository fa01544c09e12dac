"""Test support for the job runner: a real HTTP receiver and an in-loop `JobsRunner`."""
from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from omniflow.jobs.runner import JobsRunner

SECRET = "whsec_" + base64.b64encode(b"omniflow-test-secret-0123456789!").decode()
FAST = {"webhook_secret": SECRET, "webhook_allow_hosts": "127.0.0.1", "webhook_backoff_s": 0.05,
        "webhook_backoff_max_s": 0.2, "jobs_poll_delay_s": 0.02, "block_ms": 200}


@dataclass
class Hit:
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    """Answers each POST with the next scripted status (then 200) and keeps what it got."""

    statuses: list[int] = field(default_factory=list)
    hits: list[Hit] = field(default_factory=list)
    port: int = 0
    got: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str = "/hook") -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@contextmanager
def http_receiver(statuses: list[int] | None = None) -> Iterator[Receiver]:
    rec = Receiver(statuses=list(statuses or []))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            rec.hits.append(Hit({k.lower(): v for k, v in self.headers.items()}, body))
            status = rec.statuses.pop(0) if rec.statuses else 200
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()
            rec.got.set()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - keep test output quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@asynccontextmanager
async def jobs_runner(eng, **kwargs) -> AsyncIterator[JobsRunner]:
    """A `JobsRunner` for an engine from `engine_factory`, as a task in the test's loop."""
    runner = JobsRunner(settings=eng.settings, pipeline=eng.pipeline, redis_url=eng.url, **kwargs)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    waiter = asyncio.create_task(runner.started.wait())
    await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    try:
        yield runner
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
