"""Small test helpers shared by test modules."""
from __future__ import annotations

import asyncio
import inspect
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from omniflow.models import SubmitRequest, WorkflowInput
from omniflow.client.store import Store
from omniflow.storage.schema import s
from omniflow.workers.toy import reply_words


def request(text: str = "hello world", modalities: list[str] | None = None, **kwargs: Any) -> SubmitRequest:
    return SubmitRequest(input=WorkflowInput(text=text), output_modalities=modalities, **kwargs)


async def run_to_end(store: Store, req: SubmitRequest, *, timeout_s: float = 15.0) -> dict[str, Any]:
    """Submit and wait for the terminal state; the document (its `id` names the workflow)."""
    sub = await store.submit(req)
    return await store.wait(sub.id, timeout_s=timeout_s)


def expected_text(prompt: str, max_words: int = 8) -> str:
    return " ".join(reply_words(prompt, max_words))


async def eventually(check: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.02,
                     what: str = "") -> Any:
    """Poll `check` (sync, or returning an awaitable) until it gives a truthy value, which is returned;
    past `timeout_s`, an AssertionError that says what was waited for (`what`). Test-side only: the
    engine never polls.

    The async twin of `wait_until`: the test's event loop keeps running between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout_s}s (last value {value!r})")
        await asyncio.sleep(interval_s)


def wait_until(check: Callable[[], Any], *, timeout_s: float = 40.0, interval_s: float = 0.2, what: str = "") -> Any:
    """`eventually` for synchronous checks (processes, the CLI): poll until `check` is truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"{what or 'condition'} not met within {timeout_s}s")


async def log_entries(store: Store, wf_id: str) -> list[dict[str, str]]:
    return [fields for _, fields in await store.read_log(wf_id)]


def text_steps(log: list[dict[str, str]]) -> list[int]:
    """The step seqs the log's text entries cover, in order (one entry covers steps `from`..`seq`)."""
    return [n for f in log if f.get("t") == "text" for n in range(int(f.get("from") or f["seq"]), int(f["seq"]) + 1)]


async def terminal_count(store: Store, wf_id: str) -> int:
    return sum(1 for f in await log_entries(store, wf_id) if f.get("t") == "terminal")


async def stage_status(store: Store, wf_id: str, stage: str) -> str:
    return s(await store.client.hget(store.keys.stages(wf_id), stage))


async def run_cli(*argv: str, env: dict[str, str]) -> tuple[int, str, str]:
    """`python <argv>` as a subprocess (e.g. `-m omniflow.cli submit ...`): (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def omniflow(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    """The `omniflow` CLI, run as a user runs it."""
    return await run_cli("-m", "omniflow.cli", *args, env=env)


def cli_env(eng: Any, tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment a CLI subprocess needs to reach the test engine (its server, prefix, pipeline)."""
    from conftest import toy_spec

    pipeline = tmp_path / "pipeline.yaml"
    # the engine's own pipeline: a client submits on the version it loads, and only workers of that
    # version serve it (a workflow finishes on the version it started with)
    served = getattr(eng, "pipeline", None)
    default = getattr(served, "default", served)
    pipeline.write_text(yaml.safe_dump(default.canonical() if hasattr(default, "canonical") else toy_spec()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env.update({"OMNIFLOW_REDIS_URL": eng.url, "OMNIFLOW_PREFIX": eng.settings.prefix,
                "OMNIFLOW_PIPELINE": str(pipeline), "OMNIFLOW_HOME": str(tmp_path / "home"), **extra})
    return env


def metric_values(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus text exposition as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(exposition) for sample in family.samples}
