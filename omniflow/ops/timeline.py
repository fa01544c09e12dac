"""A workflow's event log as a timeline: rows for `omniflow inspect`, Gantt lanes for
`omniflow inspect --json` and the dashboard (`GET /v1/workflows/{id}/timeline`)."""
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
    # one line each (a long title wraps at the table's width, cutting an id in two)
    lines = [f"workflow {doc['id']} — {doc['state']}"]
    if doc.get("pipeline"):
        lines.append(f"pipeline {doc['pipeline']}@{doc.get('pipeline_version') or '?'}")
    if doc.get("trace_id"):
        lines.append(f"trace {doc['trace_id']}")
    table = Table(title="\n".join(lines), show_lines=False)
    for col, justify in (("t (ms)", "right"), ("event", "left"), ("stage", "left"), ("detail", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        when = f"{row['t_ms']}" if row["count"] == 1 else f"{row['t_ms']}–{row['until_ms']}"
        event = row["event"] if row["count"] == 1 else f"{row['event']} ×{row['count']}"
        table.add_row(when, event, row["stage"], row["detail"])
    return table


def gantt(entries: list[tuple[str, dict[str, str]]], doc: dict[str, Any]) -> dict[str, Any]:
    """A workflow's timeline as Gantt lanes, one per stage (ms since creation):

    each lane has its `attempts` (`start`, `running` when input arrived, `end`, `replica`,
    `outcome`: done | failed | retried | aborted | running), its output `ticks` (one per
    text/audio log entry, i.e. per worker write: `t`, steps `first`..`seq`, `kind`) and its
    `retries` (`t`, `attempt`, `reason`);
    `events` holds the workflow's own transitions (`state`, `terminal`, `restart`).
    """
    created_ms = int(doc["created_at"] * 1000)
    order = list(doc.get("required_stages") or doc.get("stages") or [])
    lanes: dict[str, dict[str, Any]] = {name: {"stage": name, "attempts": [], "ticks": [], "retries": []}
                                        for name in order}
    open_attempts: dict[str, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    end_ms = 0

    def lane(name: str) -> dict[str, Any]:
        return lanes.setdefault(name, {"stage": name, "attempts": [], "ticks": [], "retries": []})

    def close(name: str, t_ms: int, outcome: str) -> None:
        attempt = open_attempts.pop(name, None)
        if attempt is not None:
            attempt.update(end=t_ms, outcome=outcome)

    for eid, fields in entries:
        t_ms = int(eid.split("-")[0]) - created_ms
        end_ms = max(end_ms, t_ms)
        kind, stage = fields.get("t", ""), fields.get("stage", "")
        if kind == "stage" and stage:
            status = fields.get("status", "")
            attempt_no = int(fields.get("attempt") or 0)
            current = open_attempts.get(stage)
            if status in ("running", "waiting_input"):
                if current is None or current["attempt"] != attempt_no:
                    close(stage, t_ms, "retried")
                    current = {"attempt": attempt_no, "replica": fields.get("replica") or None, "start": t_ms,
                               "running": t_ms if status == "running" else None, "end": None, "outcome": "running"}
                    open_attempts[stage] = current
                    lane(stage)["attempts"].append(current)
                elif status == "running" and current["running"] is None:
                    current["running"] = t_ms
            elif status in ("done", "failed"):
                if current is not None and current["running"] is None:
                    current["running"] = current["start"]
                close(stage, t_ms, status)
        elif kind in ("text", "audio") and stage:
            seq = int(fields.get("seq") or 0)
            lane(stage)["ticks"].append({"t": t_ms, "first": int(fields.get("from") or seq), "seq": seq, "kind": kind})
            current = open_attempts.get(stage)
            if current is not None and current["running"] is None:
                current["running"] = t_ms
        elif kind == "retry" and stage:
            close(stage, t_ms, "retried")
            lane(stage)["retries"].append({"t": t_ms, "attempt": int(fields.get("attempt") or 0),
                                           "reason": fields.get("reason", "")})
        elif kind in ("state", "terminal", "restart"):
            events.append({"t": t_ms, "event": kind, "state": fields.get("state"), "stage": stage or None,
                           "error": fields.get("error") or None})
            if kind == "terminal":
                for name in list(open_attempts):
                    close(name, t_ms, "aborted" if fields.get("state") != "completed" else "done")
    return {"id": doc["id"], "state": doc["state"], "created_at": doc["created_at"],
            "duration_ms": end_ms, "lanes": list(lanes.values()), "events": events}


def attempts_table(lanes: dict[str, Any]) -> Table:
    """Every attempt of every stage: replica, when (ms after creation), how it ended."""
    table = Table(title="attempts")
    for col in ("stage", "attempt", "replica", "claimed", "running", "ended", "outcome", "outputs"):
        table.add_column(col)
    for lane in lanes["lanes"]:
        for a in lane["attempts"]:
            ticks = [x for x in lane["ticks"] if a["start"] <= x["t"] <= (a["end"] if a["end"] is not None else 1 << 62)]
            table.add_row(lane["stage"], str(a["attempt"]), a["replica"] or "-", f"{a['start']} ms",
                          "-" if a["running"] is None else f"{a['running']} ms",
                          "-" if a["end"] is None else f"{a['end']} ms", a["outcome"], str(len(ticks)))
        if not lane["attempts"]:
            table.add_row(lane["stage"], "-", "-", "-", "-", "-", "not started", "0")
    return table


def webhook_table(hook: dict[str, Any]) -> Table:
    """A workflow's webhook: its URL and outcome in the title, one row per delivery attempt."""
    title = f"webhook {hook['url']} — {hook['outcome']}"
    if hook.get("next_attempt_at"):
        title += " (another attempt scheduled)"
    table = Table(title=title)
    for col in ("attempt", "outcome", "HTTP", "error"):
        table.add_column(col)
    for a in hook["attempts"]:
        table.add_row(str(a["attempt"]), a["outcome"], str(a["status"] or "-"), a.get("error") or "")
    return table
