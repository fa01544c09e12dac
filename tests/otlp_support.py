"""Test support for traces: an OTLP/HTTP receiver on a free port that decodes every export
(`ExportTraceServiceRequest`, opentelemetry-proto), and the `receiver` fixture that turns this
process's tracing on against it (the in-process engine, API and job runner then export there)."""
from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

from helpers import eventually

from omniflow import tracing


class Receiver:
    """An OTLP/HTTP trace receiver on a free loopback port: every span it is sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                with lock:
                    receiver.requests += 1
                    for rs in req.resource_spans:
                        resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                        for ss in rs.scope_spans:
                            for sp in ss.spans:
                                receiver.spans.append(decode(sp, resource))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def of_trace(self, trace_id: str) -> list[dict[str, Any]]:
        return [sp for sp in list(self.spans) if sp["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def decode(sp: Any, resource: dict[str, str]) -> dict[str, Any]:
    return {"trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(), "parent": sp.parent_span_id.hex(),
            "name": sp.name, "trace_state": sp.trace_state, "kind": sp.kind, "attrs": {a.key: value(a.value) for a in sp.attributes},
            "events": [(e.name, {a.key: value(a.value) for a in e.attributes}) for e in sp.events],
            "status": sp.status.code, "message": sp.status.message,
            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in sp.links], "service": resource.get("service.name")}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """Tracing on in this process (the in-process engine and API), exporting to a fresh receiver."""
    rec = Receiver()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rec.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER", raising=False)
    assert tracing.setup("test")
    try:
        yield rec
    finally:
        tracing.shutdown()
        rec.close()


async def spans_of(rec: Receiver, trace_id: str, *, until: Any) -> list[dict[str, Any]]:
    """The trace's spans once `until(spans)` holds (exported in batches: flushed, then waited for)."""
    tracing.flush()
    return await eventually(lambda: (lambda got: got if until(got) else None)(rec.of_trace(trace_id)),
                            timeout_s=15)
