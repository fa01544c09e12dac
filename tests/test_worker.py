"""Worker runtime robustness: bad entries never kill a worker, abort fan-out, drain on stop."""
from __future__ import annotations

import asyncio

import pytest

from omniflow.engine.worker import intake as intake_module
from omniflow.engine.worker import liveness
from omniflow.storage import redisio
from omniflow.storage.keys import TASK_GROUP
from omniflow.storage.schema import now_ms, s
from omniflow.storage.transitions.sessions import claim

from conftest import toy_spec
from helpers import eventually, expected_text, log_entries, request, run_to_end


async def test_malformed_task_entry_goes_to_dead_letter_and_worker_keeps_serving(engine_factory) -> None:
    async with engine_factory() as eng:
        tasks = eng.store.tasks_key("thinker", 0)
        await eng.redis.xadd(tasks, {"garbage": "yes"})
        await eng.redis.xadd(tasks, {"wf": "x", "s": "thinker", "a": "not-a-number"})
        await eng.redis.xadd(tasks, {"wf": "x", "s": "talker", "a": "1"})
        async def three_dead_letters() -> bool:
            return await eng.redis.xlen(eng.store.keys.dlq("thinker", 0)) == 3
        await eventually(three_dead_letters)
        reasons = [f[b"reason"].decode() for _, f in await eng.redis.xrange(eng.store.keys.dlq("thinker", 0))]
        assert all(r.startswith("malformed task entry") for r in reasons)
        assert (await eng.redis.xpending(tasks, TASK_GROUP))["pending"] == 0
        sub = await eng.store.submit(request("still alive"))
        assert (await eng.store.wait(sub.id, timeout_s=10))["state"] == "completed"


async def test_malformed_event_goes_to_dead_letter_and_reconciler_keeps_going(engine_factory) -> None:
    async with engine_factory() as eng:
        await eng.redis.xadd(eng.store.keys.events(0), {"t": "exploded", "wf": "x", "s": "thinker", "a": "1"})
        await eng.redis.xadd(eng.store.keys.events(0), {"nonsense": "1"})
        async def two() -> bool:
            return await eng.redis.xlen(eng.store.keys.dlq("events", 0)) == 2
        await eventually(two)
        sub = await eng.store.submit(request("reconciler alive"))
        assert (await eng.store.wait(sub.id, timeout_s=10))["state"] == "completed"


async def test_executor_bug_is_a_stage_failure_not_a_worker_crash(engine_factory) -> None:
    spec = toy_spec(talker={"fail_at_step": 1, "fail_attempts": 1})
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("flaky talker"), timeout_s=10)
        assert doc["state"] == "completed"
        assert doc["stages"]["talker"]["attempt"] == 2
        assert doc["outputs"]["code2wav"]["chunks"] == 8
        assert doc["outputs"]["thinker"]["text"] == expected_text("flaky talker")


async def test_input_that_never_comes_fails_with_a_clear_reason(engine_factory) -> None:
    spec = toy_spec(thinker={"token_delay_s": 5.0})
    spec["stages"]["talker"]["retry"]["input_timeout_s"] = 0.3
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("silence"), timeout_s=10)
        assert doc["state"] == "failed"
        assert doc["error_stage"] == "talker"
        assert "no input from ['thinker'] within 0.3s" in doc["error"]


@pytest.mark.parametrize("tail", [64, 1], ids=["tail-enough", "whole-log"])
async def test_a_session_whose_inbox_copies_are_lost_reads_its_edge_logs_again(engine_factory, monkeypatch,
                                                                                 tail) -> None:
    """The talker's worker loses every inbox copy of its input (as a failover can lose them, or the
    claim that bound the session): the session, waiting, reads its upstream edge log again (a quarter
    of its input timeout in) and the workflow completes with the fault-free outputs, in order. (With
    a one-entry tail read the log's end does not reach back to what was read: it is read whole.)"""
    monkeypatch.setattr(liveness, "RESYNC_TAIL", tail)
    spec = toy_spec()
    spec["stages"]["talker"]["retry"]["input_timeout_s"] = 8
    async with engine_factory(spec) as eng:
        talker = eng.workers["talker"][0].ctx

        found = talker.inputs.get       # every inbox entry for a talker session finds no session
        monkeypatch.setattr(talker.inputs, "get", lambda key: None if key[1] == "talker" else found(key))
        doc = await run_to_end(eng.store, request("lost copies"), timeout_s=30)
        assert doc["state"] == "completed", doc
        assert doc["stages"]["talker"]["attempt"] == 1          # no retry: the same session read them
        assert doc["outputs"]["thinker"]["text"] == expected_text("lost copies")
        assert doc["outputs"]["code2wav"]["chunks"] == len(expected_text("lost copies").split())
        assert talker.stats.get("resynced", 0) >= 1


async def test_stopping_a_worker_hands_unfinished_sessions_back(engine_factory) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.1, "max_words": 12})
    async with engine_factory(spec, workers=False) as eng:
        await eng.add_worker("thinker", grace_s=0.05)
        for stage in ("talker", "code2wav"):
            await eng.add_worker(stage)
        sub = await eng.store.submit(request("hand over"))
        async def started() -> bool:
            return int(await eng.redis.hget(eng.store.keys.stages(sub.id), "thinker:seq") or 0) >= 2
        await eventually(started)
        stop, task = eng._tasks[1]          # the first thinker worker
        stop.set()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 20)
        await eng.add_worker("thinker")
        doc = await eng.store.wait(sub.id, timeout_s=20)
        assert doc["state"] == "completed"
        assert doc["stages"]["thinker"]["attempt"] == 2         # re-queued at once: it deregistered
        assert doc["stages"]["thinker"]["usage"]["resumed_at"] >= 2
        assert doc["outputs"]["thinker"]["text"] == expected_text("hand over", 12)


async def test_attempt_timeout_retries_then_fails_with_the_reason(engine_factory) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.5})
    spec["stages"]["thinker"]["retry"].update(attempt_timeout_s=0.2, max_attempts=2)
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("too slow per attempt"), timeout_s=15)
        assert doc["state"] == "failed"
        assert doc["error_stage"] == "thinker"
        assert "attempt timed out after 0.2s" in doc["error"]
        assert doc["stages"]["thinker"]["attempt"] == 2
        dlq = await eng.redis.xrange(eng.store.keys.dlq("thinker", eng.store.keys.cell_of(doc["id"])))
        assert [f[b"wf"].decode() for _, f in dlq] == [doc["id"]]


async def test_a_stage_that_cannot_resume_restarts_with_its_downstream(engine_factory) -> None:
    spec = toy_spec(thinker={"fail_at_step": 4, "fail_attempts": 1, "token_delay_s": 0.01})
    spec["stages"]["thinker"]["executor"] = "workers_fixtures:AttemptThinker"
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("start over"), timeout_s=15)
        assert doc["state"] == "completed"
        # the whole text is attempt 2's: nothing from the abandoned attempt survives
        assert doc["outputs"]["thinker"]["text"] == " ".join(f"a2w{i}" for i in range(8))
        assert doc["outputs"]["code2wav"]["chunks"] == 8
        assert doc["stages"]["talker"]["attempt"] == 2 and doc["stages"]["code2wav"]["attempt"] == 2
        log = await log_entries(eng.store, doc["id"])
        restarts = [f for f in log if f.get("t") == "restart"]
        assert restarts == [{"t": "restart", "stage": "thinker", "attempt": "2", "stages": "thinker,talker,code2wav"}]
        reasons = {f["stage"]: f["reason"] for f in log if f.get("t") == "retry" and f["stage"] != "thinker"}
        assert reasons == {"talker": "upstream thinker restarted", "code2wav": "upstream thinker restarted"}


async def test_a_session_of_a_forgotten_worker_whose_task_comes_again_is_retried(engine_factory) -> None:
    """A failover lost the delivery of a thinker task but kept its claim (sent again) by worker
    `ghost`, which then died and, holding nothing pending, was forgotten by the reconciler. The
    stream delivers the task again, to a live worker: its claim leaves the task pending for
    `ghost` and leases `ghost` again, so the reconciler's sweep finds the session lost and retries
    it, and the workflow completes (it used to hang until its consumers' input timeout)."""
    async with engine_factory(workers=False) as eng:
        sub = await eng.store.submit(request("ghost"))
        cell = eng.store.keys.cell_of(sub.id)
        stream = eng.store.tasks_key("thinker", cell)
        got = await eng.redis.xreadgroup(TASK_GROUP, "ghost", {stream: ">"}, count=10)
        entry_id = s(got[0][1][0][0])
        res = await redisio.call(eng.redis, *claim(eng.store.keys, "thinker", (), cell, [(entry_id, sub.id, 1)],
                                                   worker_id="ghost", now_ms=now_ms(),
                                                   queue=eng.store.pipeline.queue("thinker")))
        assert s(res[0][0]) == "ok"
        await eng.redis.xack(stream, TASK_GROUP, entry_id)                        # the delivery, lost
        await eng.redis.execute_command("XGROUP", "SETID", stream, TASK_GROUP, "0")
        await eng.redis.execute_command("XGROUP", "DELCONSUMER", stream, TASK_GROUP, "ghost")   # forgotten
        for stage in ("thinker", "talker", "code2wav"):
            await eng.add_worker(stage)
        doc = await eng.store.wait(sub.id, timeout_s=30)
        assert doc["state"] == "completed", doc
        assert doc["outputs"]["thinker"]["text"] == expected_text("ghost")
        assert doc["stages"]["thinker"]["attempt"] == 2          # ghost's attempt was found lost and retried
        log = await log_entries(eng.store, doc["id"])
        assert any(f.get("t") == "retry" and "ghost" in f.get("reason", "") for f in log), log


async def test_a_task_delivered_but_never_received_is_claimed_again(engine_factory, monkeypatch) -> None:
    """The reply of an XREADGROUP lost with its connection (a failover, a killed client) leaves the
    task pending for a live worker that never heard of it: the worker finds it and claims it."""
    monkeypatch.setattr(intake_module, "ORPHAN_AUDIT_S", 0.3)
    monkeypatch.setattr(intake_module, "ORPHAN_IDLE_MS", 200)
    async with engine_factory(workers=False) as eng:
        for stage in ("talker", "code2wav"):
            await eng.add_worker(stage)
        sub = await eng.store.submit(request("lost in delivery"))
        worker_id = "thinker-orphan-test"
        # delivered to the thinker worker-to-be, whose read's reply never arrives
        stream = eng.store.tasks_key("thinker", eng.store.keys.cell_of(sub.id))
        got = await eng.redis.xreadgroup(TASK_GROUP, worker_id, {stream: ">"}, count=10)
        assert got and len(got[0][1]) == 1
        worker = await eng.add_worker("thinker", worker_id=worker_id)
        doc = await eng.store.wait(sub.id, timeout_s=20)
        assert doc["state"] == "completed", doc
        assert doc["outputs"]["thinker"]["text"] == expected_text("lost in delivery")
        assert doc["stages"]["thinker"]["attempt"] == 1          # the same attempt: nothing was retried
        assert worker.stats["orphans"] == 1


@pytest.mark.parametrize(("prefetch", "held"), [(None, 8), (1, 5)])
async def test_a_backlog_is_claimed_a_whole_batch_ahead_unless_prefetch_is_set(engine_factory, prefetch, held) -> None:
    from workers_fixtures import HeldThinker

    HeldThinker.release = asyncio.Event()
    spec = toy_spec()
    spec["stages"]["thinker"].update(executor="workers_fixtures:HeldThinker", max_sessions=4, prefetch=prefetch)
    async with engine_factory(spec, workers=False) as eng:
        ids = [(await eng.store.submit(request(f"queued {i}"))).id for i in range(12)]   # queued before a worker
        for stage in eng.pipeline.order:
            await eng.add_worker(stage)
        pool = eng.workers["thinker"][0].pools[eng.pipeline.queue("thinker")]
        # 4 slots: by default the first read finds a backlog (5 asked, 5 delivered) and the pool then
        # claims a whole batch ahead (4 + 4); a prefetch the stage sets is kept (4 + 1)
        await eventually(lambda: pool.active == held)
        assert pool.core.deep and pool.capacity == held and pool.free == 0
        HeldThinker.release.set()
        for wf_id in ids:
            assert (await eng.store.wait(wf_id, timeout_s=30))["state"] == "completed"
        # the queue ran dry: reads come back short, and the pool holds no more than a quarter ahead
        HeldThinker.release = asyncio.Event()
        more = [(await eng.store.submit(request(f"one by one {i}"))).id for i in range(2)]
        await eventually(lambda: pool.active == 2)
        assert not pool.core.deep and pool.capacity == 5
        HeldThinker.release.set()
        for wf_id in more:
            assert (await eng.store.wait(wf_id, timeout_s=30))["state"] == "completed"


async def test_finished_tasks_are_trimmed_and_an_idle_worker_sends_no_trims(engine_factory, monkeypatch) -> None:
    """A finish acks its task and leaves the entry; the workers trim their streams (`Intake.trim`)
    after they closed sessions, and an idle one sends nothing."""
    monkeypatch.setattr(intake_module, "TRIM_S", 0.1)
    trims: list[int] = []
    real = redisio.execute

    async def counted(redis, commands):
        trims.extend(1 for c in commands if c[0] == "FCALL" and str(c[1]).startswith("trim_tasks_"))
        return await real(redis, commands)

    monkeypatch.setattr(intake_module.redisio, "execute", counted)
    async with engine_factory() as eng:
        ids = [(await eng.store.submit(request(f"trim me {i}"))).id for i in range(5)]
        for wf_id in ids:
            assert (await eng.store.wait(wf_id, timeout_s=10))["state"] == "completed"
        streams = [eng.store.tasks_key(stage, 0) for stage in ("thinker", "talker", "code2wav")]

        async def empty() -> bool:
            return all([await eng.redis.xlen(x) == 0 for x in streams])
        await eventually(empty)
        for stream in streams:
            group = next(g for g in await eng.redis.xinfo_groups(stream) if s(g["name"]) == TASK_GROUP)
            assert group["pending"] == 0 and group["lag"] == 0 and group["entries-read"] == 5

        async def settled() -> int | None:      # the trims after the last close are done
            before = len(trims)
            await asyncio.sleep(0.3)
            return before if len(trims) == before else None
        done = await eventually(settled, what="the trims after the last close")
        await asyncio.sleep(0.6)                # six idle ticks
        assert done > 0 and len(trims) == done
