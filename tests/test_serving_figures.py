"""The serving figures as pure functions: audio continuity (vLLM-Omni's underrun definition), what one
finished workflow adds to the histograms, and worker counters folded into monotonic ones."""
from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from helpers import metric_values

from omniflow.api.serving import ServingFigures
from omniflow.api.worker_metrics import WorkerCounters
from omniflow.ops.continuity import continuity
from omniflow.ops.fleet import AudioChunk, StageTimes, WorkerReport


def test_continuity_counts_a_chunk_arriving_after_the_queue_ran_dry_as_an_underrun() -> None:
    # 0.1 s chunks: the 3rd arrives 0.1 s after the first two finished playing, the 5th 0.1 s late again
    c = continuity([(0.0, 0.1), (0.05, 0.1), (0.30, 0.1), (0.31, 0.1), (0.6, 0.2)])
    assert (c.chunks, c.underruns) == (5, 2)
    assert c.underrun_s == pytest.approx(0.2) and c.max_underrun_s == pytest.approx(0.1)
    assert c.gaps_s == pytest.approx([0.05, 0.25, 0.01, 0.29]) and c.audio_s == pytest.approx(0.6)
    # a gap shorter than the audio still queued is no underrun, however long it is
    assert continuity([(0.0, 2.0), (1.5, 0.5), (2.4, 0.5)]).underruns == 0
    assert continuity([]).chunks == 0 and continuity([(1.0, 0.1)]).max_underrun_s == 0.0
    assert continuity([(0.0, -1.0), (0.5, 0.1)]).underruns == 1          # a negative duration counts as none


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_one_finished_workflow_feeds_every_serving_figure(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    figures = ServingFigures(registry)
    half = 11025          # 0.5 s at 22.05 kHz
    times = StageTimes(
        stages=["thinker", "talker", "code2wav"],
        fields={"thinker": "done", "thinker:compute_ms": "500",
                "thinker:usage": '{"prompt_tokens": 3, "completion_tokens": 10}',
                "talker": "done", "talker:compute_ms": "100", "talker:usage": "not json",
                "code2wav": "done", "code2wav:compute_ms": "200", "code2wav:samples": str(2 * half),
                "code2wav:sr": "22050"},
        first_output_ms={"thinker": 1200, "code2wav": 1500},
        record={"pipeline": "omni", "created_ms": "1000", "finished_ms": "3000"},
        first_text_ms={"thinker": 1200},
        audio={"code2wav": [AudioChunk(1500, 1, half, 22050), AudioChunk(2400, 2, half, 22050),
                            AudioChunk(2500, 1, half, 22050)]})       # a restarted stage's replay: not counted
    with caplog.at_level(logging.WARNING):
        figures.observe("completed", times)
    assert "not JSON" in caplog.text                                     # the talker's usage: skipped, said
    p, c2w, th = {"pipeline": "omni"}, {"pipeline": "omni", "stage": "code2wav"}, {"pipeline": "omni", "stage": "thinker"}
    assert _value(registry, "omniflow_time_to_first_audio_seconds_sum", **c2w) == pytest.approx(0.5)
    assert _value(registry, "omniflow_time_to_first_text_seconds_sum", **th) == pytest.approx(0.2)
    assert _value(registry, "omniflow_stage_rtf_sum", **c2w) == pytest.approx(0.2)
    assert _value(registry, "omniflow_stage_rtf_count", **th) is None             # no audio: no RTF
    assert _value(registry, "omniflow_e2e_rtf_sum", **c2w) == pytest.approx(2.0)
    assert _value(registry, "omniflow_audio_chunk_gap_seconds_sum", **c2w) == pytest.approx(0.9)
    assert _value(registry, "omniflow_audio_underruns_total", **c2w) == 1
    assert _value(registry, "omniflow_audio_underrun_seconds_total", **c2w) == pytest.approx(0.4)
    assert _value(registry, "omniflow_audio_max_underrun_seconds_bucket", **c2w, le="0.2") == 0
    assert _value(registry, "omniflow_audio_max_underrun_seconds_bucket", **c2w, le="0.5") == 1
    assert _value(registry, "omniflow_audio_seconds_total", **c2w) == pytest.approx(1.0)
    assert _value(registry, "omniflow_audio_chunks_total", **c2w) == 2
    assert _value(registry, "omniflow_stage_tokens_total", **th, kind="completion") == 10
    assert _value(registry, "omniflow_stage_tokens_total", **th, kind="prompt") == 3
    assert _value(registry, "omniflow_stage_tokens_per_second_sum", **th) == pytest.approx(20.0)
    assert _value(registry, "omniflow_stage_compute_seconds_total", **th) == pytest.approx(0.5)
    assert _value(registry, "omniflow_workflow_duration_seconds_sum", **p, state="completed") == pytest.approx(2.0)
    # a failed workflow: no end-to-end RTF (it did not complete), the rest as it happened
    figures.observe("failed", StageTimes(stages=["code2wav"], fields={"code2wav": "failed"}, first_output_ms={},
                                         record={"pipeline": "omni", "created_ms": "1000", "finished_ms": "1100"},
                                         audio={"code2wav": [AudioChunk(1050, 1, half, 22050)]}))
    assert _value(registry, "omniflow_e2e_rtf_count", **c2w) == 1
    assert _value(registry, "omniflow_audio_streams_total", **c2w) == 2


def _report(worker_id: str, *, waits: float, steps: int, inline: list[int], label: str = "thinker") -> WorkerReport:
    hist = [0] * 10
    hist[1] = steps
    return WorkerReport(id=worker_id, label=label, stats={"backpressure_waits": waits},
                        serving={"thinker": {"batch": {"steps": steps, "sessions": 2 * steps, "hist": hist},
                                             "dataplane": {"inline": inline}}})


def test_worker_counters_only_grow_when_workers_stop_and_restart(caplog: pytest.LogCaptureFixture) -> None:
    counters = WorkerCounters()
    counters.fold([_report("w1", waits=3, steps=10, inline=[10, 1000]), _report("w2", waits=1, steps=5, inline=[5, 500])])
    counters.fold([_report("w1", waits=4, steps=12, inline=[12, 1200])])         # w2 stopped: its counts stay
    assert counters.totals[("stat", "backpressure_waits", "thinker")] == 5
    assert counters.totals[("dataplane", "thinker", "inline", "bytes")] == 1700
    counters.fold([_report("w1", waits=1, steps=2, inline=[2, 200])])            # w1 restarted under its id
    assert counters.totals[("batch", "thinker", "steps")] == 19
    registry = CollectorRegistry()
    registry.register(type("C", (), {"collect": lambda self: counters.families(["thinker", "talker"])})())
    values = metric_values(generate_latest(registry).decode())
    assert values[("omniflow_batch_size_count", (("stage", "thinker"),))] == 19
    assert values[("omniflow_batch_size_sum", (("stage", "thinker"),))] == 38
    assert values[("omniflow_batch_size_bucket", (("le", "1"), ("stage", "thinker")))] == 0
    assert values[("omniflow_batch_size_bucket", (("le", "2"), ("stage", "thinker")))] == 19
    assert values[("omniflow_dataplane_chunks_total", (("stage", "thinker"), ("transport", "inline")))] == 19
    assert values[("omniflow_dataplane_bytes_total", (("stage", "talker"), ("transport", "shm")))] == 0
    # malformed heartbeat entries: skipped, said once per worker and field, the rest still counted
    bad = WorkerReport(id="w9", label="thinker", stats={"backpressure_waits": "many"},
                       serving={"thinker": {"batch": {"steps": 1, "sessions": 1, "hist": [1]},
                                            "dataplane": {"carrier-pigeon": [1, 1], "inline": [1, 10]}},
                                "talker": "?"})
    with caplog.at_level(logging.WARNING):
        counters.fold([bad])
        counters.fold([bad])
    assert caplog.text.count("malformed") == 4
    assert counters.totals[("dataplane", "thinker", "inline", "chunks")] == 20
