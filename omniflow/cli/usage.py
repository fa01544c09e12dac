"""`omniflow usage`: compute seconds, audio seconds and tokens per tenant, pipeline and stage over a
window (thin parsing over `omniflow.ops.usage`)."""
from __future__ import annotations

from typing import Any

import typer
from rich.table import Table

from omniflow.cli.common import JsonOpt, _print_json, _run, _settings, _with_client, console, handle_errors


def usage_table(doc: dict[str, Any]) -> Table:
    import datetime as dt

    since = dt.datetime.fromtimestamp(doc["since"], dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    table = Table(title=f"usage since {since}", caption="compute: session time less its waits for input and for "
                                                      "room downstream; sessions: finished stage sessions")
    for col in ("tenant", "pipeline", "stage", "sessions", "compute s", "failed s", "audio s", "prompt tok",
                "completion tok"):
        table.add_column(col, justify="left" if col in ("tenant", "pipeline", "stage") else "right")
    for row in doc["rows"]:
        table.add_row(row["tenant"], row["pipeline"], row["stage"], str(row["sessions"]), f"{row['compute_s']:.3f}",
                      f"{row['failed_compute_s']:.3f}", f"{row['audio_s']:.3f}", str(row["prompt_tokens"]),
                      str(row["completion_tokens"]))
    for total in doc["tenants"]:
        table.add_row(f"[bold]{total['tenant']}[/bold]", total["pipeline"], "[bold]all[/bold]", str(total["sessions"]),
                      f"{total['compute_s']:.3f}", f"{total['failed_compute_s']:.3f}", f"{total['audio_s']:.3f}",
                      str(total["prompt_tokens"]), str(total["completion_tokens"]))
    return table


@handle_errors
def usage(tenant: str = typer.Option(None, "--tenant", help="one tenant only"),
          pipeline: str = typer.Option(None, "--pipeline", help="one pipeline only"),
          since: str = typer.Option("1d", "--since", help="the last DURATION (90m, 12h, 7d; rounded down to the "
                                                          "hour, at most the retention)"),
          as_json: bool = JsonOpt) -> None:
    """Compute seconds, audio seconds and tokens per tenant, pipeline and stage (hourly counters kept
    OMNIFLOW_USAGE_RETENTION_DAYS days). A tenant or pipeline never seen here exits 2."""
    from omniflow.api.deps import parse_api_keys
    from omniflow.ops.admin import parse_duration
    from omniflow.ops.usage import read_usage

    seconds = parse_duration(since)
    configured = set(parse_api_keys(_settings().api_keys).values())
    doc = _run(_with_client, lambda client: read_usage(client.store, tenant=tenant, pipeline=pipeline,
                                                       since_s=seconds, tenants=configured))
    _print_json(doc) if as_json else console.print(usage_table(doc))


def register(app: typer.Typer) -> None:
    app.command("usage")(usage)
