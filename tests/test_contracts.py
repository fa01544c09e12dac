"""The lifecycle contracts of DESIGN §1, one named test each, against a real server
with real (in-process) workers and reconcilers."""
from __future__ import annotations

import asyncio

import pytest

from omniflow.storage.cells import cell_limit
from omniflow.errors import AdmissionRefused, InvalidRequest, WorkflowRetired
from omniflow.storage.keys import TASK_GROUP
from omniflow.client.store import new_id
from omniflow.storage.schema import s

from conftest import toy_spec
from helpers import eventually, expected_text, log_entries, request, run_to_end, stage_status, terminal_count, text_steps


async def test_output_modalities_outside_static_finals_is_refused_without_creating_anything(engine_factory) -> None:
    async with engine_factory() as eng:
        async def keys() -> set[bytes]:
            return {k async for k in eng.redis.scan_iter(match=f"{eng.settings.prefix}:*")}

        before = await keys()
        with pytest.raises(InvalidRequest, match="not produced by pipeline"):
            await eng.store.submit(request(modalities=["text", "video"]))
        # nothing of a workflow (the workers starting beside the test may add keys of their own:
        # consumer groups, heartbeats, the registry)
        made = [k for k in await keys() - before if any(part in k for part in (b":wf:", b":idx:", b":tinf"))]
        assert not made, made


async def test_text_is_delivered_before_audio_finishes(engine_factory) -> None:
    spec = toy_spec(code2wav={"chunk_delay_s": 0.15})
    async with engine_factory(spec) as eng:
        sub = await eng.store.submit(request("inner and outer finished"))
        await eventually(lambda: _status_is(eng, sub.id, "thinker", "done"))
        doc = await eng.store.document(sub.id)
        assert doc["state"] == "running"
        assert doc["outputs"]["thinker"] == {"type": "text", "text": expected_text("inner and outer finished"),
                                             "partial": False}
        assert doc["outputs"]["code2wav"]["partial"] is True
        assert doc["stages"]["code2wav"]["status"] != "done"
        final = await eng.store.wait(sub.id, timeout_s=20)
        assert final["state"] == "completed"
        assert final["outputs"]["code2wav"]["chunks"] == 8


async def _status_is(eng, wf_id: str, stage: str, status: str) -> bool:
    return await stage_status(eng.store, wf_id, stage) == status


@pytest.mark.parametrize("order", [("thinker", "code2wav", "talker"), ("thinker", "talker", "code2wav")],
                         ids=["audio-before-talker-terminal", "talker-terminal-before-audio"])
async def test_completion_exactly_once_in_either_arrival_order(engine_factory, order) -> None:
    """Workers finish normally; the reconciler then gets every stage's `done` report, in the given
    order (and twice), as it would from a pipeline where each report needs a decision. (With
    `finish_completes` off: the completing report goes to the reconciler, as it does for a
    workflow whose last final stage is on a parallel branch.)"""
    async with engine_factory(reconciler=False, finish_completes=False) as eng:
        sub = await eng.store.submit(request("order matters"))
        wf_key, cell = eng.store.keys.wf(sub.id), eng.store.keys.cell_of(sub.id)
        async def reported() -> list[tuple[bytes, dict[bytes, bytes]]]:
            return await eng.redis.xrange(eng.store.keys.events(cell))
        events = await eventually(reported)
        # Only the report that completes the terminal set was sent; the two before it changed
        # nothing but the `finished` set, which their finish scripts applied themselves.
        assert [f[b"s"] for _, f in events] == [b"code2wav"]
        assert set((await eng.redis.hget(wf_key, "finished")).decode().split(",")) == {"thinker", "talker"}
        sent = events[0][1]
        reports = {stage: (f"0-{i + 1}", {**sent, b"s": stage.encode(), b"d": b'{"stage": "%s"}' % stage.encode()})
                   for i, stage in enumerate(order)}
        await eng.redis.hset(wf_key, "finished", "")        # as if no report had been applied yet
        from omniflow.engine.reconciler import Reconciler
        rec = Reconciler(settings=eng.settings, pipeline=eng.pipeline, redis_url=eng.url)
        rec.redis, rec.keys = eng.redis, eng.store.keys
        results = [(await rec.apply([reports[stage]], cell))[0] for stage in order]
        assert results == ["advanced", "advanced", "completed"]
        assert (await rec.apply([reports[stage] for stage in order], cell)) == ["ignored"] * 3   # redelivery
        assert (await rec.apply([events[0]], cell)) == ["ignored"]                            # the real one, late
        doc = await eng.store.document(sub.id)
        assert doc["state"] == "completed"
        assert await terminal_count(eng.store, sub.id) == 1
        assert {name: "usage" in st for name, st in doc["stages"].items()} == dict.fromkeys(order, True)


@pytest.mark.parametrize("modalities,last", [(["text", "audio"], "code2wav"), (["text"], "thinker")])
async def test_the_last_final_stage_completes_its_workflow_in_its_finish(engine_factory, modalities, last) -> None:
    """The finish of a workflow's last final stage applies the completion itself (finalize, in the
    same script call) instead of reporting it: no event reaches the reconciler, and the workflow
    ends exactly as the reconciler would end it (log, indexes, in-flight set, tenant count, expiry)."""
    async with engine_factory() as eng:
        ids = [(await eng.store.submit(request(f"finish {i}", modalities=modalities))).id for i in range(5)]
        docs = [await eng.store.wait(i, timeout_s=20) for i in ids]
        assert {d["state"] for d in docs} == {"completed"}
        # counted by the worker once it has read its finish's reply (a waiter may see the end first)
        await eventually(lambda: sum(w.ctx.stats.get("completed", 0) for ws in eng.workers.values() for w in ws) == 5,
                         what="the finishes counted as completions")
        assert sum(r.counts["events"] for r in eng.reconcilers) == 0       # nothing was reported
        keys = eng.store.keys
        for wf_id, doc in zip(ids, docs):
            cell = keys.cell_of(wf_id)
            log = await log_entries(eng.store, wf_id)
            assert log[-2:] == [{"t": "stage", "stage": last, "status": "done", "attempt": "1"},
                                {"t": "terminal", "state": "completed", "error": "", "stage": ""}], log
            assert await terminal_count(eng.store, wf_id) == 1
            assert doc["finished_at"] and set(doc["final_stages"]) <= {s for s, st in doc["stages"].items()
                                                                         if st["status"] == "done"}
            assert await eng.redis.zscore(keys.inflight(cell), wf_id) is None
            assert await eng.redis.zscore(keys.state_index("running", cell), wf_id) is None
            assert await eng.redis.zscore(keys.state_index("completed", cell), wf_id) is not None
            # what stays expires; the edge logs are gone
            audio = [st for st in doc["final_stages"] if doc["outputs"][st]["type"] == "audio"]
            for k in (keys.wf(wf_id), keys.stages(wf_id), keys.log(wf_id), keys.done(wf_id),
                      *(keys.out(wf_id, st) for st in audio)):
                assert 0 < await eng.redis.ttl(k) <= eng.settings.result_ttl_s, k
            # a text output is in the record (it expires with it): no key of its own
            for st in set(doc["final_stages"]) - set(audio):
                assert await eng.redis.exists(keys.out(wf_id, st)) == 0
                assert s(await eng.redis.hget(keys.wf(wf_id), f"{st}:text")) == doc["outputs"][st]["text"] != ""
            edges = [keys.edge(wf_id, e.src, e.dst) for st in eng.pipeline.order for e in eng.pipeline.outputs[st]]
            assert await eng.redis.exists(*edges) == 0
            assert int(await eng.redis.hget(keys.tenant_inflight(cell), "default") or 0) == 0


async def test_presubmitted_downstream_waits_for_input_and_never_runs_on_placeholder(engine_factory) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.4})
    async with engine_factory(spec) as eng:
        sub = await eng.store.submit(request("slow first token"))
        await eventually(lambda: _status_is(eng, sub.id, "code2wav", "waiting_input"))
        assert await stage_status(eng.store, sub.id, "talker") == "waiting_input"
        st = await eng.redis.hmget(eng.store.keys.stages(sub.id), "talker:seq", "code2wav:seq")
        assert st == [b"0", b"0"]      # nothing emitted before any input exists
        assert await eng.redis.exists(eng.store.keys.edge(sub.id, "talker", "code2wav")) == 0
        await eng.store.abort(sub.id)


async def test_abort_reaches_all_stages_keeps_partial_outputs_and_wakes_waiters(engine_factory) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.05, "max_words": 40})
    async with engine_factory(spec) as eng:
        sub = await eng.store.submit(request("abort me please"))
        waiters = [asyncio.create_task(eng.store.wait(sub.id, timeout_s=30)) for _ in range(3)]
        await eventually(lambda: _has_audio(eng, sub.id))
        assert await eng.store.abort(sub.id, reason="user pressed stop") == "aborted"
        docs = await asyncio.wait_for(asyncio.gather(*waiters), 10)
        for doc in docs:
            assert doc["state"] == "aborted"
            assert doc["error"] == "user pressed stop"
            assert {st["status"] for st in doc["stages"].values()} == {"aborted"}
            assert doc["outputs"]["thinker"]["partial"] is True
            assert doc["outputs"]["thinker"]["text"].startswith("You said: abort me please")
            assert doc["outputs"]["code2wav"]["partial"] is True and doc["outputs"]["code2wav"]["chunks"] >= 1
        terminal = [f for f in await log_entries(eng.store, sub.id) if f.get("t") == "terminal"]
        assert terminal == [{"t": "terminal", "state": "aborted", "error": "user pressed stop", "stage": ""}]
        # every worker let go of its session (abort fan-out), so no task is left pending
        async def nothing_pending() -> bool:
            for stage in eng.pipeline.order:
                info = await eng.redis.xpending(eng.store.tasks_key(stage, eng.store.keys.cell_of(sub.id)), TASK_GROUP)
                if info["pending"]:
                    return False
            return True
        await eventually(nothing_pending)
        # the three sessions were fenced (more on a loaded machine: a session re-claimed after its
        # worker's lease lapsed is fenced too). A worker counts it once it reads its finish's reply,
        # which may come after the script acked the task (what `nothing_pending` saw): eventually
        async def all_fenced() -> bool:
            return sum(w.stats["fenced"] for ws in eng.workers.values() for w in ws) >= 3
        await eventually(all_fenced, what="three sessions fenced")


async def _has_audio(eng, wf_id: str) -> bool:
    seqs = await eng.redis.hmget(eng.store.keys.stages(wf_id), "thinker:seq", "code2wav:seq")
    return int(seqs[0] or 0) >= 5 and int(seqs[1] or 0) >= 1


async def test_resubmitting_an_aborted_id_is_refused_as_retired(engine_factory) -> None:
    async with engine_factory(workers=False) as eng:
        sub = await eng.store.submit(request(request_id="req-42"))
        await eng.store.abort(sub.id)
        with pytest.raises(WorkflowRetired) as err:
            await eng.store.submit(request(request_id="req-42"))
        assert "retired" in str(err.value) and "fresh" in str(err.value)
        with pytest.raises(WorkflowRetired):
            await eng.store.submit(request(), wf_id=sub.id)


async def test_idempotent_resubmit_with_same_key_returns_same_workflow(engine_factory) -> None:
    async with engine_factory() as eng:
        first = await eng.store.submit(request(request_id="same-key"))
        second = await eng.store.submit(request(request_id="same-key"))
        assert second.id == first.id and second.existing
        other_tenant = await eng.store.submit(request(request_id="same-key"), tenant="acme")
        assert other_tenant.id != first.id
        assert (await eng.store.wait(first.id, timeout_s=10))["state"] == "completed"
        assert sum([await eng.redis.zcard(eng.store.keys.all_wf(c)) for c in eng.store.keys.all_cells]) == 2


async def test_admission_over_max_in_flight_refuses_and_creates_nothing(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        keys = eng.store.keys
        # the limit is split over the cells (their shares add up to it): fill every share
        limit = max(2, keys.cells)
        eng.store.settings.max_in_flight = limit
        for cell in keys.all_cells:
            for _ in range(cell_limit(limit, keys.cells, cell)):
                await eng.store.submit(request(), wf_id=new_id(cell))
        keys_before = sorted([k async for k in eng.redis.scan_iter(match=f"{eng.settings.prefix}:*")])
        for extra in (request(request_id="third"), request()):
            with pytest.raises(AdmissionRefused) as err:
                await eng.store.submit(extra)
            assert err.value.retry_after_s > 0
        assert sorted([k async for k in eng.redis.scan_iter(match=f"{eng.settings.prefix}:*")]) == keys_before
        in_flight = sum([await eng.redis.zcard(keys.inflight(c)) for c in keys.all_cells])
        assert in_flight == limit


async def test_failed_stage_fails_workflow_and_aborts_the_others(engine_factory) -> None:
    spec = toy_spec(talker={"fail_at_step": 2, "fail_retryable": False}, thinker={"token_delay_s": 0.02})
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("break the talker"), timeout_s=15)
        assert doc["state"] == "failed"
        assert doc["error_stage"] == "talker"
        assert "injected failure at step 2" in doc["error"]
        assert doc["stages"]["talker"]["status"] == "failed"
        assert doc["stages"]["thinker"]["status"] in ("aborted", "done")
        assert doc["stages"]["code2wav"]["status"] == "aborted"
        dlq = await eng.redis.xrange(eng.store.keys.dlq("talker", eng.store.keys.cell_of(doc["id"])))
        assert [f[b"wf"].decode() for _, f in dlq] == [doc["id"]]
        assert await terminal_count(eng.store, doc["id"]) == 1
        with pytest.raises(WorkflowRetired):
            await eng.store.submit(request(), wf_id=doc["id"])


async def test_retryable_failure_resumes_without_duplicates(engine_factory) -> None:
    spec = toy_spec(thinker={"fail_at_step": 4, "fail_attempts": 1})
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("resume after a crash"), timeout_s=15)
        assert doc["state"] == "completed"
        assert doc["stages"]["thinker"]["attempt"] == 2
        assert doc["stages"]["thinker"]["usage"]["resumed_at"] == 3
        assert doc["outputs"]["thinker"]["text"] == expected_text("resume after a crash")
        assert doc["outputs"]["code2wav"]["chunks"] == 8
        seqs = text_steps(await log_entries(eng.store, doc["id"]))
        assert seqs == list(range(1, 9))
        retries = [f for f in await log_entries(eng.store, doc["id"]) if f.get("t") == "retry"]
        assert len(retries) == 1 and "injected failure" in retries[0]["reason"]


async def test_two_reconcilers_process_one_event_stream_without_double_transitions(engine_factory) -> None:
    # every completion through the reconciler (the finishes report it, not apply it)
    async with engine_factory(finish_completes=False) as eng:
        second = await eng.add_reconciler()
        ids = [(await eng.store.submit(request(f"prompt {i}"))).id for i in range(40)]
        docs = await asyncio.gather(*(eng.store.wait(i, timeout_s=30) for i in ids))
        assert {d["state"] for d in docs} == {"completed"}
        for wf_id in ids:
            assert await terminal_count(eng.store, wf_id) == 1
        completed = [r.counts["completed"] for r in eng.reconcilers]
        assert sum(completed) == 40
        assert second.counts["events"] > 0 and eng.reconcilers[0].counts["events"] > 0


@pytest.mark.parametrize("modalities,finals", [(["text"], ["thinker"]), (["audio"], ["code2wav"]),
                                               (["text", "audio"], ["thinker", "code2wav"])])
async def test_one_result_shape_outputs_keyed_by_stage(engine_factory, modalities, finals) -> None:
    async with engine_factory() as eng:
        doc = await run_to_end(eng.store, request("shape", modalities=modalities), timeout_s=10)
        assert doc["state"] == "completed"
        assert doc["final_stages"] == finals
        assert sorted(doc["outputs"]) == sorted(finals)
        for stage in finals:
            assert doc["outputs"][stage]["type"] == eng.pipeline.stages[stage].final_output
        if modalities == ["audio"]:
            # text was not asked for: nothing is written for it, but the talker still got the chunks
            assert await eng.redis.exists(eng.store.keys.out(doc["id"], "thinker")) == 0
            assert doc["outputs"]["code2wav"]["chunks"] == 8


async def test_full_edge_successor_is_submitted_after_its_producer_finishes(engine_factory) -> None:
    spec = toy_spec(talker={"chunk_delay_s": 0.05})
    spec["edges"][1]["mode"] = "full"
    async with engine_factory(spec) as eng:
        sub = await eng.store.submit(request("full edge"))
        await eventually(lambda: _status_is(eng, sub.id, "talker", "running"))
        doc = await eng.store.document(sub.id)
        assert doc["stages"]["code2wav"]["submitted"] is False
        final = await eng.store.wait(sub.id, timeout_s=15)
        assert final["state"] == "completed"
        assert final["stages"]["code2wav"]["started_at"] >= final["stages"]["talker"]["finished_at"]
        assert final["outputs"]["code2wav"]["chunks"] == 8


async def test_deadline_fails_a_workflow_that_runs_too_long(engine_factory) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.5})
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("too slow", deadline_s=0.5), timeout_s=10)
        assert doc["state"] == "failed"
        assert doc["error"] == "deadline exceeded"
