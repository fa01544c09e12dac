"""OpenTelemetry traces, checked against an OTLP/HTTP receiver started by the test: a request's
traceparent is continued by the API span, every stage session span (real workers) and the
reconciler's decisions; a malformed traceparent starts a new trace; off by default."""
from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import cli_env, eventually, omniflow

from omniflow import tracing
from omniflow.errors import ConfigError

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


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
            "name": sp.name, "kind": sp.kind, "attrs": {a.key: value(a.value) for a in sp.attributes},
            "events": [(e.name, {a.key: value(a.value) for a in e.attributes}) for e in sp.events],
            "status": sp.status.code, "service": resource.get("service.name")}


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


async def test_a_traceparent_is_continued_by_the_api_every_stage_session_and_the_reconciler(api_factory, receiver,
                                                                                            tmp_path):
    # the talker fails its first attempt: the reconciler's retry decision is traced too
    spec = toy_spec()
    async with api_factory(spec) as (engine, server), server.client() as http:
        r = await http.post("/v1/workflows", headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                                                      "tracestate": "vendor=opaque"},
                            json={"input": {"text": "trace me"},
                                  "stage_params": {"talker": {"fail_at_step": 1, "fail_attempts": 1}}})
        assert r.status_code == 202, r.text
        wf_id = r.json()["id"]
        doc = (await http.get(f"/v1/workflows/{wf_id}", params={"wait": 15})).json()
        assert doc["state"] == "completed", doc
        assert doc["trace_id"] == TRACE_ID
        stages = list(engine.pipeline.order)

        def complete(got: list[dict[str, Any]]) -> bool:
            names = [sp["name"] for sp in got]
            return ("reconcile completed" in names and "reconcile retry" in names
                    and all(sum(n == f"session {st}" for n in names) >= (2 if st == "talker" else 1) for st in stages)
                    and any(n.startswith("POST ") for n in names))

        spans = await spans_of(receiver, TRACE_ID, until=complete)
        api = [sp for sp in spans if sp["name"] == "POST /v1/workflows"]
        assert len(api) == 1, [sp["name"] for sp in spans]
        api_span = api[0]
        assert api_span["parent"] == PARENT_ID            # the caller's span is the parent
        assert api_span["kind"] == 2                      # SERVER
        assert api_span["attrs"]["omniflow.workflow.id"] == wf_id
        assert api_span["attrs"]["http.response.status_code"] == 202
        sessions = [sp for sp in spans if sp["name"].startswith("session ")]
        for sp in sessions:
            attrs = sp["attrs"]
            assert sp["parent"] == api_span["span_id"], sp
            assert attrs["omniflow.workflow.id"] == wf_id and attrs["omniflow.stage"] == sp["name"].split()[1]
            assert attrs["omniflow.worker.id"] and attrs["omniflow.pool"] == attrs["omniflow.stage"]
        by_stage = {(sp["attrs"]["omniflow.stage"], sp["attrs"]["omniflow.attempt"]): sp for sp in sessions}
        assert by_stage[("talker", 1)]["attrs"]["omniflow.outcome"] == "failed"
        assert by_stage[("talker", 1)]["status"] == 2      # ERROR
        for st in stages:
            done = by_stage[(st, 2 if st == "talker" else 1)]
            assert done["attrs"]["omniflow.outcome"] == "done" and done["attrs"]["omniflow.steps"] > 0, done
        # chunk hops: the thinker's chunks out to the talker, and the talker's in from it
        thinker = by_stage[("thinker", 1)]
        assert any(name == "chunk.out" and a["omniflow.peer"] == "talker" for name, a in thinker["events"])
        talker = by_stage[("talker", 2)]
        assert any(name == "chunk.in" and a["omniflow.peer"] == "thinker" for name, a in talker["events"])
        retry = next(sp for sp in spans if sp["name"] == "reconcile retry")
        assert retry["parent"] == api_span["span_id"]
        assert retry["attrs"]["omniflow.stage"] == "talker" and retry["attrs"]["omniflow.next_attempt"] == 2
        assert "injected failure" in retry["attrs"]["omniflow.reason"]
        completed = next(sp for sp in spans if sp["name"] == "reconcile completed")
        assert completed["parent"] == api_span["span_id"] and completed["attrs"]["omniflow.workflow.id"] == wf_id
        assert {sp["service"] for sp in spans} == {"omniflow-test"}

        # `omniflow inspect` shows the trace id (the CLI itself traces nothing)
        env = cli_env(engine, tmp_path)
        env.pop("OTEL_TRACES_EXPORTER", None)
        code, out, err = await omniflow("inspect", wf_id, "--json", env=env)
        assert code == 0, err
        assert json.loads(out)["trace_id"] == TRACE_ID
        code, out, err = await omniflow("inspect", wf_id, env={**env, "COLUMNS": "200"})
        assert code == 0 and f"trace {TRACE_ID}" in out, out + err


async def test_a_malformed_traceparent_starts_a_new_trace(api_factory, receiver):
    async with api_factory() as (engine, server), server.client() as http:
        for bad in ("garbage", f"00-{'0' * 32}-{PARENT_ID}-01", f"00-{TRACE_ID}-{PARENT_ID}-zz", "00-" + "é" * 40):
            r = await http.post("/v1/workflows", headers={"traceparent": bad.encode()},
                                json={"input": {"text": "hello"}})
            assert r.status_code == 202, (bad, r.text)
            doc = (await http.get(f"/v1/workflows/{r.json()['id']}", params={"wait": 15})).json()
            assert doc["state"] == "completed"
            trace_id = doc["trace_id"]
            assert trace_id and len(trace_id) == 32 and trace_id not in (TRACE_ID, "0" * 32)
            spans = await spans_of(receiver, trace_id,
                                   until=lambda got: any(sp["name"] == "reconcile completed" for sp in got))
            api = next(sp for sp in spans if sp["name"] == "POST /v1/workflows")
            assert api["parent"] == ""                    # a root: the malformed parent was ignored
        # the OpenAI route starts a trace too, and so does a request without any traceparent
        r = await http.post("/v1/chat/completions", json={"model": engine.pipeline.name, "modalities": ["text"],
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        chat = await eventually(lambda: next((sp for sp in receiver.spans if sp["name"] == "POST /v1/chat/completions"),
                                             None), timeout_s=15)
        assert chat["parent"] == ""
        spans = await spans_of(receiver, chat["trace_id"],
                               until=lambda got: any(sp["name"] == "reconcile completed" for sp in got))
        assert any(sp["name"] == "session thinker" and sp["parent"] == chat["span_id"] for sp in spans)
        # the machines' paths are not traced
        assert (await http.get("/healthz")).status_code == 200
        tracing.flush()
        assert not any("healthz" in sp["name"] for sp in receiver.spans)


async def test_tracing_is_off_unless_configured(api_factory, monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert not tracing.setup("test") and tracing.tracer is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.setup("test") and tracing.tracer is None
    async with api_factory() as (_engine, server), server.client() as http:
        r = await http.post("/v1/workflows", headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                            json={"input": {"text": "hello"}})
        doc = (await http.get(f"/v1/workflows/{r.json()['id']}", params={"wait": 15})).json()
        assert doc["state"] == "completed" and doc["trace_id"] is None


def test_tracing_configuration_is_checked():
    assert tracing.exporter_names({}) == [] and tracing.exporter_names({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "otlp,console"}) == ["otlp", "console"]
    with pytest.raises(ConfigError, match="jaeger"):
        tracing.exporter_names({"OTEL_TRACES_EXPORTER": "jaeger"})
    with pytest.raises(ConfigError, match="HTTP"):
        tracing.exporter_names({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert tracing.trace_id_of(f"00-{TRACE_ID}-{PARENT_ID}-01") == TRACE_ID
    assert tracing.trace_id_of("") is None and tracing.trace_id_of("nope") is None


async def test_a_realtime_connection_continues_the_callers_trace_in_every_turn(api_factory, receiver):
    import websockets

    async with api_factory() as (engine, server):
        ws_url = server.url.replace("http", "ws", 1) + f"/v1/realtime?model={engine.pipeline.name}"
        async with websockets.connect(ws_url, additional_headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}) as ws:
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                            "output_modalities": ["text"]}}))
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": "traced turn"}]}}))
            await ws.send(json.dumps({"type": "response.create"}))
            while json.loads(await ws.recv())["type"] != "response.done":
                pass
        wf = (await engine.store.list())[0]
        assert (await engine.store.document(wf["id"]))["trace_id"] == TRACE_ID
        spans = await spans_of(receiver, TRACE_ID, until=lambda got: any(sp["name"] == "WEBSOCKET /v1/realtime"
                                                                         for sp in got))
        conn = next(sp for sp in spans if sp["name"] == "WEBSOCKET /v1/realtime")
        assert conn["parent"] == PARENT_ID and conn["kind"] == 2
        thinker = next(sp for sp in spans if sp["name"] == "session thinker")
        assert thinker["parent"] == conn["span_id"] and thinker["attrs"]["omniflow.workflow.id"] == wf["id"]
