"""The workflow document (DESIGN §5) built from what Redis holds: the record, the stage hash, the
final text outputs and the webhook's deliveries (read by `Store.document`)."""
from __future__ import annotations

import json
from typing import Any

from omniflow.storage.schema import csv


def output_kinds(rec: dict[str, str]) -> dict[str, str]:
    """Final stage -> its output kind (`text` or `audio`), from the record's `kinds` field."""
    return dict(x.split("=", 1) for x in csv(rec.get("kinds")))


def text_stages(rec: dict[str, str]) -> list[str]:
    """The final stages whose output is text (their `out` keys are read with the document)."""
    return [name for name, kind in output_kinds(rec).items() if kind == "text"]


def workflow_document(wf_id: str, rec: dict[str, str], st: dict[str, str], texts: dict[str, str],
                      webhook: dict[str, Any] | None) -> dict[str, Any]:
    """The document of workflow `wf_id`: `rec` its record, `st` its stage hash (both decoded), `texts`
    the final text outputs by stage, `webhook` the webhook part (or None)."""
    kinds = output_kinds(rec)
    stages: dict[str, Any] = {}
    for name in csv(rec.get("stages")):
        attempt = int(st.get(f"{name}:attempt") or 0)
        entry: dict[str, Any] = {
            "status": st.get(name, "pending"),
            "attempt": attempt,
            "replica": st.get(f"{name}:replica") or None,
            "submitted": attempt > 0,
        }
        for field, label in (("t_submit", "submitted_at"), ("t_start", "started_at"), ("t_end", "finished_at")):
            entry[label] = int(st[f"{name}:{field}"]) / 1000 if st.get(f"{name}:{field}") else None
        entry["usage"] = json.loads(st[f"{name}:usage"]) if st.get(f"{name}:usage") else None
        entry["error"] = st.get(f"{name}:error") or None
        stages[name] = entry
    outputs: dict[str, Any] = {}
    for name, kind in kinds.items():
        partial = stages.get(name, {}).get("status") != "done"
        if kind == "text":
            outputs[name] = {"type": "text", "text": texts.get(name, ""), "partial": partial}
        else:
            sr = int(st.get(f"{name}:sr") or 0)
            samples = int(st.get(f"{name}:samples") or 0)
            outputs[name] = {
                "type": "audio", "sample_rate": sr or None,
                "duration_s": round(samples / sr, 4) if sr else 0.0,
                "chunks": int(st.get(f"{name}:seq") or 0), "partial": partial,
            }
    return {
        "id": rec.get("id", wf_id),
        "request_id": rec.get("request_id") or None,
        "state": rec.get("state"),
        "tenant": rec.get("tenant"),
        "priority": rec.get("prio") or "api",
        "degraded": {"reason": rec["degraded"], "dropped": csv(rec.get("dropped"))} if rec.get("degraded") else None,
        "pipeline": rec.get("pipeline"),
        "final_stages": csv(rec.get("finals")),
        "required_stages": csv(rec.get("stages")),
        "created_at": int(rec.get("created_ms") or 0) / 1000,
        "finished_at": int(rec["finished_ms"]) / 1000 if rec.get("finished_ms") else None,
        "deadline_at": int(rec.get("deadline_ms") or 0) / 1000,
        "stages": stages,
        "outputs": outputs,
        "error": rec.get("error") or None,
        "error_stage": rec.get("error_stage") or None,
        "webhook": webhook,
    }
