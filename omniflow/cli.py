"""The `omniflow` command: thin parsing over the engine.

Exit codes: 0 ok, 1 the workflow failed or was aborted, 2 bad input, 3 Redis unreachable.
Every reporting command takes `--json` and then prints one JSON document.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from omniflow.cli_common import (
    EXIT_WORKFLOW_FAILED,
    JsonOpt,
    _pipeline,
    _print_json,
    _run,
    _settings,
    _with_client,
    console,
    handle_errors,
    print_result,
    print_rows,
)
from omniflow.errors import InvalidRequest, PipelineError
from omniflow.pipeline import load_pipeline

app = typer.Typer(help="omniflow: durable multi-stage model serving on Redis.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
dlq_app = typer.Typer(help="Dead-letter streams.", no_args_is_help=True)
app.add_typer(dlq_app, name="dlq")


# ---------------------------------------------------------------- processes
@app.command()
@handle_errors
def up(pipeline: Path = typer.Option(None, "--pipeline", help="pipeline YAML (default: the toy omni pipeline)"),
       api: bool = typer.Option(True, "--api/--no-api", help="also serve the HTTP API"),
       host: str = typer.Option("127.0.0.1", "--host"), port: int = typer.Option(8000, "--port"),
       fsync: str = typer.Option("everysec", "--fsync", help="embedded Valkey appendfsync: always|everysec"),
       colocate: bool = typer.Option(False, "--colocate",
                                     help="one worker process per replica serving every stage (small boxes)")) -> None:
    """Start everything: embedded Valkey (unless OMNIFLOW_REDIS_URL), reconciler, workers, API."""
    from omniflow.runtime import setup_logging
    from omniflow.up import Supervisor

    if fsync not in ("always", "everysec"):
        raise InvalidRequest("--fsync must be 'always' or 'everysec'")
    setup_logging()
    settings = _settings()
    path = pipeline or settings.pipeline_path()
    sup = Supervisor(settings=settings, pipeline=load_pipeline(path), pipeline_path=Path(path), api=api,
                     host=host, port=port, fsync=fsync, colocate=colocate)
    raise typer.Exit(sup.run())


@app.command()
@handle_errors
def worker(stage: str = typer.Option(..., "--stage",
                                     help="the stage this process serves; several that share a device: "
                                          "`thinker,talker`, or `all`"),
           replicas: int = typer.Option(1, "--replicas", min=1, help="worker processes to run")) -> None:
    """Serve one stage, or several stages that share one device, in one process per replica."""
    from omniflow.runtime import setup_logging
    from omniflow.worker import parse_stages, run_worker

    setup_logging()
    settings = _settings()
    pipe = _pipeline()
    try:
        stages = parse_stages(stage, pipe)
    except PipelineError as exc:
        raise InvalidRequest(f"--stage: {exc}") from None
    url = settings.resolve_redis_url()
    if replicas == 1:
        run_worker(settings, pipe, stages, url)
        return
    import subprocess

    procs = [subprocess.Popen([sys.executable, "-m", "omniflow.cli", "worker", "--stage", ",".join(stages)])
             for _ in range(replicas)]
    try:
        for proc in procs:
            proc.wait()
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait()


@app.command()
@handle_errors
def reconciler() -> None:
    """Advance workflow state: consume stage events, retry, expire, sweep."""
    from omniflow.reconciler import run_reconciler
    from omniflow.runtime import setup_logging

    setup_logging()
    settings = _settings()
    run_reconciler(settings, _pipeline(), settings.resolve_redis_url())


@app.command("api")
@handle_errors
def api_cmd(host: str = typer.Option(None, "--host"), port: int = typer.Option(None, "--port")) -> None:
    """Serve the HTTP API (FastAPI on uvicorn)."""
    from omniflow.api.app import serve
    from omniflow.runtime import setup_logging

    setup_logging()
    settings = _settings()
    serve(settings, _pipeline(), settings.resolve_redis_url(), host or settings.api_host, port or settings.api_port)


# ---------------------------------------------------------------- client commands
@app.command()
@handle_errors
def submit(text: str = typer.Argument(..., help="the prompt"),
           modalities: str = typer.Option(None, "--modalities", help="comma list, e.g. text,audio"),
           out: Path = typer.Option(None, "--out", help="write the audio here (.wav/.flac/.ogg); implies --wait"),
           wait: bool = typer.Option(False, "--wait", help="block until the workflow ends"),
           request_id: str = typer.Option(None, "--request-id", help="idempotency key"),
           deadline: float = typer.Option(None, "--deadline", help="seconds until the workflow fails"),
           timeout: float = typer.Option(None, "--timeout", help="seconds to wait at most"),
           as_json: bool = JsonOpt) -> None:
    """Submit one request; with --wait print its text and exit 0/1 by its outcome."""
    if out is not None and out.suffix.lower() not in (".wav", ".flac", ".ogg"):
        raise InvalidRequest(f"--out: {out.name} must end in .wav, .flac or .ogg")
    mods = [m.strip() for m in modalities.split(",") if m.strip()] if modalities else None

    async def go(client: Any) -> dict[str, Any]:
        wf_id = await client.submit(text, modalities=mods, request_id=request_id, deadline_s=deadline)
        if not (wait or out):
            return {"id": wf_id, "state": "pending"}
        doc = await client.wait(wf_id, timeout_s=timeout)
        if out is not None and doc["state"] == "completed":
            doc["audio_file"] = str(out)
            doc["audio_seconds"] = await client.save_audio(wf_id, out)
        return doc  # type: ignore[no-any-return]

    doc = _run(_with_client, go)
    if as_json:
        _print_json(doc)
    elif "outputs" not in doc:
        console.print(doc["id"])
    else:
        for stage, output in doc["outputs"].items():
            if output["type"] == "text":
                console.print(f"[bold]{stage}[/bold]: {output['text']}")
            else:
                console.print(f"[bold]{stage}[/bold]: {output['duration_s']:.2f}s of audio at {output['sample_rate']} Hz"
                              + (f" -> {doc['audio_file']}" if doc.get("audio_file") else ""))
        console.print(f"workflow {doc['id']}: {doc['state']}" + (f" ({doc['error']})" if doc.get("error") else ""))
    if doc.get("state") in ("failed", "aborted"):
        raise typer.Exit(EXIT_WORKFLOW_FAILED)
    if "outputs" in doc and doc.get("state") not in ("completed",):
        raise typer.Exit(EXIT_WORKFLOW_FAILED)


@app.command()
@handle_errors
def inspect(wf_id: str = typer.Argument(..., metavar="ID"), as_json: bool = JsonOpt) -> None:
    """Show a workflow: stages, outputs and the timeline of its event log."""
    from omniflow.timeline import timeline_rows, timeline_table

    async def go(client: Any) -> tuple[dict[str, Any], list[Any]]:
        doc = await client.get(wf_id)
        return doc, await client.store.read_log(wf_id)

    doc, entries = _run(_with_client, go)
    rows = timeline_rows(entries, int(doc["created_at"] * 1000))
    if as_json:
        _print_json({**doc, "timeline": rows})
        return
    console.print(timeline_table(doc, rows))
    stages = Table(title="stages")
    for col in ("stage", "status", "attempt", "replica", "usage"):
        stages.add_column(col)
    for name, st in doc["stages"].items():
        stages.add_row(name, st["status"], str(st["attempt"]), st.get("replica") or "-",
                       json.dumps(st.get("usage", {})))
    console.print(stages)
    if doc.get("error"):
        console.print(f"[red]error[/red]: {doc['error']}")


@app.command("ls")
@handle_errors
def ls_cmd(state: str = typer.Option(None, "--state", help="pending|running|completed|failed|aborted"),
           limit: int = typer.Option(20, "--limit", min=1, max=1000), as_json: bool = JsonOpt) -> None:
    """List workflows, newest first."""
    from omniflow.models import WorkflowState

    if state is not None and state not in {s.value for s in WorkflowState}:
        raise InvalidRequest(f"--state: {state!r} is not one of {[s.value for s in WorkflowState]}")

    async def go(client: Any) -> list[dict[str, Any]]:
        return await client.list(state=state, limit=limit)  # type: ignore[no-any-return]

    import datetime as dt

    print_rows(_run(_with_client, go), ("id", "state", "created", "finals", "error"),
               lambda row: [row["id"], row["state"], dt.datetime.fromtimestamp(row["created_at"]).strftime("%H:%M:%S"),
                            ",".join(row["final_stages"]), row["error"] or ""], as_json=as_json)


@app.command()
@handle_errors
def abort(wf_id: str = typer.Argument(..., metavar="ID"), as_json: bool = JsonOpt) -> None:
    """Abort a workflow: every stage stops, partial outputs stay, the id is retired."""

    async def go(client: Any) -> str:
        return await client.abort(wf_id, reason="aborted by operator")  # type: ignore[no-any-return]

    state = _run(_with_client, go)
    print_result({"id": wf_id, "state": state}, f"workflow {wf_id}: {state}", as_json=as_json)


@app.command()
@handle_errors
def retry(wf_id: str = typer.Argument(..., metavar="ID"), as_json: bool = JsonOpt) -> None:
    """Run a failed or aborted workflow again, as a new workflow with the same input."""
    from omniflow.admin import retry_workflow

    async def go(client: Any) -> str:
        return await retry_workflow(client.store, wf_id)

    new_id = _run(_with_client, go)
    print_result({"id": new_id, "retry_of": wf_id}, f"workflow {wf_id} resubmitted as {new_id}", as_json=as_json)


@app.command()
@handle_errors
def stats(as_json: bool = JsonOpt) -> None:
    """Per-stage lag, pending sessions, live workers; workflows in flight."""
    from omniflow.admin import collect_stats

    async def go(client: Any) -> dict[str, Any]:
        return await collect_stats(client.store)

    data = _run(_with_client, go)
    if as_json:
        _print_json(data)
        return
    table = Table(title=f"in flight {data['in_flight']} / {data['max_in_flight']}")
    for col in ("stage", "queued", "lag", "pending", "workers", "sessions", "dlq"):
        table.add_column(col, justify="right")
    for name, st in data["stages"].items():
        table.add_row(name, str(st["queued"]), str(st["lag"]), str(st["pending"]), str(st["live_workers"]),
                      f"{st['active_sessions']}/{st['capacity']}", str(st["dlq"]))
    console.print(table)


@app.command()
@handle_errors
def purge(yes: bool = typer.Option(False, "--yes", help="really delete"), as_json: bool = JsonOpt) -> None:
    """Delete every omniflow key under the configured prefix."""
    from omniflow.admin import purge_all

    if not yes:
        raise InvalidRequest("purge deletes every workflow; run again with --yes")

    async def go(client: Any) -> int:
        return await purge_all(client.store)

    n = _run(_with_client, go)
    print_result({"deleted_keys": n}, f"deleted {n} keys", as_json=as_json)


@dlq_app.command("ls")
@handle_errors
def dlq_ls(stage: str = typer.Argument(None), limit: int = typer.Option(50, "--limit"), as_json: bool = JsonOpt) -> None:
    """List dead-lettered tasks (all stages, or one)."""
    from omniflow.admin import dlq_entries

    async def go(client: Any) -> list[dict[str, Any]]:
        return await dlq_entries(client.store, stage, limit)

    print_rows(_run(_with_client, go), ("stream", "entry", "workflow", "stage", "reason"),
               lambda row: [row["stream"], row["entry"], row.get("wf", ""), row.get("s", ""),
                            row.get("error") or row.get("reason", "")], as_json=as_json)


@dlq_app.command("replay")
@handle_errors
def dlq_replay(stage: str = typer.Argument(...), entry: str = typer.Option(None, "--entry", help="one entry id"),
               as_json: bool = JsonOpt) -> None:
    """Resubmit the workflows of dead-lettered tasks as new workflows, and drop the entries."""
    from omniflow.admin import dlq_replay as replay

    async def go(client: Any) -> list[dict[str, str]]:
        return await replay(client.store, stage, entry)

    rows = _run(_with_client, go)
    if as_json:
        _print_json(rows)
    else:
        for row in rows:
            console.print(f"{row['entry']}: {row['wf']} -> {row.get('new_id') or row.get('skipped')}")


from omniflow.cli_batch import batch_app, jobs_cmd  # noqa: E402 - uses the helpers above

app.add_typer(batch_app, name="batch")
app.command("jobs")(jobs_cmd)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
