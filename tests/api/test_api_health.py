"""Health, readiness, metrics and the OpenAPI document."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from apiserver import api_factory  # noqa: F401 - fixture


async def test_healthz_and_readyz_with_every_stage_served(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        r = await http.get("/readyz")
        assert r.status_code == 200 and r.json()["stages"] == {"thinker": 1, "talker": 1, "code2wav": 1}


async def test_readyz_is_503_naming_the_stage_without_a_worker(api_factory):
    async with api_factory(workers=False) as (engine, server), server.client() as http:
        await engine.add_worker("thinker")
        await engine.add_worker("talker")
        r = await http.get("/readyz")
        assert r.status_code == 503
        assert r.json()["missing"] == ["code2wav"] and "code2wav" in r.json()["message"]
        await engine.add_worker("code2wav")
        assert (await http.get("/readyz")).status_code == 200


async def test_metrics_parse_and_count(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        for i in range(3):
            wf_id = (await http.post("/v1/workflows", json={"input": {"text": f"m{i}"}})).json()["id"]
            await http.get(f"/v1/workflows/{wf_id}", params={"wait": 10})
        r = await http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(r.text)}
        value = {(f.name, s.name, tuple(sorted(s.labels.items()))): s.value
                 for f in families.values() for s in f.samples}
        assert value[("omniflow_workflows_finished", "omniflow_workflows_finished_total",
                      (("state", "completed"),))] == 3
        assert value[("omniflow_admission_limit", "omniflow_admission_limit", ())] == server.settings.max_in_flight
        assert value[("omniflow_workflows_in_flight", "omniflow_workflows_in_flight", ())] == 0
        for stage in ("thinker", "talker", "code2wav"):
            labels = (("stage", stage),)
            assert value[("omniflow_live_workers", "omniflow_live_workers", labels)] == 1
            assert value[("omniflow_dlq_size", "omniflow_dlq_size", labels)] == 0
            assert ("omniflow_stage_queue_lag", "omniflow_stage_queue_lag", labels) in value
            assert ("omniflow_stage_queue_pending", "omniflow_stage_queue_pending", labels) in value
            per_pipeline = (("pipeline", _engine.pipeline.name), ("stage", stage))
            assert value[("omniflow_stage_run_seconds", "omniflow_stage_run_seconds_count", per_pipeline)] == 3
            assert value[("omniflow_stage_queue_wait_seconds", "omniflow_stage_queue_wait_seconds_count",
                          per_pipeline)] == 3
            # data plane, from the live workers' heartbeats (the toy's chunks are small: inline, never held)
            assert value[("omniflow_backpressure_waits", "omniflow_backpressure_waits_total", labels)] == 0
            assert ("omniflow_backpressure_wait_seconds", "omniflow_backpressure_wait_seconds_total", labels) in value
            assert value[("omniflow_dataplane_payloads_released", "omniflow_dataplane_payloads_released_total",
                          labels)] == 0
        first = ("omniflow_stage_first_chunk_seconds", "omniflow_stage_first_chunk_seconds_count")
        pipeline = ("pipeline", _engine.pipeline.name)
        assert value[(*first, (pipeline, ("stage", "thinker")))] == 3 and value[(*first, (pipeline, ("stage", "code2wav")))] == 3
        # a second scrape does not count the same workflows twice
        again = (await http.get("/metrics")).text
        assert 'omniflow_workflows_finished_total{state="completed"} 3.0' in again


async def test_openapi_documents_every_route(api_factory):
    async with api_factory() as (_engine, server), server.client() as http:
        spec = (await http.get("/openapi.json")).json()
        assert set(spec["paths"]) == {
            "/v1/workflows", "/v1/workflows/{wf_id}", "/v1/workflows/{wf_id}/abort", "/v1/workflows/{wf_id}/events",
            "/v1/workflows/{wf_id}/audio", "/v1/workflows/{wf_id}/timeline", "/v1/workflows/{wf_id}/retry", "/v1/usage",
            "/v1/workflows/{wf_id}/input",
            "/v1/admin/pools", "/v1/admin/pools/events", "/v1/admin/tenants", "/v1/admin/tenants/{tenant}/weight", "/v1/admin/workers", "/v1/admin/workers/{worker_id}/drain",
            "/v1/admin/workers/{worker_id}/undrain", "/v1/models", "/v1/chat/completions", "/v1/audio/speech",
            "/v1/audio/voices", "/v1/audio/transcriptions", "/healthz", "/readyz", "/metrics"}
        submit = spec["paths"]["/v1/workflows"]["post"]["responses"]
        assert {"202", "409", "413", "422", "429"} <= set(submit)
        assert submit["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def test_serve_without_keys_refuses_a_public_address():
    import pytest

    from omniflow.api.app import is_loopback, serve
    from omniflow.config import Settings
    from omniflow.errors import ConfigError
    from omniflow.pipeline import load_pipeline

    with pytest.raises(ConfigError, match="no API keys"):
        serve(Settings(), load_pipeline(Settings().pipeline_path()), "redis://127.0.0.1:1/0", "0.0.0.0", 1)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1")
