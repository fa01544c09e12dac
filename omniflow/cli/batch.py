"""`omniflow batch submit|status|results` and `omniflow jobs`: thin parsing over `omniflow.jobs.batch`
and `omniflow.jobs.runner`.

Exit codes as everywhere: 0 ok, 1 some line of the batch failed (with --wait),
2 bad input (unreadable file, not JSONL, unknown batch), 3 Redis unreachable,
4 `--wait` ran out of time (the batch goes on).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from omniflow.cli.common import (
    EXIT_TIMED_OUT,
    EXIT_WORKFLOW_FAILED,
    JsonOpt,
    _print_json,
    _run,
    _settings,
    console,
    err_console,
    handle_errors,
)
from omniflow.cli.common import _pipeline as load_cli_pipeline
from omniflow.errors import InvalidRequest

batch_app = typer.Typer(help="Batch jobs: one workflow per line of a JSONL file.", no_args_is_help=True)

MAX_ROWS = 50


async def _with_store(fn: Any, *args: Any) -> Any:
    from omniflow.client.store import Store, connect

    settings = _settings()
    redis = connect(settings.resolve_redis_url())
    try:
        return await fn(Store(redis, settings, load_cli_pipeline()), *args)
    finally:
        await redis.aclose()


def _show(doc: dict[str, Any]) -> None:
    console.print(f"batch {doc['id']}: [bold]{doc['state']}[/bold] — {doc['completed']} completed, "
                  f"{doc['failed']} failed ({doc['invalid']} invalid), {doc['submitted']} submitted "
                  f"of {doc['total']}", highlight=False)
    bad = [row for row in doc.get("lines", []) if row["state"] not in ("completed", "queued", "submitted")]
    if bad:
        table = Table(title="lines that did not complete")
        for col in ("line", "workflow", "state", "error"):
            table.add_column(col)
        for row in bad[:MAX_ROWS]:
            table.add_row(str(row["line"]), row.get("workflow_id") or "-", row["state"], row.get("error") or "")
        console.print(table)
        if len(bad) > MAX_ROWS:
            console.print(f"... and {len(bad) - MAX_ROWS} more (--json lists all)")


@batch_app.command("submit")
@handle_errors
def submit(file: Path = typer.Argument(..., metavar="FILE.jsonl", help="one JSON request per line"),
           wait: bool = typer.Option(False, "--wait", help="block until every line has ended"),
           timeout: float = typer.Option(None, "--timeout", help="seconds to wait at most (with --wait)"),
           as_json: bool = JsonOpt) -> None:
    """Submit a batch; bad lines are reported by number and skipped. `omniflow jobs` runs it."""
    from omniflow.jobs.batch import parse_batch_file, runner_alive, submit_batch, wait_batch
    from omniflow.jobs.queue import create_job_pool

    settings = _settings()
    parsed = parse_batch_file(file, load_cli_pipeline(), settings)      # bad input exits 2 before Redis

    async def go(store: Any) -> dict[str, Any]:
        pool = await create_job_pool(settings.jobs_redis_url or settings.resolve_redis_url(), settings, conn_retries=0)
        try:
            created = await submit_batch(store, pool, parsed)
        finally:
            await pool.aclose()
        if not await runner_alive(store.client, settings):
            err_console.print("[yellow]warning:[/yellow] no `omniflow jobs` process is running; "
                              "the batch starts when one does", highlight=False, soft_wrap=True)
        if not wait:
            return created
        return {**await wait_batch(store, created["id"], timeout_s=timeout), "invalid_lines": created["invalid"]}

    doc = _run(_with_store, go)
    if as_json:
        _print_json(doc)
    elif wait:
        _show(doc)
    else:
        console.print(doc["id"])
        for row in doc["invalid"]:
            # one line per bad line however long, also when stderr is a pipe (rich would wrap at 80)
            err_console.print(f"line {row['line']}: {row['error']}", highlight=False, soft_wrap=True)
    if wait and doc["state"] == "running":
        raise typer.Exit(EXIT_TIMED_OUT)
    if wait and doc["state"] != "completed":
        raise typer.Exit(EXIT_WORKFLOW_FAILED)


@batch_app.command("status")
@handle_errors
def status(batch_id: str = typer.Argument(..., metavar="ID"), as_json: bool = JsonOpt) -> None:
    """Show a batch: counters, and every line's workflow id and state."""
    from omniflow.jobs.batch import batch_status

    async def go(store: Any) -> dict[str, Any]:
        return await batch_status(store, batch_id)

    doc = _run(_with_store, go)
    _print_json(doc) if as_json else _show(doc)


@batch_app.command("results")
@handle_errors
def results(batch_id: str = typer.Argument(..., metavar="ID"),
            audio_dir: Path = typer.Option(None, "--audio-dir", help="save each completed line's audio here "
                                                                    "as line-<n>.wav (its path is in audio_path)"),
            as_json: bool = JsonOpt) -> None:
    """One JSON object per line of the batch, on stdout (JSONL; --json changes nothing): line,
    workflow_id, state, text (the text output), audio_path, error."""
    from omniflow.jobs.batch import batch_results

    if audio_dir is not None and not audio_dir.is_dir():
        raise InvalidRequest(f"--audio-dir: folder {audio_dir} does not exist")

    async def go(store: Any) -> None:
        async for row in batch_results(store, batch_id, audio_dir=audio_dir):
            sys.stdout.write(json.dumps(row) + "\n")

    _run(_with_store, go)


@handle_errors
def jobs_cmd() -> None:
    """Run webhook deliveries and batch jobs (arq worker + notify dispatcher)."""
    from omniflow.jobs.runner import run_jobs
    from omniflow.runtime import setup_logging

    setup_logging()
    settings = _settings()
    run_jobs(settings, load_cli_pipeline(), settings.resolve_redis_url())


if __name__ == "__main__":
    batch_app()
