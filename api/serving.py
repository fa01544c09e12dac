"""The serving figures of finished workflows, per pipeline and stage: time to first audio and
text, real-time factors, the audio stream's continuity (inter-chunk gaps, underruns), tokens,
tokens per second, compute seconds, workflow duration.

Observed by the API at scrape time, once per workflow that became terminal since the last scrape
(`omniflow.api.metrics.StageLatency.scan` reads them, as it reads the stage latencies), from
what Redis already holds: the record (`created_ms`, `finished_ms`, pipeline), the stage hash
(`<s>:compute_ms` written by the session's finish, `<s>:samples`/`<s>:sr`, `<s>:usage`) and the
workflow's log (the `text`/`audio` entries: their ids are when clients could read them). So none
of it costs the hot path a command. Labels: `pipeline` (the record's pipeline name) and `stage`.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from omniflow.ops.continuity import continuity
from omniflow.ops.fleet import AudioChunk, StageTimes
from omniflow.storage.schema import StageField
from omniflow.storage.usage import TOKEN_FIELDS

logger = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
#: RTF: below 1 a stage makes audio faster than it plays (vLLM-Omni's buckets)
RTF_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 5.0, 10.0)
GAP_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60)
#: per stream: 0 is a continuous stream; 0.05 / 0.1 / 0.2 give vLLM-Omni's c50 / c100 / c200 pass rates
UNDERRUN_BUCKETS_S = (0.0, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1, 2.5, 5, 10, 60)
TOKENS_PER_S_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
DURATION_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
LABELS = ["pipeline", "stage"]


def _ms(fields: dict[str, str], name: str) -> int:
    raw = fields.get(name) or ""
    return int(raw) if raw.isdigit() else 0


class ServingFigures:
    """The histograms and counters of finished workflows' serving figures (one set per API process)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...], labels: list[str] = LABELS) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: list[str] = LABELS) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.ttfa = hist("omniflow_time_to_first_audio_seconds",
                         "Workflow submitted -> its first audio chunk readable by clients, per audio stage",
                         LATENCY_BUCKETS_S)
        self.ttft = hist("omniflow_time_to_first_text_seconds",
                         "Workflow submitted -> its first text delta readable by clients, per text stage",
                         LATENCY_BUCKETS_S)
        self.rtf = hist("omniflow_stage_rtf", "Real-time factor of an audio stage: its compute seconds / the audio "
                        "seconds it produced (< 1: faster than playback)", RTF_BUCKETS)
        self.e2e_rtf = hist("omniflow_e2e_rtf", "End-to-end real-time factor of a completed workflow: submitted -> "
                            "completed / the audio seconds of the stage", RTF_BUCKETS)
        self.gap = hist("omniflow_audio_chunk_gap_seconds",
                        "Time between two consecutive audio chunks of a stream (log entry times)", GAP_BUCKETS_S)
        self.max_underrun = hist("omniflow_audio_max_underrun_seconds",
                                 "Per audio stream, its longest underrun: a chunk arriving after the audio already "
                                 "sent had finished playing (0: continuous)", UNDERRUN_BUCKETS_S)
        self.underruns = counter("omniflow_audio_underruns", "Audio chunks that arrived after the audio before "
                                 "them had finished playing (the client's queue ran dry)")
        self.underrun_s = counter("omniflow_audio_underrun_seconds", "Playback stalls of those underruns, summed")
        self.audio_s = counter("omniflow_audio_seconds", "Audio produced by finished workflows")
        self.chunks = counter("omniflow_audio_chunks", "Audio chunks produced by finished workflows")
        self.streams = counter("omniflow_audio_streams", "Audio streams (one per audio stage of a finished workflow)")
        self.tokens = counter("omniflow_stage_tokens", "Tokens a stage's usage reported (kind prompt or completion)",
                              [*LABELS, "kind"])
        self.tokens_per_s = hist("omniflow_stage_tokens_per_second", "Completion tokens per compute second of a "
                                 "stage session (Thinker tokens/s)", TOKENS_PER_S_BUCKETS)
        self.compute_s = counter("omniflow_stage_compute_seconds", "Compute seconds of finished stage sessions "
                                 "(session time less its waits for upstream chunks and downstream room)")
        self.duration = hist("omniflow_workflow_duration_seconds", "Workflow submitted -> terminal",
                             DURATION_BUCKETS_S, ["pipeline", "state"])

    def observe(self, state: str, times: StageTimes) -> None:
        """One workflow that reached terminal `state`."""
        rec, fields = times.record, times.fields
        pipeline = rec.get("pipeline") or "unknown"
        created, finished = _ms(rec, "created_ms"), _ms(rec, "finished_ms")
        if created and finished >= created:
            self.duration.labels(pipeline, state).observe((finished - created) / 1000)
        for stage, first in times.first_text_ms.items():
            if created and first >= created:
                self.ttft.labels(pipeline, stage).observe((first - created) / 1000)
        for stage in times.stages:
            if fields.get(stage) == "done":
                self._observe_done(pipeline, stage, fields)
        for stage, chunks in times.audio.items():
            self._observe_audio(pipeline, stage, state, created, finished, chunks)

    def _observe_done(self, pipeline: str, stage: str, fields: dict[str, str]) -> None:
        compute_s = _ms(fields, StageField.compute_ms(stage)) / 1000
        self.compute_s.labels(pipeline, stage).inc(compute_s)
        usage = self._usage(fields.get(StageField.usage(stage)), stage)
        for name in TOKEN_FIELDS:
            value = usage.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                self.tokens.labels(pipeline, stage, name.removesuffix("_tokens")).inc(value)
        completion = usage.get("completion_tokens")
        if compute_s > 0 and isinstance(completion, (int, float)) and not isinstance(completion, bool) \
                and completion > 0:
            self.tokens_per_s.labels(pipeline, stage).observe(completion / compute_s)
        rate = _ms(fields, StageField.sample_rate(stage))
        audio_s = _ms(fields, StageField.samples(stage)) / rate if rate else 0.0
        if audio_s > 0 and compute_s > 0:
            self.rtf.labels(pipeline, stage).observe(compute_s / audio_s)

    @staticmethod
    def _usage(raw: str | None, stage: str) -> dict[str, Any]:
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except ValueError:
            logger.warning("stage %s: a usage document that is not JSON skipped", stage)
            return {}
        return value if isinstance(value, dict) else {}

    def _observe_audio(self, pipeline: str, stage: str, state: str, created: int, finished: int,
                       chunks: list[AudioChunk]) -> None:
        # a restarted stage writes its chunks again from seq 1: only the first time a seq is seen counts
        stream: list[AudioChunk] = []
        last_seq = 0
        for chunk in chunks:
            if chunk.seq > last_seq:
                stream.append(chunk)
                last_seq = chunk.seq
        if not stream:
            return
        if created and stream[0].at_ms >= created:
            self.ttfa.labels(pipeline, stage).observe((stream[0].at_ms - created) / 1000)
        figures = continuity([(c.at_ms / 1000, c.samples / c.sample_rate) for c in stream])
        for gap in figures.gaps_s:
            self.gap.labels(pipeline, stage).observe(gap)
        self.max_underrun.labels(pipeline, stage).observe(figures.max_underrun_s)
        self.underruns.labels(pipeline, stage).inc(figures.underruns)
        self.underrun_s.labels(pipeline, stage).inc(figures.underrun_s)
        self.audio_s.labels(pipeline, stage).inc(figures.audio_s)
        self.chunks.labels(pipeline, stage).inc(figures.chunks)
        self.streams.labels(pipeline, stage).inc()
        if state == "completed" and created and finished >= created and figures.audio_s > 0:
            self.e2e_rtf.labels(pipeline, stage).observe((finished - created) / 1000 / figures.audio_s)
