"""OpenTelemetry traces, checked against an OTLP/HTTP receiver started by the test: a request's
traceparent is continued by the API span, every stage session span (real workers) and the
reconciler's decisions; a malformed traceparent starts a new trace; off by default."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import cli_env, eventually, omniflow, request, stage_status
from jobs_support import FAST, http_receiver, jobs_runner
from otlp_support import receiver, spans_of  # noqa: F401 - fixture

from omniflow import tracing
from omniflow.errors import ConfigError

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


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
        assert api_span["trace_state"] == "vendor=opaque"          # the caller's tracestate travels too
        for sp in sessions:
            attrs = sp["attrs"]
            assert sp["parent"] == api_span["span_id"] and sp["trace_state"] == "vendor=opaque", sp
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
        turn = next(sp for sp in spans if sp["name"] == "realtime turn")
        assert turn["parent"] == conn["span_id"] and turn["attrs"]["omniflow.workflow.id"] == wf["id"]
        thinker = next(sp for sp in spans if sp["name"] == "session thinker")
        assert thinker["parent"] == turn["span_id"] and thinker["attrs"]["omniflow.workflow.id"] == wf["id"]


async def test_webhook_deliveries_are_spans_of_the_workflows_trace(engine_factory, receiver):
    # no span is current here: the submit starts the trace with a `submit` span; the first delivery
    # attempt is refused (HTTP 500) and retried
    with http_receiver([500]) as hook:
        async with engine_factory(**FAST) as eng, jobs_runner(eng):
            sub = await eng.store.submit(request("hook me", ["text"], webhook_url=hook.url()))
            doc = await eng.store.wait(sub.id, timeout_s=10)
            trace_id = doc["trace_id"]
            spans = await spans_of(receiver, trace_id, until=lambda got: any(
                sp["name"] == "webhook deliver" and sp["attrs"].get("omniflow.outcome") == "delivered" for sp in got))
    root = next(sp for sp in spans if sp["name"] == "submit")
    assert root["parent"] == "" and root["attrs"]["omniflow.workflow.id"] == sub.id
    deliveries = sorted((sp for sp in spans if sp["name"] == "webhook deliver"), key=lambda sp: sp["attrs"]["omniflow.attempt"])
    assert [sp["attrs"]["omniflow.attempt"] for sp in deliveries] == [1, 2]
    assert all(sp["parent"] == root["span_id"] and sp["kind"] == 3 for sp in deliveries)      # CLIENT
    assert deliveries[0]["status"] == 2 and deliveries[1]["attrs"]["omniflow.outcome"] == "delivered"
    assert any(sp["name"] == "session thinker" and sp["parent"] == root["span_id"] for sp in spans)


async def test_batch_lines_are_spans_and_a_failed_stage_is_a_failed_decision(engine_factory, receiver, tmp_path):
    from omniflow.jobs.batch import parse_batch_file, submit_batch, wait_batch
    from omniflow.jobs.queue import create_job_pool

    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({"text": "line one"}) + "\n" + json.dumps(
        {"text": "line two", "stage_params": {"talker": {"fail_at_step": 1, "fail_retryable": False}}}) + "\n")
    async with engine_factory(**FAST) as eng, jobs_runner(eng):
        pool = await create_job_pool(eng.url, eng.settings)
        try:
            created = await submit_batch(eng.store, pool, parse_batch_file(path, eng.pipeline, eng.settings))
        finally:
            await pool.aclose()
        doc = await wait_batch(eng.store, created["id"], timeout_s=20)
        lines = {row["line"]: row for row in doc["lines"]}
        assert lines[1]["state"] == "completed" and lines[2]["state"] == "failed"
        traces = {n: (await eng.store.document(lines[n]["workflow_id"]))["trace_id"] for n in (1, 2)}
        assert traces[1] and traces[2] and traces[1] != traces[2]          # a trace per line
        done = await spans_of(receiver, traces[1], until=lambda got: any(sp["name"] == "reconcile completed" for sp in got))
        failed = await spans_of(receiver, traces[2], until=lambda got: any(sp["name"] == "reconcile failed" for sp in got))
    line = next(sp for sp in done if sp["name"] == "batch line")
    assert line["attrs"]["omniflow.batch.id"] == created["id"] and line["attrs"]["omniflow.batch.line"] == 1
    assert line["attrs"]["omniflow.workflow.id"] == lines[1]["workflow_id"]
    assert all(sp["parent"] == line["span_id"] for sp in done if sp["name"].startswith(("session ", "reconcile ")))
    decision = next(sp for sp in failed if sp["name"] == "reconcile failed")
    assert decision["attrs"]["omniflow.stage"] == "talker" and decision["attrs"]["omniflow.dlq"] is True
    assert decision["status"] == 2 and "injected failure" in decision["message"]


async def test_a_deadline_abort_is_a_decision_span(engine_factory, receiver):
    async with engine_factory(toy_spec(thinker={"token_delay_s": 0.2})) as eng:
        sub = await eng.store.submit(request("too slow", ["text"], deadline_s=0.3))
        doc = await eng.store.wait(sub.id, timeout_s=15)
        assert doc["state"] == "failed" and "deadline" in doc["error"]
        spans = await spans_of(receiver, doc["trace_id"], until=lambda got: any(sp["name"] == "reconcile abort" for sp in got))
    root = next(sp for sp in spans if sp["name"] == "submit")
    abort = next(sp for sp in spans if sp["name"] == "reconcile abort")
    assert abort["parent"] == root["span_id"] and abort["attrs"]["omniflow.workflow.id"] == sub.id
    assert abort["status"] == 2 and abort["message"] == "deadline exceeded"


def test_with_tracing_off_the_sdk_is_never_imported():
    code = ("import sys\n"
            "from omniflow import tracing\n"
            "import omniflow.engine.worker, omniflow.engine.reconciler, omniflow.client.store, omniflow.api.app\n"
            "assert not tracing.setup('worker')\n"
            "print([m for m in sys.modules if m.startswith('opentelemetry.sdk')])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.parametrize("finish_completes,decides", [("0", "omniflow-reconciler"), ("1", "omniflow-worker")])
async def test_worker_and_reconciler_processes_continue_the_trace(engine_factory, receiver, tmp_path, finish_completes,
                                                                  decides):
    """Real `omniflow worker` and `omniflow reconciler` processes, configured only by the standard
    OTEL_* variables, export their spans into the trace the submitting process started. The
    completion is a decision span of the process that applied it: the reconciler's, or with
    `finish_completes` (the default) the worker's whose finish completed the workflow."""
    import asyncio
    import signal

    async with engine_factory(workers=False, reconciler=False) as eng:
        env = {**cli_env(eng, tmp_path), "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
               "OTEL_BSP_SCHEDULE_DELAY": "100", "OMNIFLOW_FINISH_COMPLETES": finish_completes}
        procs = [await asyncio.create_subprocess_exec(sys.executable, "-m", "omniflow.cli", *argv, env=env,
                                                      stderr=asyncio.subprocess.PIPE)
                 for argv in (("worker", "--stage", "all"), ("reconciler",))]
        try:
            sub = await eng.store.submit(request("across processes", ["text"]))
            doc = await eng.store.wait(sub.id, timeout_s=30)
            assert doc["state"] == "completed"
            spans = await spans_of(receiver, doc["trace_id"], until=lambda got: {sp["service"] for sp in got} >= {
                "omniflow-test", "omniflow-worker", decides} and any(sp["name"] == "reconcile completed"
                                                                     for sp in got))
            # the reconciler is up (it holds the sweep lease) before it is asked to stop: with nothing to
            # decide it exports no span, and a SIGTERM during its start-up would end it unclean
            await eventually(lambda: eng.redis.exists(eng.store.keys.leader), what="the reconciler's lease")
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            errs = [(await asyncio.wait_for(proc.communicate(), 30))[1] for proc in procs]
        assert all(proc.returncode == 0 for proc in procs), errs
    root = next(sp for sp in spans if sp["name"] == "submit")
    thinker = next(sp for sp in spans if sp["name"] == "session thinker")
    completed = next(sp for sp in spans if sp["name"] == "reconcile completed")
    assert thinker["service"] == "omniflow-worker" and completed["service"] == decides
    assert thinker["parent"] == completed["parent"] == root["span_id"]


async def test_a_clients_abort_is_a_span_of_the_workflows_trace_linked_to_the_abort_request(api_factory, receiver):
    async with api_factory(toy_spec(thinker={"token_delay_s": 0.2})) as (engine, server), server.client() as http:
        r = await http.post("/v1/workflows", headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                            json={"input": {"text": "stop me"}})
        wf_id = r.json()["id"]
        # the thinker's session has begun (an abort that lands before its claim leaves no session span)
        await eventually(lambda: _running(engine.store, wf_id), what="the thinker running")
        r = await http.post(f"/v1/workflows/{wf_id}/abort")         # no traceparent: a trace of its own
        assert r.status_code == 200 and r.json()["state"] == "aborted"
        spans = await spans_of(receiver, TRACE_ID, until=lambda got: any(sp["name"] == "abort" for sp in got) and any(
            sp["name"] == "session thinker" for sp in got))
        request_span = await eventually(lambda: next((sp for sp in receiver.spans
                                                      if sp["name"] == "POST /v1/workflows/{wf_id}/abort"), None))
    api = next(sp for sp in spans if sp["name"] == "POST /v1/workflows")
    abort = next(sp for sp in spans if sp["name"] == "abort")
    assert abort["parent"] == api["span_id"] and abort["status"] == 2 and abort["attrs"]["omniflow.workflow.id"] == wf_id
    assert request_span["trace_id"] != TRACE_ID and request_span["attrs"]["omniflow.workflow.id"] == wf_id
    assert abort["links"] == [(request_span["trace_id"], request_span["span_id"])]
    thinker = next(sp for sp in spans if sp["name"] == "session thinker")
    assert thinker["status"] == 2 and thinker["attrs"]["omniflow.outcome"] != "done"


async def _running(store, wf_id: str) -> bool:
    return await stage_status(store, wf_id, "thinker") == "running"
