"""Deadline-aware shedding: the pipeline setting (validated), and a request the stage queues predict
late degraded to text only (flagged) or refused at submit, against a real server and workers."""
from __future__ import annotations

import copy

import pytest

from omniflow.errors import DeadlineUnmeetable, PipelineError
from omniflow.models import Priority
from omniflow.pipeline import build_pipeline

from conftest import toy_spec
from helpers import eventually, request


def _spec(**shedding: object) -> dict:
    spec = toy_spec(talker={"chunk_delay_s": 0.1})         # 8 chunks: most of a second per talker session
    spec["stages"]["talker"]["max_sessions"] = 1
    spec["shedding"] = shedding
    return spec


def test_shedding_settings_are_validated() -> None:
    base = toy_spec()
    for shedding, message in (({"on_late": "drop"}, "shedding.on_late"),
                              ({"on_late": "degrade", "degrade_to": ["video"]}, "shedding.degrade_to"),
                              ({"on_late": "degrade", "degrade_to": ["text", "audio"]}, "every output of this pipeline"),
                              ({"on_late": "degrade", "degrade_to": []}, "shedding.degrade_to"),
                              ({"on_late": "refuse", "margin": 0}, "shedding.margin"),
                              ({"on_late": "refuse", "later": True}, "shedding.later")):
        with pytest.raises(PipelineError, match=message):
            build_pipeline({**copy.deepcopy(base), "shedding": shedding})
    # a pipeline that says what the default is keeps its content hash (workflows in flight finish on it)
    assert build_pipeline({**copy.deepcopy(base), "shedding": {"on_late": "off"}}).digest == build_pipeline(base).digest
    assert build_pipeline({**copy.deepcopy(base), "shedding": {"on_late": "refuse"}}).digest != build_pipeline(base).digest


async def _backlog(eng, n: int) -> list[str]:
    """A talker backlog: one warm-up session measured by the workers' last minute, then `n` more queued."""
    first = (await eng.store.submit(request("warm up"))).id
    assert (await eng.store.wait(first, timeout_s=30))["state"] == "completed"
    await eventually(lambda: _talker_measured(eng), timeout_s=10)
    return [(await eng.store.submit(request(f"queued {i}"))).id for i in range(n)]


async def _talker_measured(eng) -> bool:
    await eng.store.predictor.refresh(force=True)
    load = eng.store.predictor.loads.get("talker")
    return load is not None and load.session_s is not None


async def test_a_request_predicted_late_is_degraded_to_text_and_flagged(engine_factory) -> None:
    async with engine_factory(_spec(on_late="degrade", degrade_to=["text"])) as eng:
        queued = await _backlog(eng, 4)
        await eng.store.predictor.refresh(force=True)
        assert eng.store.predictor.predict_s(("thinker", "talker", "code2wav"), Priority.API) > 1.0
        late = await eng.store.submit(request("in a hurry", deadline_s=1.0))
        assert late.degraded and late.dropped == ["audio"]
        roomy = await eng.store.submit(request("no hurry", deadline_s=600))
        assert roomy.degraded is None
        doc = await eng.store.wait(late.id, timeout_s=30)
        assert doc["state"] == "completed" and doc["degraded"]["dropped"] == ["audio"]
        assert "over the deadline of 1s: runs without audio" in doc["degraded"]["reason"]
        assert set(doc["outputs"]) == {"thinker"} and doc["outputs"]["thinker"]["text"]
        assert (await eng.store.document(roomy.id))["degraded"] is None
        for wf_id in [*queued, roomy.id]:
            await eng.store.abort(wf_id)


async def test_a_request_predicted_late_is_refused_when_the_pipeline_says_so(engine_factory) -> None:
    async with engine_factory(_spec(on_late="refuse")) as eng:
        queued = await _backlog(eng, 4)
        await eng.store.predictor.refresh(force=True)
        before = await eng.redis.zcard(eng.store.keys.all_wf(0))
        with pytest.raises(DeadlineUnmeetable, match="over the deadline of 1s; retry later") as err:
            await eng.store.submit(request("in a hurry", deadline_s=1.0))
        assert err.value.retry_after_s >= 1
        assert await eng.redis.zcard(eng.store.keys.all_wf(0)) == before      # nothing was created
        ok = await eng.store.submit(request("no hurry", deadline_s=600))
        assert ok.degraded is None
        for wf_id in [*queued, ok.id]:
            await eng.store.abort(wf_id)
