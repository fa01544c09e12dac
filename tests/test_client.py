"""The Python client, sync and async, against a real engine."""
from __future__ import annotations

import asyncio

import pytest

from omniflow.client import AsyncClient, Client
from omniflow.errors import AdmissionRefused, InvalidRequest, WorkflowRetired

from helpers import expected_text


async def test_async_client_submit_wait_events_and_audio(engine_factory, tmp_path) -> None:
    async with engine_factory() as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            wf = await client.submit("hello client", modalities=["text", "audio"])
            kinds = [fields["t"] async for _eid, fields in client.events(wf, timeout_s=10)]
            assert kinds[0] == "state" and kinds[-1] == "terminal" and "text" in kinds and "audio" in kinds
            doc = await client.wait(wf, timeout_s=10)
            assert doc["outputs"]["thinker"]["text"] == expected_text("hello client")
            seconds = await client.save_audio(wf, tmp_path / "a.flac")
            assert seconds == pytest.approx(doc["outputs"]["code2wav"]["duration_s"])


async def test_sync_client_submits_directly_and_maps_errors(engine_factory) -> None:
    async with engine_factory(max_in_flight=3) as eng:
        def work() -> None:
            with Client(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
                wf = client.submit("sync hello", request_id="sync-1")
                assert client.submit("sync hello", request_id="sync-1") == wf       # idempotent
                with pytest.raises(InvalidRequest, match="not produced"):
                    client.submit("x", modalities=["video"])
                client.abort(wf)
                with pytest.raises(WorkflowRetired, match="fresh"):
                    client.submit("sync hello", request_id="sync-1")
                ids = [client.submit(f"fill {i}") for i in range(3)]
                assert [client.wait(i, timeout_s=10)["state"] for i in ids] == ["completed"] * 3
        await asyncio.to_thread(work)


async def test_sync_client_admission_refusal(engine_factory) -> None:
    async with engine_factory(workers=False, max_in_flight=1) as eng:
        def work() -> None:
            with Client(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
                client.submit("one")
                with pytest.raises(AdmissionRefused):
                    client.submit("two")
        await asyncio.to_thread(work)


async def test_sync_client_refuses_a_request_id_reused_with_a_different_request(engine_factory) -> None:
    import asyncio

    import pytest

    from omniflow.client import Client
    from omniflow.errors import IdempotencyConflict

    async with engine_factory(workers=False, reconciler=False) as eng:
        def run() -> None:
            with Client(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
                first = client.submit("same key", request_id="k-1")
                assert client.submit("same key", request_id="k-1") == first
                with pytest.raises(IdempotencyConflict, match="different request"):
                    client.submit("another text", request_id="k-1")

        await asyncio.to_thread(run)
