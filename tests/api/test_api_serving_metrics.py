"""The serving metrics on /metrics over real HTTP, against what Redis says about the same workflows:
time to first audio, RTF, audio continuity, tokens, batch sizes, data-plane traffic; observed once;
a malformed heartbeat skipped, never a 500."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from apiserver import api_factory  # noqa: F401 - fixture
from conftest import toy_spec
from helpers import eventually, metric_values

from omniflow.ops.continuity import continuity
from omniflow.storage.schema import now_ms, s
from omniflow.storage.schema import log_events_raw

N, WORDS = 4, 6
SPEC = toy_spec(code2wav={"chunk_delay_s": 0.15})     # 80 ms chunks 150 ms apart: underruns
SPEC["stages"]["thinker"]["executor"] = "workers_fixtures:MeteredLM"
SPEC["stages"]["thinker"]["params"].update({"max_batch": 4, "step_s": 0.01, "max_words": WORDS})


async def _expected(eng: Any, wf_ids: list[str]) -> dict[str, float]:
    """What Redis holds about the workflows, computed here the long way."""
    out = {"ttfa": 0.0, "rtf": 0.0, "underruns": 0.0, "underrun_s": 0.0, "gaps": 0.0, "thinker_compute": 0.0}
    for wf_id in wf_ids:
        rec = {s(k): s(v) for k, v in (await eng.redis.hgetall(eng.store.keys.wf(wf_id))).items()}
        st = {s(k): s(v) for k, v in (await eng.redis.hgetall(eng.store.keys.stages(wf_id))).items()}
        audio = [(int(s(eid).split("-")[0]), int(f[b"samples"]), int(f[b"sr"]))
                 for eid, entry in await eng.redis.xrange(eng.store.keys.log(wf_id))
                 for f in log_events_raw(entry) if f.get(b"t") == b"audio"]
        assert len(audio) == WORDS
        out["ttfa"] += (audio[0][0] - int(rec["created_ms"])) / 1000
        figures = continuity([(at / 1000, n / sr) for at, n, sr in audio])
        out["underruns"] += figures.underruns
        out["underrun_s"] += figures.underrun_s
        out["gaps"] += len(figures.gaps_s)
        out["rtf"] += int(st["code2wav:compute_ms"]) / 1000 / figures.audio_s
        out["thinker_compute"] += int(st["thinker:compute_ms"]) / 1000
    return out


async def test_serving_metrics_match_what_redis_says(api_factory, caplog: pytest.LogCaptureFixture) -> None:
    async with api_factory(SPEC) as (eng, server), server.client() as http:
        name = eng.pipeline.name
        posts = [http.post("/v1/workflows", json={"input": {"text": f"metered prompt {i}"}}) for i in range(N)]
        wf_ids = [r.json()["id"] for r in await asyncio.gather(*posts)]
        for wf_id in wf_ids:
            assert (await http.get(f"/v1/workflows/{wf_id}", params={"wait": 20})).json()["state"] == "completed"

        async def scraped() -> dict[Any, float] | None:
            values = metric_values((await http.get("/metrics")).text)
            # the workers' counters arrive with their next heartbeats
            sent = values.get(("omniflow_dataplane_chunks_total", (("stage", "talker"), ("transport", "inline"))), 0)
            return values if sent == N * WORDS else None

        v = await eventually(scraped, timeout_s=15, interval_s=0.2, what="the talkers' chunks counted")
        c2w, th = (("pipeline", name), ("stage", "code2wav")), (("pipeline", name), ("stage", "thinker"))
        want = await _expected(eng, wf_ids)
        assert v[("omniflow_time_to_first_audio_seconds_count", c2w)] == N
        assert v[("omniflow_time_to_first_audio_seconds_sum", c2w)] == pytest.approx(want["ttfa"])
        assert v[("omniflow_time_to_first_text_seconds_count", th)] == N
        assert v[("omniflow_stage_rtf_count", c2w)] == N
        assert v[("omniflow_stage_rtf_sum", c2w)] == pytest.approx(want["rtf"])
        assert v[("omniflow_e2e_rtf_count", c2w)] == N
        assert v[("omniflow_audio_chunk_gap_seconds_count", c2w)] == want["gaps"] == N * (WORDS - 1)
        assert v[("omniflow_audio_underruns_total", c2w)] == want["underruns"]
        assert v[("omniflow_audio_underrun_seconds_total", c2w)] == pytest.approx(want["underrun_s"])
        assert v[("omniflow_audio_max_underrun_seconds_count", c2w)] == N
        assert v[("omniflow_audio_seconds_total", c2w)] == pytest.approx(N * WORDS * int(22050 * 0.08) / 22050)
        assert v[("omniflow_audio_streams_total", c2w)] == N
        assert v[("omniflow_stage_tokens_total", (("kind", "completion"), *th))] == N * WORDS
        assert v[("omniflow_stage_tokens_total", (("kind", "prompt"), *th))] == N * 3
        assert v[("omniflow_stage_tokens_per_second_count", th)] == N
        assert v[("omniflow_stage_compute_seconds_total", th)] == pytest.approx(want["thinker_compute"])
        assert v[("omniflow_workflow_duration_seconds_count", (("pipeline", name), ("state", "completed")))] == N
        assert v[("omniflow_stage_queue_wait_seconds_count", c2w)] == N
        # the step loop: every session-step counted once, whatever the batches were (a session retried on
        # a loaded machine, its lease lapsed, steps again: then at least that many)
        attempts = [(await eng.store.document(wf_id))["stages"]["thinker"]["attempt"] for wf_id in wf_ids]
        stepped = v[("omniflow_batch_size_sum", (("stage", "thinker"),))]
        assert stepped == N * WORDS if max(attempts) == 1 else stepped >= N * WORDS, (stepped, attempts)
        assert WORDS <= v[("omniflow_batch_size_count", (("stage", "thinker"),))] <= N * WORDS
        for stage in ("thinker", "talker"):
            assert v[("omniflow_dataplane_chunks_total", (("stage", stage), ("transport", "inline")))] == N * WORDS
            assert v[("omniflow_dataplane_bytes_total", (("stage", stage), ("transport", "inline")))] > 0
            assert v[("omniflow_dataplane_chunks_total", (("stage", stage), ("transport", "redis")))] == 0
        assert v[("omniflow_stage_capacity", (("stage", "thinker"),))] > 0
        assert v[("omniflow_workflows_past_deadline", ())] == 0
        assert v[("omniflow_oldest_workflow_age_seconds", (("state", "running"),))] == 0

        # a malformed heartbeat (a worker entry nobody overwrites): skipped with a line, never a 500
        keys = eng.store.keys
        await eng.redis.zadd(keys.workers, {"thinker-bogus-1": now_ms() + 60_000})
        await eng.redis.hset(keys.worker_info("thinker-bogus-1"), mapping={
            "stage": "thinker", "stats": "{not json", "window": "[]",
            "serving": json.dumps({"thinker": {"batch": {"steps": "x"}, "dataplane": {"inline": [1]}}})})
        try:
            with caplog.at_level(logging.WARNING):
                r = await http.get("/metrics")
            assert r.status_code == 200
            again = metric_values(r.text)
            assert "thinker-bogus-1" in caplog.text and "malformed" in caplog.text
            # ... and nothing is observed twice
            assert again[("omniflow_time_to_first_audio_seconds_count", c2w)] == N
            assert again[("omniflow_batch_size_sum", (("stage", "thinker"),))] == N * WORDS
            assert again[("omniflow_workers", (("stage", "thinker"), ("state", "ready")))] == 2
        finally:
            await eng.redis.zrem(keys.workers, "thinker-bogus-1")
            await eng.redis.delete(keys.worker_info("thinker-bogus-1"))
