"""Helpers shared by the CLI's command modules (`omniflow.cli`, `omniflow.cli.batch`)."""
from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console

from omniflow.config import Settings, get_settings
from omniflow.errors import (
    AdmissionRefused,
    ConfigError,
    InvalidRequest,
    OmniflowError,
    PipelineError,
    RedisError,
    RedisNotFound,
    RedisUnavailable,
    WorkflowError,
    WorkflowNotFound,
    WorkflowRetired,
)
from omniflow.catalog import Catalog
from omniflow.pipeline import Pipeline, load_pipeline

T = TypeVar("T")

EXIT_OK, EXIT_WORKFLOW_FAILED, EXIT_BAD_INPUT, EXIT_REDIS = 0, 1, 2, 3
EXIT_TIMED_OUT = 4          # `--wait` ran out of time; the workflow (or batch, or drain) goes on

# rich falls back to 80 columns when stdout is not a terminal (pipes, `make demo`): tables wrap badly
console = Console() if sys.stdout.isatty() else Console(width=120)
err_console = Console(stderr=True)

JsonOpt = typer.Option(False, "--json", help="print one JSON document on stdout")


def _fail(code: int, message: str) -> None:
    err_console.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def handle_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """Map omniflow errors to one line on stderr and the documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except RedisUnavailable as exc:
            _fail(EXIT_REDIS, f"{exc} (is `omniflow up` running, or OMNIFLOW_REDIS_URL right?)")
        except RedisNotFound as exc:
            _fail(EXIT_REDIS, str(exc))
        except RedisError as exc:
            _fail(EXIT_REDIS, str(exc))
        except (ConfigError, PipelineError, InvalidRequest, WorkflowRetired, WorkflowNotFound,
                AdmissionRefused) as exc:
            _fail(EXIT_BAD_INPUT, str(exc))
        except (WorkflowError, OmniflowError) as exc:
            _fail(EXIT_BAD_INPUT, str(exc))
        raise AssertionError("unreachable")

    return wrapper


def _settings() -> Settings:
    return get_settings()


def _pipeline(path: Path | None = None) -> Pipeline:
    settings = _settings()
    return load_pipeline(path or settings.pipeline_path())


def _catalog(paths: Sequence[Path] | None = None) -> Catalog:
    """The pipelines this command serves: `--pipeline` (repeatable), else `OMNIFLOW_PIPELINE`."""
    return Catalog.load(list(paths or ()) or _settings().pipeline_paths())


def _run(coro_fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    """Run one coroutine with a client bound to this loop (redis-py errors come out translated)."""
    from omniflow.storage.redisio import boundary

    with boundary():
        return asyncio.run(coro_fn(*args))


async def _with_client(fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
    from omniflow.client import AsyncClient

    async with AsyncClient(settings=_settings(), pipeline=_catalog()) as client:
        return await fn(client, *args)


def _print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")


def print_result(doc: Any, line: str, *, as_json: bool) -> None:
    """A command's outcome: `doc` as one JSON document with `--json`, else one human line."""
    if as_json:
        _print_json(doc)
    else:
        console.print(line)


def print_rows(rows: list[dict[str, Any]], columns: tuple[str, ...], cells: Callable[[dict[str, Any]], list[str]],
               *, as_json: bool) -> None:
    """A listing: one JSON document with `--json`, else a table with `columns`, one row per item."""
    if as_json:
        _print_json(rows)
        return
    from rich.table import Table

    table = Table()
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*cells(row))
    console.print(table)
