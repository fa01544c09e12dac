"""Render a workflow's event log as a timeline (used by `omniflow inspect`)."""
from __future__ import annotations

from typing import Any

from rich.table import Table


def timeline_rows(entries: list[tuple[str, dict[str, str]]], created_ms: int) -> list[dict[str, Any]]:
    """Collapse runs of text/audio deltas of one stage into one row; keep every transition."""
    rows: list[dict[str, Any]] = []
    deltas: dict[tuple[str, str], dict[str, Any]] = {}
    for eid, fields in entries:
        t_ms = int(eid.split("-")[0]) - created_ms
        kind = fields.get("t", "?")
        stage = fields.get("stage", "")
        if kind in ("text", "audio"):
            row = deltas.get((kind, stage))
            if row is None:
                row = {"t_ms": t_ms, "until_ms": t_ms, "event": kind, "stage": stage, "count": 0,
                       "first_seq": fields.get("seq"), "detail": ""}
                deltas[(kind, stage)] = row
                rows.append(row)
            row["count"] += 1
            row["until_ms"] = t_ms
            row["detail"] = f"seq {row['first_seq']}..{fields.get('seq')}" if row["count"] > 1 else f"seq {row['first_seq']}"
            continue
        if kind == "state":
            detail = fields.get("state", "")
        elif kind == "stage":
            detail = f"{fields.get('status')} (attempt {fields.get('attempt')})"
            if fields.get("replica"):
                detail += f" on {fields['replica']}"
        elif kind == "retry":
            detail = f"attempt {fields.get('attempt')}: {fields.get('reason', '')}"
        elif kind == "terminal":
            detail = fields.get("state", "")
            if fields.get("error"):
                detail += f": {fields['error']}"
        else:
            detail = ", ".join(f"{k}={v}" for k, v in fields.items() if k != "t")
        rows.append({"t_ms": t_ms, "until_ms": t_ms, "event": kind, "stage": stage, "count": 1, "detail": detail})
    return rows


def timeline_table(doc: dict[str, Any], rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"workflow {doc['id']} — {doc['state']}", show_lines=False)
    for col, justify in (("t (ms)", "right"), ("event", "left"), ("stage", "left"), ("detail", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        when = f"{row['t_ms']}" if row["count"] == 1 else f"{row['t_ms']}–{row['until_ms']}"
        event = row["event"] if row["count"] == 1 else f"{row['event']} ×{row['count']}"
        table.add_row(when, event, row["stage"], row["detail"])
    return table
