"""Where a workflow's stage fields are: in its record (storage layout 2), and, for a workflow an
omniflow of before submitted, in `<wf>:stages` (docs/architecture.md, "Choices made where DESIGN is
silent"). Against a real Valkey, through the engine's own workers and reconciler."""
from __future__ import annotations

from typing import Any

import pytest

from omniflow.engine.worker import ensure_group
from omniflow.errors import ScriptError
from omniflow.storage import redisio
from omniflow.storage.keys import TASK_GROUP
from omniflow.storage.schema import RECORD_FIELD_NAMES, now_ms, s
from omniflow.storage.transitions import emit, sessions

from conftest import toy_spec
from helpers import expected_text, request


def _stage_field(field: str, stages: list[str]) -> bool:
    return ":" in field or field in stages


async def _record(eng: Any, wf_id: str) -> dict[str, str]:
    return {s(k): s(v) for k, v in (await eng.redis.hgetall(eng.store.keys.wf(wf_id))).items()}


async def to_layout_before(eng: Any, wf_id: str) -> dict[str, str]:
    """Rewrite a workflow as an omniflow of before stored it: its stage fields out of the record,
    into `<wf>:stages`, and no `sl`. Its stage fields."""
    keys = eng.store.keys
    rec = await _record(eng, wf_id)
    stages = rec["stages"].split(",")
    moved = {k: v for k, v in rec.items() if _stage_field(k, stages)}
    pipe = eng.redis.pipeline(transaction=True)
    pipe.hset(keys.stages_legacy(wf_id), mapping=moved)
    pipe.hdel(keys.wf(wf_id), "sl", "ko", *moved)       # (`ko`: layout 3, text outputs in the record)
    await pipe.execute()
    return moved


async def test_the_record_holds_the_stage_fields_and_every_other_field_is_reserved(engine_factory) -> None:
    """One hash per workflow: `sl` says so, `<wf>:stages` is never written. Every field a run writes
    to a record that is not a stage field is one a stage may not be named (RECORD_FIELD_NAMES): a
    new record field that is not listed there fails here."""
    spec = toy_spec(talker={"fail_at_step": 2, "fail_attempts": 1})       # a retry: more fields written
    async with engine_factory(spec, webhook_allow_private=True) as eng:
        done = await eng.store.wait((await eng.store.submit(request(request_id="r1"))).id, timeout_s=20)
        assert done["state"] == "completed", done
        aborted = (await eng.store.submit(request(webhook_url="http://127.0.0.1:9/hook"))).id
        await eng.store.abort(aborted, reason="test")
        for wf_id in (done["id"], aborted):
            rec = await _record(eng, wf_id)
            assert rec["sl"] == "1"
            stages = rec["stages"].split(",")
            assert rec["thinker:attempt"] == "1" and rec["talker"] in ("done", "aborted")
            assert not await eng.redis.exists(eng.store.keys.stages_legacy(wf_id))
            others = {k for k in rec if not _stage_field(k, stages)}
            assert others <= RECORD_FIELD_NAMES, others - RECORD_FIELD_NAMES
        assert done["stages"]["talker"]["attempt"] == 2 and done["stages"]["talker"]["status"] == "done"


async def test_a_workflow_of_the_layout_before_runs_to_its_end(engine_factory) -> None:
    """A workflow whose stage fields are in `<wf>:stages` (submitted before the fold) is claimed,
    emitted, retried by the reconciler and completed where its fields are, and its document shows
    them; nothing is written to its record's stage fields."""
    spec = toy_spec(talker={"fail_at_step": 2, "fail_attempts": 1})
    async with engine_factory(spec, workers=False) as eng:
        sub = await eng.store.submit(request("why is the sky blue"))
        await to_layout_before(eng, sub.id)
        for stage in eng.pipeline.order:
            await eng.add_worker(stage)
        doc = await eng.store.wait(sub.id, timeout_s=20)
        assert doc["state"] == "completed", doc
        assert doc["outputs"]["thinker"]["text"] == expected_text("why is the sky blue")
        assert {name: st["status"] for name, st in doc["stages"].items()} == dict.fromkeys(eng.pipeline.order, "done")
        assert doc["stages"]["talker"]["attempt"] == 2          # retried by the reconciler (stage_event.lua)
        legacy = {s(k): s(v) for k, v in (await eng.redis.hgetall(eng.store.keys.stages_legacy(sub.id))).items()}
        assert legacy["talker"] == "done" and legacy["talker:attempt"] == "2" and int(legacy["code2wav:seq"]) > 0
        rec = await _record(eng, sub.id)
        assert "sl" not in rec and not any(_stage_field(k, eng.pipeline.order) for k in rec), rec
        assert await eng.redis.ttl(eng.store.keys.stages_legacy(sub.id)) > 0      # expires with the record


async def test_a_workflow_of_the_layout_before_is_aborted_where_its_fields_are(engine_factory) -> None:
    async with engine_factory(workers=False) as eng:
        sub = await eng.store.submit(request())
        await to_layout_before(eng, sub.id)
        await eng.store.abort(sub.id, reason="operator")
        doc = await eng.store.document(sub.id)
        assert doc["state"] == "aborted"
        assert {st["status"] for st in doc["stages"].values()} == {"aborted"}
        legacy = await eng.redis.hgetall(eng.store.keys.stages_legacy(sub.id))
        assert s(legacy[b"thinker"]) == "aborted"
        assert "thinker" not in await _record(eng, sub.id)


async def test_a_worker_declares_the_stages_hash_only_for_a_workflow_claimed_as_one_of_before(engine_factory) -> None:
    """A worker's claim and emit do not declare `<wf>:stages` (bytes on every call, for workflows a
    worker of this layout never meets: their queues are another version's). A claim that meets one
    anyway answers 'layout' and writes nothing; claimed again declaring the key, it is 'ok', and an
    emit of such a session that did not declare it is refused with a message, nothing written."""
    async with engine_factory(workers=False, reconciler=False) as eng:
        keys, store = eng.store.keys, eng.store
        sub = await store.submit(request())
        await to_layout_before(eng, sub.id)
        await ensure_group(eng.redis, store.tasks_key("thinker", 0), TASK_GROUP)
        entry_id = s((await eng.redis.xreadgroup(TASK_GROUP, "w1", {store.tasks_key("thinker", 0): ">"},
                                                 count=1))[0][1][0][0])
        before_rec, before_stages = await _record(eng, sub.id), await eng.redis.hgetall(keys.stages_legacy(sub.id))
        queue = eng.pipeline.queue("thinker")

        async def claim(legacy: tuple[str, ...]) -> list:
            call = sessions.claim(keys, "thinker", (), 0, [(entry_id, sub.id, 1)], worker_id="w1", now_ms=now_ms(),
                                  queue=queue, legacy=legacy)
            assert (keys.stages_legacy(sub.id) in call[3:3 + call[2]]) == bool(legacy)
            return await redisio.call(store.client, *call)

        assert [s(x) for x in (await claim(()))[0]] == ["layout"]
        assert await _record(eng, sub.id) == before_rec
        assert await eng.redis.hgetall(keys.stages_legacy(sub.id)) == before_stages
        assert (await eng.redis.xpending(store.tasks_key("thinker", 0), TASK_GROUP))["pending"] == 1   # not acked
        assert s((await claim((sub.id,)))[0][0]) == "ok"
        assert s((await eng.redis.hget(keys.stages_legacy(sub.id), "thinker"))) == "running"

        steps = [[1, "T", "hi", ""]]
        plain = emit.emit_keys(keys, sub.id, "thinker", ("talker",), queue=queue)
        with pytest.raises(ScriptError, match=r"storage layout before .*:stages\), which this call did not declare"):
            await redisio.call(store.client, *emit.emit(plain, sub.id, "thinker", 1, status="", now_ms=now_ms(),
                                                        steps=steps))
        assert s(await eng.redis.hget(keys.stages_legacy(sub.id), "thinker:seq")) == "0"
        declared = emit.emit_keys(keys, sub.id, "thinker", ("talker",), queue=queue, legacy=True)
        assert s(await redisio.call(store.client, *emit.emit(declared, sub.id, "thinker", 1, status="",
                                                             now_ms=now_ms(), steps=steps))) == "ok"
        assert s(await eng.redis.hget(keys.stages_legacy(sub.id), "thinker:seq")) == "1"
        assert "thinker:seq" not in await _record(eng, sub.id)
