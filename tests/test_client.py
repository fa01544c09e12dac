"""The Python client, sync and async, against a real engine."""
from __future__ import annotations

import asyncio
import importlib.util

import pytest

from omniflow.client import AsyncClient, Client
from omniflow.errors import AdmissionRefused, InvalidRequest, UnknownPipeline, WorkflowRetired
from omniflow.pipeline import build_pipeline, load_pipeline
from omniflow.storage import registry

from conftest import toy_spec
from helpers import eventually, expected_text


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
        def work() -> str:
            with Client(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
                # its thinker takes 8 x 0.2 s, so the abort below finds it live (at no delay the toy
                # pipeline could complete it first: then the resubmission is answered with its id)
                slow = {"thinker": {"token_delay_s": 0.2}}
                wf = client.submit("sync hello", request_id="sync-1", stage_params=slow)
                assert client.submit("sync hello", request_id="sync-1", stage_params=slow) == wf   # idempotent
                with pytest.raises(InvalidRequest, match="not produced"):
                    client.submit("x", modalities=["video"])
                client.abort(wf)
                with pytest.raises(WorkflowRetired, match="fresh"):
                    client.submit("sync hello", request_id="sync-1", stage_params=slow)
                ids = [client.submit(f"fill {i}") for i in range(3)]
                assert [client.wait(i, timeout_s=10)["state"] for i in ids] == ["completed"] * 3
                # its private loop is uvloop's where installed (OMNIFLOW_LOOP unset: the default)
                expected = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
                assert type(client._loop).__module__.split(".")[0] == expected
                return wf
        aborted = await asyncio.to_thread(work)
        # and the aborted workflow's sessions ended on every worker: aborted within milliseconds of
        # the workers' start, while its talker and code2wav sessions were being claimed (the abort
        # published before a worker subscribed, or read before the claim's reply, once left a session
        # waiting for input that never comes, until the engine's shutdown grace ran out)
        held = lambda: [k for ws in eng.workers.values() for w in ws for k in w.ctx.sessions  # noqa: E731
                        if k.startswith(f"{aborted}|")]
        await eventually(lambda: not held(), what=f"no session of the aborted {aborted} held ({held()})")


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


async def test_submit_many_then_wait_many_with_one_blocking_read(engine_factory) -> None:
    """`submit_many` pipelines the submits; `wait_many` returns every document once all are terminal,
    the watcher reading all their ends through one XREAD (at most one wake-up per blocked read)."""
    async with engine_factory() as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            texts = [f"many {i}" for i in range(20)]
            ids = await client.submit_many(texts)
            assert len(set(ids)) == 20
            docs = await client.wait_many(ids, timeout_s=30)
            assert list(docs) == ids
            assert [d["outputs"]["thinker"]["text"] for d in docs.values()] == [expected_text(t) for t in texts]
            async with client.completions() as ends:
                late = await client.submit_many(["later"])
                done = await asyncio.gather(*(ends.watch(wf) for wf in [*ids[:3], *late]))
                assert [d["state"] for d in done] == ["completed"] * 4
                assert ends.pokes <= 2 and ends.watched == 0


async def test_concurrent_submits_of_one_client_share_round_trips_and_each_hears_its_own_answer(engine_factory) -> None:
    """`submit` from many tasks at once: what piles up while one submit is on the wire goes out in the
    next round trip (the client's batcher), and each caller still gets its own id or refusal."""
    async with engine_factory(workers=False, max_in_flight=30) as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            batcher = client.store.batcher
            assert batcher is not None
            before = batcher.round_trips
            got = await asyncio.gather(*(client.submit(f"at once {i}") for i in range(40)), return_exceptions=True)
            ids = [g for g in got if isinstance(g, str)]
            refused = [g for g in got if isinstance(g, AdmissionRefused)]
            assert len(ids) == 30 and len(set(ids)) == 30 and len(refused) == 10, got
            assert batcher.commands - batcher.round_trips >= 1 and batcher.round_trips - before < 40
            states = [(await client.get(wf))["state"] for wf in ids]
            assert states == ["pending"] * 30


async def test_the_watcher_reads_one_stream_however_many_workflows_it_watches(engine_factory) -> None:
    """`completions()` reads its cell's stream of ends (`Keys.ends`), never one stream per watched
    workflow: its blocking read names one key with 1 workflow watched or 40."""
    async with engine_factory() as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            named: list[int] = []
            real = client.store.client.xread

            async def xread(streams, **kw):
                named.append(len(streams))
                return await real(streams, **kw)

            client.store.client.xread = xread       # type: ignore[method-assign]
            async with client.completions() as ends:
                (first,) = await client.submit_many(["one"])
                assert (await ends.watch(first))["state"] == "completed"
                ids = await client.submit_many([f"w {i}" for i in range(40)])
                docs = await asyncio.gather(*(ends.watch(wf) for wf in ids))
                assert [d["state"] for d in docs] == ["completed"] * 40
            assert named and set(named) == {1}, named


async def test_the_watcher_finds_an_end_it_did_not_read_at_its_check(engine_factory) -> None:
    """An end the watcher's read misses (trimmed from the stream while it fell behind, or written by
    an omniflow that kept no stream of ends) resolves at its next check of the watched workflows."""
    from omniflow.client.bulk import Completions

    async with engine_factory(workers=False) as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            (wf,) = await client.submit_many(["never read"])
            watcher = Completions(client.store, check_s=0.2)
            watcher._groups = []                   # no reader at all: only the checks can see the end
            async with watcher:
                fut = watcher.watch(wf)
                await asyncio.sleep(0.3)
                assert not fut.done()              # live: checked, still waiting
                await client.store.abort(wf, reason="ended unseen")
                doc = await asyncio.wait_for(fut, 5)
                assert doc["state"] == "aborted" and watcher.reads == 0


async def test_a_workflow_submitted_after_the_watcher_is_positioned_is_watched_without_a_state_check(
        engine_factory) -> None:
    """`AsyncClient.submit` tells its watchers of what it submits once they are positioned: watched, such
    a workflow is not checked (no HGET), its end is read; one that ended before the watch (its end read
    while nobody watched it) resolves from the recent ends. A repeated request's workflow (it may have
    ended long ago) and one submitted before the watcher is positioned are checked as before."""
    async with engine_factory() as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            old = await client.submit("before the watcher", request_id="r-old")
            await client.wait(old, timeout_s=30)
            async with client.completions() as ends:
                await eventually(lambda: ends.positioned)
                ids = [await client.submit(f"fresh {i}") for i in range(5)]
                docs = await asyncio.wait_for(asyncio.gather(*(ends.watch(wf) for wf in ids)), 30)
                assert [d["state"] for d in docs] == ["completed"] * 5
                assert ends.pokes == 0                      # none of them was checked
                early = await client.submit("ends before its watch")
                await client.wait(early, timeout_s=30)
                await eventually(lambda: early in ends._recent)      # the reader saw its end, unwatched
                assert (await asyncio.wait_for(ends.watch(early), 5))["state"] == "completed"
                assert ends.pokes == 0
                again = await client.submit("before the watcher", request_id="r-old")    # existing
                assert again == old
                assert (await asyncio.wait_for(ends.watch(old), 5))["state"] == "completed"
                assert ends.pokes == 1                      # checked: it ended before the positions


async def test_a_fresh_watch_of_a_workflow_that_ended_unseen_resolves_at_the_check(engine_factory) -> None:
    """A workflow said `submitted` whose end the reader never reads (here: no reader) is not lost:
    the periodic check finds it."""
    from omniflow.client.bulk import Completions

    async with engine_factory() as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            wf = await client.submit("ended unseen")
            await client.wait(wf, timeout_s=30)
            watcher = Completions(client.store, check_s=0.2)
            watcher._groups = []
            async with watcher:
                watcher.submitted(wf)
                doc = await asyncio.wait_for(watcher.watch(wf), 5)
                assert doc["state"] == "completed" and watcher.pokes == 0


async def test_submit_many_reports_each_refusal_in_place(engine_factory) -> None:
    async with engine_factory(workers=False, max_in_flight=2) as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            got = await client.submit_many(["a", "b", "c"], return_exceptions=True)
            assert isinstance(got[0], str) and isinstance(got[1], str) and isinstance(got[2], AdmissionRefused)
            with pytest.raises(AdmissionRefused):
                await client.submit_many(["d"])
            with pytest.raises(InvalidRequest, match="not produced"):
                await client.submit_many(["x"], modalities=["video"])


async def test_wait_many_says_which_workflow_does_not_exist(engine_factory) -> None:
    from omniflow.errors import WorkflowNotFound

    async with engine_factory(workers=False) as eng:
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            (wf,) = await client.submit_many(["pending"])
            with pytest.raises(WorkflowNotFound, match="nope"):
                await client.wait_many([wf, "nope"], timeout_s=0.5)
            docs = await client.wait_many([wf], timeout_s=0.2)     # not terminal: its current document
            assert docs[wf]["state"] == "pending"


async def test_a_client_given_no_pipeline_submits_to_the_deployments(engine_factory) -> None:
    """A client whose default comes from local settings (OMNIFLOW_PIPELINE: the toy pipeline) sends a
    request that names no pipeline to the one the deployment serves, not to a pipeline no worker serves
    (where it would wait until its deadline); with several and not its own, it says so."""
    spec = toy_spec()
    spec["name"] = "deployed-toy"
    async with engine_factory(spec=spec) as eng:
        assert eng.pipeline.name != load_pipeline(eng.settings.pipeline_path()).name
        await eventually(lambda: registry.names(eng.store.client, eng.store.keys), what="the pipeline registered")
        async with AsyncClient(eng.url, settings=eng.settings) as client:
            wf = await client.submit("where to")
            (more,) = await client.submit_many(["and this"])
            doc = await client.wait(wf, timeout_s=10)
            assert doc["state"] == "completed" and doc["pipeline"] == "deployed-toy", doc
            assert (await client.wait(more, timeout_s=10))["pipeline"] == "deployed-toy"

        def sync_submit() -> str:
            with Client(eng.url, settings=eng.settings) as client:
                return client.wait(client.submit("sync where to"), timeout_s=10)["pipeline"]
        assert await asyncio.to_thread(sync_submit) == "deployed-toy"

        other = build_pipeline({**toy_spec(), "name": "second-toy"})
        await registry.register(eng.store.client, eng.store.keys, other)
        async with AsyncClient(eng.url, settings=eng.settings) as client:
            with pytest.raises(UnknownPipeline, match=r"'omni-toy'.*not one this deployment serves.*deployed-toy"):
                await client.submit("which one")
            wf = await client.submit("this one", pipeline="second-toy")     # named: no guess
            assert (await client.get(wf))["pipeline"] == "second-toy"
        async with AsyncClient(eng.url, settings=eng.settings, pipeline=eng.pipeline) as client:
            # a pipeline given to the client is its default, whatever the registry holds
            assert (await client.wait(await client.submit("given"), timeout_s=10))["pipeline"] == "deployed-toy"
