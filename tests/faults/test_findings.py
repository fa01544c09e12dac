"""One regression test per finding of issue 9 ("When Redis says no"), against the session's real
Valkey, plus issue 10's "executor errors are not Redis losses". Each test is named after its
finding and fails on the code the finding was made against."""
from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgpack
import pytest
from redis.asyncio import Redis

from omniflow.storage import redisio, scripts
from omniflow.errors import RedisUnavailable, ScriptError
from omniflow.storage.keys import EVENT_GROUP, TASK_GROUP
from omniflow.engine.reconciler import Reconciler, backoff_ms
from omniflow.storage.schema import now_ms, s
from omniflow.storage.transitions.emit import EMIT_LOG

from conftest import toy_spec
from helpers import eventually, expected_text, log_entries, request, run_to_end, text_steps


@asynccontextmanager
async def out_of_memory(redis: Redis) -> AsyncIterator[None]:
    """The server refuses every write that could grow memory (maxmemory below usage), until the block ends."""
    await redis.config_set("maxmemory", 1)
    try:
        yield
    finally:
        await redis.config_set("maxmemory", 0)


def steps_of(command: tuple[Any, ...]) -> list[int]:
    """The step seqs an `emit.lua` call carries (none for any other command)."""
    if command[0] != "FCALL" or command[1] != scripts.SCRIPTS["emit"].function:
        return []
    nkeys = command[2]
    packed = command[3 + nkeys + 5]
    return [step[0] for step in msgpack.unpackb(packed, raw=True)]


# ---------------------------------------------------------------- finding 1
async def test_finding1_a_stage_is_never_done_over_a_lost_write(engine_factory) -> None:
    """The write carrying the thinker's last step is lost on the way (a dropped connection), while
    `run()` has already returned: the finish must not mark the stage done with a step missing."""
    async with engine_factory(toy_spec(thinker={"token_delay_s": 0.01})) as eng:
        batcher = eng.workers["thinker"][0].batcher
        real_run = batcher._run
        lost: list[tuple[Any, ...]] = []

        async def lossy(commands: list[tuple[Any, ...]]) -> list[Any]:
            if not lost and any(8 in steps_of(c) for c in commands):
                lost.extend(commands)
                raise RedisUnavailable("Redis unreachable: connection lost (injected)")
            return await real_run(commands)

        batcher._run = lossy  # type: ignore[method-assign]
        doc = await run_to_end(eng.store, request("lose the last word"), timeout_s=20)
        assert lost, "the fault was never injected"
        assert doc["state"] == "completed"
        assert doc["outputs"]["thinker"]["text"] == expected_text("lose the last word")
        # retried for the lost write (at least once: on a loaded machine a lapsed lease may add one more)
        assert doc["stages"]["thinker"]["attempt"] >= 2
        assert text_steps(await log_entries(eng.store, doc["id"])) == list(range(1, 9))   # each step once
        assert doc["outputs"]["code2wav"]["chunks"] == 8


async def _claimed_thinker(eng: Any, text: str) -> tuple[Any, bytes]:
    """A text-only workflow whose thinker task consumer `w1` has read and claimed by hand (claim.lua,
    attempt 1): the workflow and the task's entry id."""
    sub = await eng.store.submit(request(text, modalities=["text"]))
    tasks = eng.store.tasks_key("thinker", 0)
    await redisio.ensure_group(eng.redis, tasks, TASK_GROUP)
    entry_id, _ = (await eng.redis.xreadgroup(TASK_GROUP, "w1", {tasks: ">"}, count=1))[0][1][0]
    await redisio.script(eng.redis, "claim", claim_keys(eng, tasks, sub.id),
                         [eng.settings.prefix, TASK_GROUP, "w1", now_ms(), "", "thinker", s(entry_id), sub.id, "1"])
    return sub, entry_id


async def test_finding1_finish_with_steps_missing_is_a_retryable_failure(engine_factory) -> None:
    """The script-level guarantee: a finish whose step count is above what is stored closes the
    session as a retryable failure ('gap'), never as done."""
    async with engine_factory(workers=False, reconciler=False) as eng:
        sub, entry_id = await _claimed_thinker(eng, "gap")
        step = msgpack.packb([[1, "T", "a", ""]], use_bin_type=False)
        fin = msgpack.packb([TASK_GROUP, s(entry_id), "done", "{}", "1", 2, ""], use_bin_type=False)
        reply = await redisio.script(eng.redis, "emit", emit_keys(eng, sub.id),
                                     ["thinker", 1, "", now_ms(), sub.id, step, fin])
        assert s(reply) == "gap"
        st = await eng.redis.hgetall(eng.store.keys.stages(sub.id))
        assert st[b"thinker"] == b"failed" and b"were not stored" in st[b"thinker:error"]
        (_, event), = await eng.redis.xrange(eng.store.keys.events(0))
        assert event[b"t"] == b"failed" and event[b"r"] == b"1"


# ---------------------------------------------------------------- finding 2
async def test_finding2_the_reconciler_never_acks_an_event_it_did_not_apply(engine_factory) -> None:
    # the completing report goes to the reconciler (its finish does not complete the workflow itself)
    async with engine_factory(reconciler=False, finish_completes=False) as eng:
        sub = await eng.store.submit(request("ack only what was applied"))
        events = await eventually(lambda: eng.redis.xrange(eng.store.keys.events(0)))
        rec = Reconciler(settings=eng.settings, pipeline=eng.pipeline, redis_url=eng.url)
        rec.redis, rec.keys = eng.redis, eng.store.keys
        await redisio.ensure_group(eng.redis, eng.store.keys.events(0), EVENT_GROUP)
        async with out_of_memory(eng.redis):
            assert await rec.apply(events) == ["pending"]
        assert await eng.redis.xlen(eng.store.keys.events(0)) == 1            # still there: not acked, not deleted
        assert (await eng.store.document(sub.id))["state"] == "running"
        await eng.redis.script_flush()                                       # and after a restart: NOSCRIPT
        assert await rec.apply(events) == ["completed"]
        assert await eng.redis.xlen(eng.store.keys.events(0)) == 0              # acked with its application
        assert (await eng.store.document(sub.id))["state"] == "completed"


# ---------------------------------------------------------------- finding 3
async def test_finding3_a_refused_close_never_leaks_the_task_on_a_live_worker(engine_factory) -> None:
    """The call that closes a session fails with a script error once: the session is reported lost
    (re-queued and resumed), not left pending on a worker that keeps its lease."""
    async with engine_factory(toy_spec(thinker={"token_delay_s": 0.01})) as eng:
        batcher = eng.workers["thinker"][0].batcher
        real_run = batcher._run
        failed: list[int] = []

        async def refusing(commands: list[tuple[Any, ...]]) -> list[Any]:
            # the first emit carrying a finish (its 8th argument) fails with a script error, unapplied
            hit = next((i for i, c in enumerate(commands) if not failed and c[0] == "FCALL"
                        and c[1] == scripts.SCRIPTS["emit"].function and len(c) == 3 + c[2] + 7), None)
            if hit is None:
                return await real_run(commands)
            failed.append(hit)
            rest = await real_run(commands[:hit] + commands[hit + 1:]) if len(commands) > 1 else []
            return [*rest[:hit], redisio.translate(_response_error("ERR injected: the finish failed")), *rest[hit:]]

        batcher._run = refusing  # type: ignore[method-assign]
        sub = await eng.store.submit(request("close me"))
        doc = await eng.store.wait(sub.id, timeout_s=20)
        assert failed
        assert doc["state"] == "completed"
        assert doc["outputs"]["thinker"]["text"] == expected_text("close me")
        for stage in eng.pipeline.order:
            assert (await eng.redis.xpending(eng.store.tasks_key(stage, 0), TASK_GROUP))["pending"] == 0


def _response_error(message: str) -> Exception:
    from redis.exceptions import ResponseError

    return ResponseError(message)


# ---------------------------------------------------------------- finding 4
def test_finding4_backoff_of_a_huge_attempt_does_not_overflow() -> None:
    assert backoff_ms(1100, base_s=0.1, cap_s=5.0, jitter=0.2, rng=random.Random(1)) <= 6000


async def test_finding4_a_malformed_event_is_dead_lettered_and_the_reconciler_keeps_going(engine_factory) -> None:
    async with engine_factory() as eng:
        events = eng.store.keys.events(0)
        await eng.redis.xadd(events, {"t": "failed", "wf": "nope", "s": "thinker", "a": "1100", "d": "x", "r": "1"})
        await eng.redis.xadd(events, {"t": "failed", "wf": "nope", "s": "thinker", "a": str(2 ** 1100)})
        await eng.redis.xadd(events, {"t": "done", "wf": "nope", "s": "thinker", "a": "1", "d": b"\xff\xfe"})
        dlq = eng.store.keys.dlq("events", 0)
        await eventually(lambda: _xlen_is(eng.redis, dlq, 2))
        reasons = [f[b"reason"].decode() for _, f in await eng.redis.xrange(dlq)]
        assert "out of bounds" in reasons[0] and "not UTF-8" in reasons[1]
        await eventually(lambda: _xlen_is(eng.redis, events, 0))           # the 1100 one was applied (ignored)
        assert (await run_to_end(eng.store, request("still reconciling")))["state"] == "completed"


# ---------------------------------------------------------------- finding 5
async def test_finding5_out_of_memory_stops_no_worker_and_keeps_its_lease(engine_factory) -> None:
    async with engine_factory() as eng:
        worker = eng.workers["thinker"][0]
        task = eng._tasks[1][1]
        async with out_of_memory(eng.redis):
            # a lease ending 3 lease timeouts from now comes from a heartbeat sent 2 lease timeouts into
            # the outage: by then the lease the worker had when Redis started refusing has long lapsed
            renewed_at_ms = now_ms() + 3 * int(eng.settings.lease_timeout_s * 1000)
            await eventually(lambda: _lease_ends_after(eng, worker.id, renewed_at_ms),
                             timeout_s=eng.settings.lease_timeout_s * 2 + 10,
                             what="a heartbeat two lease timeouts into the out-of-memory window")
            assert not task.done()
            assert await eng.redis.zscore(eng.store.keys.workers, worker.id) > now_ms()   # heartbeat allowed
        assert not task.done()
        assert (await run_to_end(eng.store, request("after the storm")))["state"] == "completed"


async def _lease_ends_after(eng, worker_id: str, at_ms: int) -> bool:
    return (await eng.redis.zscore(eng.store.keys.workers, worker_id) or 0) >= at_ms


# ---------------------------------------------------------------- finding 6
async def test_finding6_restart_requeues_a_downstream_stage_that_already_finished(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        sub = await eng.store.submit(request("restart"))
        wf, sk = eng.store.keys.wf(sub.id), eng.store.keys.stages(sub.id)
        # as if: the talker finished (done, in `finished`) while the thinker's attempt 2 must restart
        await eng.redis.hset(wf, mapping={"state": "running", "finished": "talker"})
        await eng.redis.hset(sk, mapping={"thinker": "running", "thinker:attempt": 2, "talker": "done",
                                          "code2wav": "waiting_input"})
        before = await eng.redis.xlen(eng.store.tasks_key("talker", 0))
        keys = [wf, sk, f"{wf}:log", f"{wf}:edge:thinker:talker", f"{wf}:edge:talker:code2wav",
                *(f"{wf}:out:{st}" for st in ("thinker", "talker", "code2wav")),
                eng.store.tasks_key("talker", 0), eng.store.tasks_key("code2wav", 0)]
        reply = await redisio.script(eng.redis, "restart", keys, [eng.settings.prefix, "thinker", 2, now_ms(),
                                                                  "talker,code2wav", "thinker:talker,talker:code2wav"])
        assert s(reply) == "ok"
        st = {s(k): s(v) for k, v in (await eng.redis.hgetall(sk)).items()}
        assert st["talker"] == "pending" and st["talker:attempt"] == "2"
        assert st["code2wav"] == "pending" and st["code2wav:attempt"] == "2"
        assert await eng.redis.xlen(eng.store.tasks_key("talker", 0)) == before + 1
        assert s(await eng.redis.hget(wf, "finished")) == ""


# ---------------------------------------------------------------- finding 7
async def test_finding7_idempotency_keys_of_two_tenants_never_collide(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        first = await eng.store.submit(request("one", request_id="a:x"), tenant="team")
        second = await eng.store.submit(request("two", request_id="x"), tenant="team:a")
        assert first.id != second.id and not second.existing
        again = await eng.store.submit(request("one", request_id="a:x"), tenant="team")
        assert again.existing and again.id == first.id


# ---------------------------------------------------------------- finding 8
async def test_finding8_emit_with_a_malformed_step_writes_nothing(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        sub, entry_id = await _claimed_thinker(eng, "atomic")

        def call(steps: list[Any]) -> Any:
            return redisio.script(eng.redis, "emit", emit_keys(eng, sub.id),
                                  ["thinker", 1, "running", now_ms(), sub.id,
                                   msgpack.packb(steps, use_bin_type=False)])

        good = [1, "T", "a", ""]
        with pytest.raises(ScriptError, match="unknown op"):
            await call([good, [2, "Z", "x", ""]])
        with pytest.raises(ScriptError, match="field pairs"):
            await call([good, [2, "X", EMIT_LOG, ["t"]]])
        assert await eng.store.text(sub.id, "thinker") == ""
        assert s(await eng.redis.hget(eng.store.keys.stages(sub.id), "thinker:seq")) == "0"
        assert [f for f in await log_entries(eng.store, sub.id) if f.get("t") == "text"] == []
        assert s(await call([good, [2, "T", "b", ""]])) == "ok"          # the retry writes each step once
        assert await eng.store.text(sub.id, "thinker") == "ab"


# ---------------------------------------------------------------- finding 9
async def test_finding9_a_huge_attempt_never_stalls_the_worker(engine_factory) -> None:
    async with engine_factory() as eng:
        tasks = eng.store.tasks_key("thinker", 0)
        await eng.redis.xadd(tasks, {"wf": "ghost", "s": "thinker", "a": str(10 ** 12)})
        await eng.redis.xadd(tasks, {"wf": "ghost", "s": "thinker", "a": "9999"})     # in bounds: claimed, dropped
        dlq = eng.store.keys.dlq("thinker", 0)
        await eventually(lambda: _xlen_is(eng.redis, dlq, 1))
        (_, entry), = await eng.redis.xrange(dlq)
        assert b"out of bounds" in entry[b"reason"]
        assert (await run_to_end(eng.store, request("not stalled"), timeout_s=10))["state"] == "completed"
        await eventually(lambda: _xlen_is(eng.redis, tasks, 0))


# ---------------------------------------------------------------- finding 10
async def test_finding10_dead_letters_are_capped_and_dead_consumers_are_reaped(engine_factory) -> None:
    async with engine_factory(dlq_max_len=10) as eng:
        tasks, dlq = eng.store.tasks_key("thinker", 0), eng.store.keys.dlq("thinker", 0)
        for _ in range(300):
            await eng.redis.xadd(tasks, {"garbage": "1"})
        await eventually(lambda: _xlen_is(eng.redis, tasks, 0), timeout_s=20)
        assert 0 < await eng.redis.xlen(dlq) < 300        # approximate MAXLEN: whole nodes trimmed
        # consumers that crashed reconcilers left in the event group
        events = eng.store.keys.events(0)
        for name in ("rec-dead-1", "rec-dead-2"):
            await eng.redis.xreadgroup(EVENT_GROUP, name, {events: ">"}, count=1)
        rec = eng.reconcilers[0]
        await eventually(lambda: _idle(eng.redis, events, {"rec-dead-1", "rec-dead-2"}),
                         what="the dead consumers idle for more than 0 ms")
        assert await rec.sweeps.consumers(idle_ms=0) >= 2
        names = {s(c["name"]) for c in await eng.redis.xinfo_consumers(events, EVENT_GROUP)}
        assert not names & {"rec-dead-1", "rec-dead-2"}
    # a reconciler that stops leaves the group
    names = {s(c["name"]) for c in await _consumers(eng.url, events)}
    assert rec.id not in names


async def test_finding10_a_wake_stream_expires(engine_factory) -> None:
    from omniflow.storage.mux import WAKE_TTL_S, StreamMux

    async with engine_factory(workers=False, reconciler=False) as eng:
        mux = StreamMux(eng.redis, eng.store.keys, owner_id="killed-api")
        await mux.poke()
        assert 0 < await eng.redis.ttl(mux.wake_key) <= WAKE_TTL_S


# ---------------------------------------------------------------- /readyz under `up --colocate`
async def test_readyz_counts_a_colocated_worker_for_every_stage(engine_factory) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        await eng.add_worker("all")
        assert await eng.store.live_workers() == {"thinker": 1, "talker": 1, "code2wav": 1}


# ---------------------------------------------------------------- issue 10
async def test_an_executor_oserror_is_a_stage_failure_not_a_redis_loss(engine_factory) -> None:
    spec = toy_spec()
    spec["stages"]["talker"]["executor"] = "workers_fixtures:ModelServerDownTalker"
    async with engine_factory(spec) as eng:
        doc = await run_to_end(eng.store, request("model server down once"), timeout_s=20)
        assert doc["state"] == "completed"
        assert doc["stages"]["talker"]["attempt"] == 2
        retries = [f["reason"] for f in await log_entries(eng.store, doc["id"]) if f.get("t") == "retry"]
        assert retries == ["failed: ConnectionRefusedError: [Errno 111] model server refused the connection"]


async def _xlen_is(redis: Redis, key: str, n: int) -> bool:
    return await redis.xlen(key) == n


async def _idle(redis: Redis, stream: str, names: set[str]) -> bool:
    """Every consumer in `names` is in the event group and has not read for at least 1 ms."""
    idle = {s(c["name"]): int(c["idle"]) for c in await redis.xinfo_consumers(stream, EVENT_GROUP)}
    return all(idle.get(name, 0) > 0 for name in names)


async def _consumers(url: str, stream: str) -> list[dict[str, Any]]:
    redis = redisio.connect(url)
    try:
        return list(await redis.xinfo_consumers(stream, EVENT_GROUP))
    finally:
        await redis.aclose()


def claim_keys(eng: Any, tasks: str, wf_id: str) -> list[str]:
    """KEYS of a `claim.lua` call of the entry stage (every key a script touches is declared)."""
    wf, keys = eng.store.keys.wf(wf_id), eng.store.keys
    return [tasks, keys.state_index("running", 0), wf, f"{wf}:log"]


def emit_keys(eng: Any, wf_id: str) -> list[str]:
    """KEYS of a thinker's `emit.lua` call, as its session declares them (`Session.emit_keys`)."""
    wf, keys = eng.store.keys.wf(wf_id), eng.store.keys
    return [wf, eng.store.tasks_key("thinker", 0), keys.events(0), f"{wf}:log", f"{wf}:out:thinker",
            f"{wf}:edge:thinker:talker"]
