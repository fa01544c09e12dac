"""The `omniflow` command: thin parsing over the engine.

Exit codes: 0 ok, 1 the workflow failed or was aborted (or a confirmation was declined), 2 bad
input, 3 Redis unreachable, 4 `--wait` ran out of time (the workflow goes on).
Every reporting command takes `--json` and then prints one JSON document. The operator's
commands (stats, workers, drain, purge, dlq) are in `omniflow.cli.admin`, batches in
`omniflow.cli.batch`.
"""
from __future__ import annotations

import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError

from omniflow.cli.common import (
    EXIT_TIMED_OUT,
    EXIT_WORKFLOW_FAILED,
    JsonOpt,
    _catalog,
    _pipeline,
    _print_json,
    _run,
    _settings,
    _with_client,
    console,
    err_console,
    handle_errors,
    print_result,
    print_rows,
)
from omniflow.errors import InvalidRequest, PipelineError, UnknownPipeline
from omniflow.models import Priority, SubmitRequest, WorkflowInput
from omniflow.pipeline import Pipeline, load_pipeline

app = typer.Typer(help="omniflow: durable multi-stage model serving on Redis.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)

# what the fields of a refused request are called on the command line
REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
ARG_NAMES = {"input.text": "TEXT", "text": "TEXT", "output_modalities": "--modalities", "request_id": "--request-id",
             "deadline_s": "--deadline"}


PIPELINES_HELP = ("a pipeline YAML; repeat it to serve several in one deployment (the first is the default; "
                  "default: OMNIFLOW_PIPELINE, else the toy omni pipeline)")


def _pipelines_opt() -> Any:
    return typer.Option(None, "--pipeline", help=PIPELINES_HELP)


# ---------------------------------------------------------------- processes
@app.command()
@handle_errors
def up(pipeline: list[Path] = _pipelines_opt(),  # noqa: B008 - typer's way
       api: bool = typer.Option(True, "--api/--no-api", help="also serve the HTTP API"),
       host: str = typer.Option("127.0.0.1", "--host"), port: int = typer.Option(8000, "--port"),
       fsync: str = typer.Option("everysec", "--fsync", help="embedded Valkey appendfsync: always|everysec"),
       colocate: bool = typer.Option(False, "--colocate",
                                     help="one worker process per replica serving every stage (small boxes)")) -> None:
    """Start everything: embedded Valkey (unless OMNIFLOW_REDIS_URL), reconciler, workers, API."""
    from omniflow.runtime import setup_logging
    from omniflow.ops.up import Supervisor

    if fsync not in ("always", "everysec"):
        raise InvalidRequest("--fsync must be 'always' or 'everysec'")
    setup_logging()
    settings = _settings()
    paths = list(pipeline or ()) or settings.pipeline_paths()
    catalog = _catalog(paths)           # every YAML valid, no two with one name: before anything starts
    loaded = [(load_pipeline(p), Path(p)) for p in paths]
    sup = Supervisor(settings=settings, pipeline=catalog.default, pipeline_path=Path(paths[0]), api=api,
                     host=host, port=port, fsync=fsync, colocate=colocate, more=tuple(loaded[1:]))
    raise typer.Exit(sup.run())


@app.command()
@handle_errors
def worker(stage: str = typer.Option(..., "--stage",
                                     help="the stage this process serves (in every pipeline that has it); "
                                          "several that share a device: `thinker,talker`, or `all`"),
           replicas: int = typer.Option(1, "--replicas", min=1, help="worker processes to run"),
           pipeline: list[Path] = _pipelines_opt()) -> None:  # noqa: B008
    """Serve one stage, or several stages that share one device, in one process per replica. With
    several pipelines, a stage two of them declare identically is served by one executor."""
    from omniflow.runtime import setup_logging
    from omniflow.engine.worker import run_worker

    setup_logging()
    settings = _settings()
    catalog = _catalog(pipeline)
    try:
        routes = catalog.routes(stage)
    except PipelineError as exc:
        raise InvalidRequest(f"--stage: {exc}") from None
    stages = list(dict.fromkeys(st for _p, st in routes))
    url = settings.resolve_redis_url()
    if replicas == 1:
        run_worker(settings, catalog, stages, url)
        return
    import subprocess

    given = [x for p in (pipeline or ()) for x in ("--pipeline", str(p))]
    procs = [subprocess.Popen([sys.executable, "-m", "omniflow.cli", "worker", "--stage", ",".join(stages), *given])
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
def reconciler(pipeline: list[Path] = _pipelines_opt()) -> None:  # noqa: B008
    """Advance workflow state: consume stage events, retry, expire, sweep (for every pipeline: the
    ones given, and every version the registry holds)."""
    from omniflow.engine.reconciler import run_reconciler
    from omniflow.runtime import setup_logging

    setup_logging()
    settings = _settings()
    run_reconciler(settings, _catalog(pipeline), settings.resolve_redis_url())


@app.command("api")
@handle_errors
def api_cmd(host: str = typer.Option(None, "--host"), port: int = typer.Option(None, "--port"),
            pipeline: list[Path] = _pipelines_opt()) -> None:  # noqa: B008
    """Serve the HTTP API (FastAPI on uvicorn): every pipeline given, and those registered later."""
    from omniflow.api.app import serve
    from omniflow.runtime import setup_logging

    setup_logging()
    settings = _settings()
    serve(settings, _catalog(pipeline), settings.resolve_redis_url(), host or settings.api_host,
          port or settings.api_port)


# ---------------------------------------------------------------- client commands
def submit_request(pipe: Pipeline, text: str, *, modalities: str | None, request_id: str | None,
                   deadline: float | None, out: Path | None, priority: str | None = None) -> SubmitRequest:
    """Check every argument of `submit` before anything runs; one clear `InvalidRequest` otherwise."""
    try:
        prio = Priority.parse(priority) if priority is not None else None
    except ValueError as exc:
        raise InvalidRequest(f"--priority: {exc}") from None
    if deadline is not None and not deadline > 0:
        raise InvalidRequest(f"--deadline: {deadline:g} is not a positive number of seconds")
    mods = [m.strip() for m in modalities.split(",") if m.strip()] if modalities is not None else None
    if modalities is not None and not mods:
        raise InvalidRequest("--modalities: give at least one, e.g. text,audio")
    twice = sorted(m for m, n in Counter(mods or []).items() if n > 1)
    if twice:
        raise InvalidRequest(f"--modalities: {', '.join(twice)} given twice")
    if not text.strip():
        raise InvalidRequest("TEXT: the prompt is empty")
    if request_id is not None and not REQUEST_ID.fullmatch(request_id):
        raise InvalidRequest(f"--request-id: {request_id!r} must be 1-128 characters of letters, digits and _ . : -")
    try:
        req = SubmitRequest(input=WorkflowInput(text=text), output_modalities=mods, request_id=request_id,
                            deadline_s=deadline, priority=prio)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise InvalidRequest(f"{ARG_NAMES.get(where, where)}: {first['msg'].removeprefix('Value error, ')}") from None
    plan = pipe.plan(req.output_modalities)       # unknown modality: a clear error, nothing created
    if out is not None:
        if out.suffix.lower() not in (".wav", ".flac", ".ogg"):
            raise InvalidRequest(f"--out: {out.name} must end in .wav, .flac or .ogg")
        if not any(pipe.stages[f].final_output == "audio" for f in plan.finals):
            raise InvalidRequest("--out: this request produces no audio (add audio to --modalities)")
        folder = out.parent if str(out.parent) else Path(".")
        if not folder.is_dir():
            raise InvalidRequest(f"--out: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            raise InvalidRequest(f"--out: folder {folder} is not writable")
    return req


async def _named_pipeline(client: Any, ref: str) -> Pipeline:
    """The pipeline `--pipeline` names (one this deployment serves or the registry has; else one line, exit 2)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}(@[0-9a-f]{16})?", ref):
        raise InvalidRequest(f"--pipeline: {ref!r} is not a pipeline name (or NAME@VERSION)")
    try:
        found: Pipeline = await client.store.pipeline_named(ref, param="pipeline")
    except UnknownPipeline as exc:
        raise InvalidRequest(f"--pipeline: {exc}") from None
    return found


def _output_line(stage: str, output: dict[str, Any], audio_file: str | None) -> str:
    if output["type"] == "text":
        return f"[bold]{stage}[/bold]: {output['text']}" + (" [dim](partial)[/dim]" if output.get("partial") else "")
    if not output.get("sample_rate"):
        return f"[bold]{stage}[/bold]: no audio yet"
    return (f"[bold]{stage}[/bold]: {output['duration_s']:.2f}s of audio at {output['sample_rate']} Hz"
            + (" [dim](partial)[/dim]" if output.get("partial") else "") + (f" -> {audio_file}" if audio_file else ""))


@app.command()
@handle_errors
def submit(text: str = typer.Argument(..., help="the prompt"),
           modalities: str = typer.Option(None, "--modalities", help="comma list, e.g. text,audio"),
           out: Path = typer.Option(None, "--out", help="write the audio here (.wav/.flac/.ogg); implies --wait"),
           wait: bool = typer.Option(False, "--wait", help="block until the workflow ends"),
           request_id: str = typer.Option(None, "--request-id", help="idempotency key"),
           deadline: float = typer.Option(None, "--deadline", help="seconds until the workflow fails"),
           timeout: float = typer.Option(None, "--timeout", help="seconds to wait at most (then exit 4)"),
           pipeline: str = typer.Option(None, "--pipeline",
                                        help="the pipeline to run, by name (`omniflow pipelines`), or NAME@VERSION; "
                                             "default: the first of OMNIFLOW_PIPELINE"),
           priority: str = typer.Option(None, "--priority", help="interactive, api (default) or batch"),
           as_json: bool = JsonOpt) -> None:
    """Submit one request; with --wait print its outputs and exit 0 (completed), 1 (failed or
    aborted) or 4 (still running when --timeout ran out)."""
    if timeout is not None and not timeout > 0:
        raise InvalidRequest(f"--timeout: {timeout:g} is not a positive number of seconds")
    pipe = _pipeline() if pipeline is None else _run(_with_client, _named_pipeline, pipeline)
    req = submit_request(pipe, text, modalities=modalities, request_id=request_id, deadline=deadline, out=out,
                         priority=priority)
    if pipeline is not None:
        req = req.model_copy(update={"pipeline": f"{pipe.name}@{pipe.digest}"})
    from omniflow import tracing

    tracing.setup("cli")        # OTEL_TRACES_EXPORTER set: the workflow's trace starts with a `submit` span here

    async def go(client: Any) -> dict[str, Any]:
        wf_id = (await client.store.submit(req, tenant=client.tenant)).id
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
            console.print(_output_line(stage, output, doc.get("audio_file")), highlight=False)
        console.print(f"workflow {doc['id']}: {doc['state']}" + (f" ({doc['error']})" if doc.get("error") else ""),
                      highlight=False)
    if doc.get("state") in ("failed", "aborted"):
        raise typer.Exit(EXIT_WORKFLOW_FAILED)
    if "outputs" in doc and doc.get("state") != "completed":
        err_console.print(f"workflow {doc['id']} is still {doc['state']} after {timeout:g}s; it goes on "
                          f"(`omniflow inspect {doc['id']}`)", highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_TIMED_OUT)


@app.command()
@handle_errors
def inspect(wf_id: str = typer.Argument(..., metavar="ID"), as_json: bool = JsonOpt) -> None:
    """Show a workflow: stages and their attempts, outputs, webhook deliveries and its event-log timeline."""
    from omniflow.ops.timeline import attempts_table, gantt, timeline_rows, timeline_table, webhook_table

    async def go(client: Any) -> tuple[dict[str, Any], list[Any]]:
        doc = await client.get(wf_id)
        return doc, await client.store.read_log(wf_id)

    doc, entries = _run(_with_client, go)
    rows = timeline_rows(entries, int(doc["created_at"] * 1000))
    lanes = gantt(entries, doc)
    if as_json:
        _print_json({**doc, "timeline": rows, "lanes": lanes["lanes"]})
        return
    console.print(timeline_table(doc, rows))
    console.print(attempts_table(lanes))
    if doc.get("webhook"):
        console.print(webhook_table(doc["webhook"]))
    if doc.get("error"):
        console.print(f"[red]error[/red]: {doc['error']}", highlight=False)


@app.command("ls")
@handle_errors
def ls_cmd(state: str = typer.Option(None, "--state", help="pending|running|completed|failed|aborted"),
           stage: str = typer.Option(None, "--stage", help="workflows whose plan includes this stage"),
           tenant: str = typer.Option(None, "--tenant", help="one tenant's workflows"),
           since: str = typer.Option(None, "--since", help="created in the last DURATION: 90s, 10m, 2h, 7d"),
           request_id: str = typer.Option(None, "--request-id", help="request ids containing this text"),
           limit: int = typer.Option(20, "--limit", min=1, max=1000), as_json: bool = JsonOpt) -> None:
    """List workflows, newest first, filtered."""
    from omniflow.ops.admin import parse_duration, since_ms
    from omniflow.storage.listing import ListFilter
    from omniflow.models import WorkflowState

    if state is not None and state not in {s.value for s in WorkflowState}:
        raise InvalidRequest(f"--state: {state!r} is not one of {[s.value for s in WorkflowState]}")
    known = sorted({st for p in _catalog() for st in p.stages})
    if stage is not None and stage not in known:
        raise InvalidRequest(f"--stage: unknown stage {stage!r}; stages are {known}")
    flt = ListFilter(state=state, tenant=tenant, stage=stage, request_id=request_id or None,
                     since_ms=since_ms(parse_duration(since)) if since is not None else None)

    async def go(client: Any) -> list[dict[str, Any]]:
        return (await client.store.list_workflows(flt, limit=limit)).rows  # type: ignore[no-any-return]

    import datetime as dt

    print_rows(_run(_with_client, go), ("id", "request id", "pipeline", "state", "tenant", "created", "stages",
                                        "error"),
               lambda row: [row["id"], row["request_id"] or "", row.get("pipeline") or "", row["state"],
                            row["tenant"] or "",
                            dt.datetime.fromtimestamp(row["created_at"]).strftime("%m-%d %H:%M:%S"),
                            ",".join(row["stages"]),
                            (f"{row['error_stage']}: " if row["error_stage"] else "") + (row["error"] or "")],
               as_json=as_json)


@app.command()
@handle_errors
def abort(wf_id: str = typer.Argument(..., metavar="ID"), as_json: bool = JsonOpt) -> None:
    """Abort a workflow: every stage stops, partial outputs stay, the id is retired."""
    from omniflow import tracing

    tracing.setup("cli")        # OTEL_TRACES_EXPORTER set: an `abort` span joins the workflow's trace

    async def go(client: Any) -> str:
        return await client.abort(wf_id, reason="aborted by operator")  # type: ignore[no-any-return]

    state = _run(_with_client, go)
    print_result({"id": wf_id, "state": state}, f"workflow {wf_id}: {state}", as_json=as_json)


@app.command()
@handle_errors
def retry(wf_id: str = typer.Argument(..., metavar="ID"), as_json: bool = JsonOpt) -> None:
    """Run a failed or aborted workflow again, as a new workflow with the same input."""
    from omniflow.ops.admin import retry_workflow

    async def go(client: Any) -> str:
        return await retry_workflow(client.store, wf_id)

    new_id = _run(_with_client, go)
    print_result({"id": new_id, "retry_of": wf_id}, f"workflow {wf_id} resubmitted as {new_id}", as_json=as_json)


from omniflow.cli.admin import register as register_admin  # noqa: E402 - uses the helpers above
from omniflow.cli.batch import batch_app, jobs_cmd  # noqa: E402
from omniflow.cli.tenants import register as register_tenants  # noqa: E402
from omniflow.cli.usage import register as register_usage  # noqa: E402

register_admin(app)
register_usage(app)
register_tenants(app)
app.add_typer(batch_app, name="batch")
app.command("jobs")(jobs_cmd)


def main() -> None:
    # Python hands undecodable bytes of argv over as lone surrogates; they would fail deep inside
    # (encoding for Redis, a JSON dump) with a traceback: refuse them here, in one line
    for arg in sys.argv[1:]:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            err_console.print(f"[red]error:[/red] argument {arg!a} is not valid UTF-8", highlight=False)
            raise SystemExit(2) from None
    app()


if __name__ == "__main__":
    main()
