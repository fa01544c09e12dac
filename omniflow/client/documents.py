"""The workflow document (DESIGN §5) built from what Redis holds: the record, the stage hash, the
final text outputs and the webhook's deliveries (read by `Store.document`)."""
from __future__ import annotations

from typing import Any

from omniflow.storage.schema import RecordField, StageField, StageRecord, WorkflowRecord, csv, texts_in_record
from omniflow.tracing import trace_id_of


def output_kinds(rec: dict[str, str]) -> dict[str, str]:
    """Final stage -> its output kind (`text` or `audio`), from the record's `kinds` field."""
    return dict(x.split("=", 1) for x in csv(rec.get(RecordField.KINDS)))


def text_stages(rec: dict[str, str]) -> list[str]:
    """The final stages whose text output is in an `out` key, read with the document: none where the
    record holds them (`ko`: `StageField.text`); every text final for a workflow of before."""
    if texts_in_record(rec):
        return []
    return [name for name, kind in output_kinds(rec).items() if kind == "text"]


def stage_entry(stage: StageRecord) -> dict[str, Any]:
    """One stage of the document."""
    return {
        "status": stage.status, "attempt": stage.attempt, "replica": stage.replica, "submitted": stage.attempt > 0,
        "submitted_at": stage.submitted_at, "started_at": stage.started_at, "finished_at": stage.finished_at,
        "usage": stage.usage, "error": stage.error,
    }


def workflow_document(wf_id: str, rec: dict[str, str], st: dict[str, str], texts: dict[str, str],
                      webhook: dict[str, Any] | None) -> dict[str, Any]:
    """The document of workflow `wf_id`: `rec` its record, `st` its stage hash (both decoded), `texts`
    the final text outputs read from `out` keys by stage (`text_stages`; the others are in `st`),
    `webhook` the webhook part (or None)."""
    record = WorkflowRecord.decode(wf_id, rec)
    decoded = {name: StageRecord.decode(name, st) for name in record.stages}
    stages = {name: stage_entry(stage) for name, stage in decoded.items()}
    outputs: dict[str, Any] = {}
    for name, kind in record.kinds.items():
        partial = stages.get(name, {}).get("status") != "done"
        if kind == "text":
            text = texts[name] if name in texts else st.get(StageField.text(name), "")
            outputs[name] = {"type": "text", "text": text, "partial": partial}
        else:
            stage = decoded.get(name) or StageRecord.decode(name, st)
            sr = stage.sample_rate
            outputs[name] = {
                "type": "audio", "sample_rate": sr or None,
                "duration_s": round(stage.samples / sr, 4) if sr else 0.0,
                "chunks": stage.seq, "partial": partial,
            }
    return {
        "id": record.id,
        "request_id": record.request_id or None,
        "state": rec.get(RecordField.STATE),
        "tenant": rec.get(RecordField.TENANT),
        "priority": rec.get(RecordField.PRIORITY) or "api",
        "degraded": ({"reason": rec[RecordField.DEGRADED], "dropped": csv(rec.get(RecordField.DROPPED))}
                     if rec.get(RecordField.DEGRADED) else None),
        "pipeline": rec.get(RecordField.PIPELINE),
        "pipeline_version": rec.get(RecordField.PIPELINE_HASH) or None,
        "final_stages": record.finals,
        "required_stages": record.stages,
        "created_at": record.created_ms / 1000,
        "finished_at": record.finished_ms / 1000 if record.finished_ms else None,
        "deadline_at": record.deadline_ms / 1000,
        "stages": stages,
        "outputs": outputs,
        "error": record.error or None,
        "error_stage": record.error_stage or None,
        "webhook": webhook,
        "trace_id": trace_id_of(rec.get("trace")),
    }
