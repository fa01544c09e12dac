"""Where a workflow's stage fields are: in its record (storage layout 2), and, for a workflow an
omniflow of before submitted, in `<wf>:stages` (docs/architecture.md, "Choices made where DESIGN is
silent"). Against a real Valkey, through the engine's own workers and reconciler."""
from __future__ import annotations

from typing import Any

from omniflow.storage.schema import RECORD_FIELD_NAMES, s

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
    pipe.hdel(keys.wf(wf_id), "sl", *moved)
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
