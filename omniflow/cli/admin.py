"""The operator's commands: `stats [--watch]`, `workers`, `drain`/`undrain`, `purge`, `scripts [--prune]`,
`dlq ls|replay|drop`.

Thin parsing over `omniflow.ops.admin` (actions) and `omniflow.ops.fleet` (reads). Destructive commands (purge,
dlq drop) say what they
would delete and ask; without a terminal they need `--yes` (exit 2 otherwise), and a "no"
exits 1 with nothing deleted. `drain --wait` that runs out of time exits 4.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from omniflow.cli.common import (
    EXIT_TIMED_OUT,
    EXIT_WORKFLOW_FAILED,
    JsonOpt,
    _catalog,
    _print_json,
    _run,
    _with_client,
    console,
    err_console,
    handle_errors,
    print_result,
    print_rows,
)
from omniflow.errors import InvalidRequest

dlq_app = typer.Typer(help="Dead-letter streams: tasks that exhausted their attempts, malformed entries.",
                      no_args_is_help=True)

DRAIN_POLL_S = 0.5


def _confirm(question: str, yes: bool) -> None:
    """Go on when `--yes`, or when the operator answers yes at a terminal; else stop."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise InvalidRequest(f"{question} Run again with --yes to confirm.")
    if not typer.confirm(question, default=False):
        err_console.print("nothing deleted", highlight=False)
        raise typer.Exit(EXIT_WORKFLOW_FAILED)


# ---------------------------------------------------------------- stats
def _age(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def stats_view(data: dict[str, Any]) -> Group:
    """The pools snapshot as rich tables (what `stats` prints and `stats --watch` refreshes)."""
    counts = " · ".join(f"{k} {v}" for k, v in data["workflows"].items())
    table = Table(title=f"in flight {data['in_flight']} / {data['max_in_flight']}   ({counts})",
                  caption=f"retries scheduled {data['scheduled_retries']} · events backlog {data['events_backlog']}"
                          f" · {time.strftime('%H:%M:%S', time.localtime(data['at']))}")
    columns = ("stage", "workers", "busy", "queued", "lag", "pending", "oldest", "done/min", "p50", "p99",
               "failed", "retried", "dlq")
    for col in columns:
        table.add_column(col, justify="left" if col == "stage" else "right")
    for name, st in data["stages"].items():
        lm = st["last_minute"]
        workers = (str(st["live_workers"]) if st["live_workers"] else "[red]0[/red]") \
            + (f" ({st['draining_workers']} draining)" if st["draining_workers"] else "") \
            + (f" +{st['loading_workers']} loading" if st.get("loading_workers") else "")
        table.add_row(name, workers,
                      f"{st['active_sessions']}/{st['capacity']}", str(st["queued"]), str(st["lag"]),
                      str(st["pending"]), _age(st["oldest_pending_age_s"]), str(lm["done"]), _age(lm["p50_s"]),
                      _age(lm["p99_s"]), str(lm["failed"]), str(lm["retries"]), str(st["dlq"]))
    return Group(table, workers_table(data["workers"]), pipelines_table(data.get("pipelines", [])))


def pipelines_table(rows: list[dict[str, Any]]) -> Table:
    """The pipeline registry: every version, whether new workflows get it, who serves each stage."""
    table = Table(title=f"pipelines ({len({r['name'] for r in rows})} names, {len(rows)} versions)")
    for col in ("pipeline", "version", "in → out", "serving (stage: workers)"):
        table.add_column(col)
    for r in rows:
        serving = ", ".join(f"{st}: {len(ws)}" if ws else f"{st}: [red]0[/red]" for st, ws in r["workers"].items())
        table.add_row(r["name"], r["version"] + ("" if r["current"] else " [dim](older)[/dim]"),
                      f"{','.join(r['input_modalities'])} → {','.join(r['output_modalities'])}", serving)
    return table


@handle_errors
def pipelines(as_json: bool = JsonOpt) -> None:
    """The pipeline registry: every pipeline (and version) this deployment serves, what it takes and
    makes, and the live workers serving each of its stages."""
    from omniflow.storage import registry

    rows = _run(_with_client, lambda client: registry.snapshot(client.store.client, client.store.keys))
    if as_json:
        _print_json(rows)
    else:
        console.print(pipelines_table(rows))


#: how `workers` shows each worker state (rich markup)
STATE_STYLE = {"ready": "[green]ready[/green]", "loading": "[cyan]loading[/cyan]",
               "draining": "[yellow]draining[/yellow]", "stopping": "[yellow]stopping[/yellow]",
               "lapsed": "[red]lapsed[/red]"}


def workers_table(workers: list[dict[str, Any]]) -> Table:
    loading = sum(w["state"] == "loading" for w in workers)
    table = Table(title=f"workers ({sum(w['alive'] for w in workers)} live"
                        + (f", {loading} loading" if loading else "") + ")")
    for col in ("worker", "stages", "host", "pid", "sessions", "heartbeat", "state", "for"):
        table.add_column(col)
    for w in workers:
        # "thinker 3/8 (loop)": a stage whose sessions run on the worker's loop (runs_on "auto" moved them, or "loop")
        sessions = ", ".join(f"{s} {w['sessions'].get(s, 0)}/{w['capacity'].get(s, 0)}"
                             + (" (loop)" if w.get("runs_on", {}).get(s) == "loop" else "") for s in w["stages"])
        table.add_row(w["id"], ",".join(w["stages"]), w["host"] or "-", str(w["pid"] or "-"), sessions,
                      _age(w["heartbeat_age_s"]), STATE_STYLE.get(w["state"], w["state"]), _age(w.get("state_age_s")))
    return table


@handle_errors
def stats(watch: bool = typer.Option(False, "--watch", help="refresh in place until Ctrl-C"),
          interval: float = typer.Option(1.0, "--interval", min=0.1, help="seconds between refreshes"),
          count: int = typer.Option(None, "--count", min=1, help="with --watch: stop after this many refreshes"),
          as_json: bool = JsonOpt) -> None:
    """Per stage: workers, busy sessions, queue lag and pending, oldest pending, the last minute's
    throughput, p50/p99, failures and retries, dead letters; workflows per state, in flight vs limit.
    With --watch --json: one JSON document per line per refresh."""
    from omniflow.ops.fleet import collect_stats

    if not watch:
        data = _run(_with_client, lambda client: collect_stats(client.store))
        _print_json(data) if as_json else console.print(stats_view(data))
        return

    async def go(client: Any) -> None:
        shown = 0
        if as_json:
            while count is None or shown < count:
                sys.stdout.write(json.dumps(await collect_stats(client.store)) + "\n")
                sys.stdout.flush()
                shown += 1
                if count is None or shown < count:
                    await asyncio.sleep(interval)
            return
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while count is None or shown < count:
                live.update(stats_view(await collect_stats(client.store)), refresh=True)
                shown += 1
                if count is None or shown < count:
                    await asyncio.sleep(interval)

    try:
        _run(_with_client, go)
    except KeyboardInterrupt:
        return


# ---------------------------------------------------------------- workers and drain
@handle_errors
def workers(as_json: bool = JsonOpt) -> None:
    """Every registered worker: stages, host, pid, sessions held, heartbeat age, and its state:
    loading (its models; not live yet), ready, draining, stopping, lapsed (dead, not reaped yet)."""
    from omniflow.ops.fleet import list_workers

    rows = _run(_with_client, lambda client: list_workers(client.store))
    _print_json(rows) if as_json else console.print(workers_table(rows))


def _set_drain(worker_id: str, drain: bool, wait: bool, timeout: float | None, as_json: bool) -> None:
    from omniflow.ops.admin import set_drain
    from omniflow.ops.fleet import list_workers

    async def go(client: Any) -> dict[str, Any]:
        row = await set_drain(client.store, worker_id, drain=drain)
        deadline = None if timeout is None else time.monotonic() + timeout
        while wait and row["sessions_held"] > 0 and row["alive"]:
            if deadline is not None and time.monotonic() >= deadline:
                break
            await asyncio.sleep(DRAIN_POLL_S)
            row = next((w for w in await list_workers(client.store) if w["id"] == worker_id),
                       {**row, "alive": False, "sessions_held": 0})
        return row

    row = _run(_with_client, go)
    held = row["sessions_held"]
    if not drain:
        line = f"worker {worker_id} claims again ({held} session(s) held)"
    elif held == 0:
        line = f"worker {worker_id} is drained: it holds no session and claims nothing; stop it when you like"
    else:
        line = f"worker {worker_id} is draining: it claims nothing new and still holds {held} session(s)"
    print_result(row, line, as_json=as_json)
    if drain and wait and held > 0:
        raise typer.Exit(EXIT_TIMED_OUT)


@handle_errors
def drain(worker_id: str = typer.Argument(..., metavar="WORKER", help="a worker id from `omniflow workers`"),
          wait: bool = typer.Option(False, "--wait", help="block until it holds no session"),
          timeout: float = typer.Option(None, "--timeout", min=0, help="with --wait: seconds at most (then exit 4)"),
          as_json: bool = JsonOpt) -> None:
    """Drain a worker for a graceful restart: within a heartbeat it stops claiming; the sessions it
    holds run to their end. When it holds none, stop it: nothing is retried."""
    _set_drain(worker_id, True, wait, timeout, as_json)


@handle_errors
def undrain(worker_id: str = typer.Argument(..., metavar="WORKER"), as_json: bool = JsonOpt) -> None:
    """Lift a drain: the worker claims again."""
    _set_drain(worker_id, False, False, None, as_json)


# ---------------------------------------------------------------- purge
@handle_errors
def purge(older_than: str = typer.Option(None, "--older-than", help="finished workflows created longer ago "
                                                                     "than DURATION: 90s, 10m, 2h, 7d"),
          state: str = typer.Option(None, "--state", help="with --older-than: only completed, failed or aborted ones"),
          everything: bool = typer.Option(False, "--all", help="delete EVERY key under the prefix (a wipe)"),
          yes: bool = typer.Option(False, "--yes", help="do not ask"),
          as_json: bool = JsonOpt) -> None:
    """Delete finished workflows older than a duration (live ones are never touched), or, with
    --all, everything under the key prefix. Asks first; --yes skips the question."""
    from omniflow.ops.admin import count_finished, finished_states, parse_duration, purge_all, purge_finished
    from omniflow.config import get_settings

    if everything == (older_than is not None):
        raise InvalidRequest("purge needs --older-than DURATION (finished workflows) or --all "
                             "(every key under the prefix), and --yes or a confirmation")
    if everything:
        if state is not None:
            raise InvalidRequest("--state goes with --older-than, not with --all")
        _confirm(f"Delete EVERY key under the prefix {get_settings().prefix!r} (all workflows, live ones "
                 "included, queues, workers' records)?", yes)
        n = _run(_with_client, lambda client: purge_all(client.store))
        print_result({"deleted_keys": n}, f"deleted {n} keys", as_json=as_json)
        return
    states, seconds = finished_states(state), parse_duration(older_than)
    found = _run(_with_client, lambda client: count_finished(client.store, states, seconds))
    if found == 0:
        print_result({"deleted_workflows": 0}, f"no {'/'.join(states)} workflow created more than {older_than} ago",
                     as_json=as_json)
        return
    _confirm(f"Delete {found} {'/'.join(states)} workflow(s) created more than {older_than} ago?", yes)
    n = _run(_with_client, lambda client: purge_finished(client.store, states, seconds))
    print_result({"deleted_workflows": n}, f"deleted {n} finished workflow(s)", as_json=as_json)


# ---------------------------------------------------------------- script libraries
@handle_errors
def scripts(prune: bool = typer.Option(False, "--prune", help="delete the libraries of other omniflow versions"),
            yes: bool = typer.Option(False, "--yes", help="with --prune: do not ask"),
            as_json: bool = JsonOpt) -> None:
    """omniflow's Lua libraries on the server: this version's, and those of versions that ran before
    (an upgrade leaves its predecessor's). --prune deletes the others; a process of an old version
    that still runs loads its own again at its next call."""
    from omniflow.ops.admin import prune_script_libraries, script_libraries

    rows = _run(_with_client, lambda client: script_libraries(client.store))
    if not prune:
        print_rows(rows, ("library", "functions", "this version"),
                   lambda r: [r["library"], str(r["functions"]), "yes" if r["current"] else "-"], as_json=as_json)
        return
    old = [r["library"] for r in rows if not r["current"]]
    if old:
        _confirm(f"Delete {len(old)} script librar{'y' if len(old) == 1 else 'ies'} of other omniflow versions "
                 f"({', '.join(old)})?", yes)
    deleted = _run(_with_client, lambda client: prune_script_libraries(client.store, old)) if old else []
    print_result({"deleted": deleted}, f"deleted {len(deleted)} script librar{'y' if len(deleted) == 1 else 'ies'}",
                 as_json=as_json)


# ---------------------------------------------------------------- dead letters
def _dlq_stage(positional: str | None, option: str | None) -> str | None:
    """The stage named by `STAGE` or `--stage` (not two different ones), checked against the pipeline."""
    from omniflow.ops.admin import dlq_names

    if positional and option and positional != option:
        raise InvalidRequest(f"two stages given: {positional!r} and --stage {option!r}")
    stage = positional or option
    if stage is not None:
        dlq_names(_catalog(), stage)
    return stage


def _dlq_target(positional: str | None, option: str | None, every: bool, entry: str | None) -> str | None:
    """What `dlq replay` / `dlq drop` act on: one stage's dead letters, or (`--all`) every stage's."""
    name = _dlq_stage(positional, option)
    if (name is None) != every:
        raise InvalidRequest("give a STAGE (or --stage), or --all for every stage")
    if entry is not None and name is None:
        raise InvalidRequest("--entry needs the STAGE it belongs to")
    return name


StageArg = typer.Argument(None, metavar="[STAGE]", help="a stage, or `events` (malformed events)")
StageOpt = typer.Option(None, "--stage", help="the same as STAGE")


@dlq_app.command("ls")
@handle_errors
def dlq_ls(stage: str = StageArg, stage_opt: str = StageOpt, limit: int = typer.Option(50, "--limit", min=1),
           as_json: bool = JsonOpt) -> None:
    """List dead letters, newest first (all streams, or one stage's)."""
    from omniflow.ops.admin import dlq_entries

    name = _dlq_stage(stage, stage_opt)
    rows = _run(_with_client, lambda client: dlq_entries(client.store, name, limit))
    print_rows(rows, ("dlq", "entry", "workflow", "attempt", "reason"),
               lambda row: [row["dlq"], row["entry"], row.get("wf", ""), row.get("a", ""),
                            row.get("error") or row.get("reason", "")], as_json=as_json)


@dlq_app.command("replay")
@handle_errors
def dlq_replay(stage: str = StageArg, stage_opt: str = StageOpt,
               every: bool = typer.Option(False, "--all", help="every stage's dead letters"),
               entry: str = typer.Option(None, "--entry", help="one entry id (with a stage)"),
               as_json: bool = JsonOpt) -> None:
    """Resubmit the workflows of dead letters as new workflows, and drop the replayed entries."""
    from omniflow.ops.admin import dlq_replay as replay

    name = _dlq_target(stage, stage_opt, every, entry)
    rows = _run(_with_client, lambda client: replay(client.store, name, entry))
    if as_json:
        _print_json(rows)
        return
    for row in rows:
        console.print(f"{row['dlq']} {row['entry']}: {row['wf']} -> {row.get('new_id') or row.get('skipped')}",
                      highlight=False)
    console.print(f"{sum('new_id' in r for r in rows)} replayed, {sum('skipped' in r for r in rows)} skipped",
                  highlight=False)


@dlq_app.command("drop")
@handle_errors
def dlq_drop(stage: str = StageArg, stage_opt: str = StageOpt,
             every: bool = typer.Option(False, "--all", help="every stage's dead letters"),
             entry: str = typer.Option(None, "--entry", help="one entry id (with a stage)"),
             yes: bool = typer.Option(False, "--yes", help="do not ask"), as_json: bool = JsonOpt) -> None:
    """Delete dead letters: one entry, one stage's, or (--all) every stage's. Asks first."""
    from omniflow.ops.admin import dlq_count
    from omniflow.ops.admin import dlq_drop as drop

    name = _dlq_target(stage, stage_opt, every, entry)
    found = _run(_with_client, lambda client: dlq_count(client.store, name, entry))
    if found:
        _confirm(f"Delete {found} dead letter(s) from {name or 'every stage'}?", yes)
    n = _run(_with_client, lambda client: drop(client.store, name, entry)) if found else 0
    print_result({"deleted": n}, f"deleted {n} dead letter(s)", as_json=as_json)


def register(app: typer.Typer) -> None:
    """Add these commands to the `omniflow` app."""
    app.command("stats")(stats)
    app.command("pipelines")(pipelines)
    app.command("workers")(workers)
    app.command("drain")(drain)
    app.command("undrain")(undrain)
    app.command("purge")(purge)
    app.command("scripts")(scripts)
    app.add_typer(dlq_app, name="dlq")
