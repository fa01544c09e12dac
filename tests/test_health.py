"""Health endpoints of workers, reconcilers and the job runner (`OMNIFLOW_HEALTH_PORT`)."""
from __future__ import annotations

import asyncio

import httpx

from omniflow.engine.health import HealthServer, with_health


async def test_health_server_answers_probes_over_http() -> None:
    state = {"ready": (False, "starting")}
    server = HealthServer(port=0, host="127.0.0.1", ready=lambda: state["ready"])
    await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            assert (await http.get("/healthz")).status_code == 200
            unready = await http.get("/readyz")
            assert unready.status_code == 503 and unready.text == "starting"
            state["ready"] = (True, "")
            assert (await http.get("/readyz")).status_code == 200
            assert (await http.get("/nope")).status_code == 404
            assert (await http.post("/healthz")).status_code == 405
    finally:
        await server.close()


async def test_with_health_port_zero_serves_nothing() -> None:
    async def main(stop: asyncio.Event) -> None:
        return None
    assert with_health(main, port=0, ready=lambda: (True, "")) is main


async def test_worker_and_reconciler_readiness(engine_factory) -> None:   # type: ignore[no-untyped-def]
    async with engine_factory() as eng:
        worker = eng.workers["thinker"][0]
        assert worker.ready() == (True, "")
        assert eng.reconcilers[0].ready() == (True, "")
        worker._heartbeat_ok_at -= 10 * eng.settings.lease_timeout_s     # as if Redis stopped answering
        ok, why = worker.ready()
        assert not ok and "no heartbeat" in why
