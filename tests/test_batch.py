"""Batch jobs end to end: a JSONL file through arq jobs into real workflows, and the CLI as a subprocess."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from omniflow.jobs.batch import batch_status, parse_batch_file, submit_batch, wait_batch
from omniflow.cli import app
from omniflow.config import Settings
from omniflow.errors import InvalidRequest
from omniflow.jobs.queue import create_job_pool
from omniflow.pipeline import build_pipeline

from conftest import toy_spec
from helpers import cli_env, eventually, run_cli
from jobs_support import FAST, jobs_runner

FAIL = {"thinker": {"fail_at_step": 1, "fail_retryable": False}}


def write_jsonl(path: Path, *lines: object) -> Path:
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


async def submit_file(eng, path: Path) -> dict:
    parsed = parse_batch_file(path, eng.pipeline, eng.settings)
    pool = await create_job_pool(eng.url, eng.settings)
    try:
        return await submit_batch(eng.store, pool, parsed)
    finally:
        await pool.aclose()


async def run_batch(eng, path: Path) -> dict:
    created = await submit_file(eng, path)
    return await wait_batch(eng.store, created["id"], timeout_s=20)


# ---------------------------------------------------------------- parsing (no Redis)
def test_parse_reports_bad_lines_by_number(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "b.jsonl",
                       {"text": "one"}, "", {"input": {"text": "two"}, "output_modalities": ["text"]},
                       "{not json", [1, 2], {"input": "three", "output_modalities": ["video"]},
                       {"text": "x", "stage_params": {"nope": {}}}, {"text": ""}, {"input": "four", "deadline_s": 5})
    parsed = parse_batch_file(path, build_pipeline(toy_spec()), Settings())
    assert sorted(parsed.requests) == [1, 3, 9]
    assert parsed.requests[1].input.text == "one" and parsed.requests[9].deadline_s == 5
    assert sorted(parsed.errors) == [4, 5, 6, 7, 8] and parsed.total == 8
    assert "not JSON" in parsed.errors[4] and "JSON object" in parsed.errors[5]
    assert "video" in parsed.errors[6] and "nope" in parsed.errors[7] and "input.text" in parsed.errors[8]


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read"), (b"\xff\xfe\x00binary", "UTF-8"), (b"", "empty file"),
    (b"hello\nworld\n", "no valid JSONL request line"), (b'{"nope": 1}\n', "line 1"),
])
def test_parse_refuses_unusable_files(tmp_path: Path, content: bytes | None, message: str) -> None:
    path = tmp_path / "in.jsonl"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InvalidRequest, match=message):
        parse_batch_file(path, build_pipeline(toy_spec()), Settings())


# ---------------------------------------------------------------- end to end
async def test_batch_runs_every_line_and_reports_bad_ones(engine_factory, tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "b.jsonl", {"text": "alpha"},
                       {"input": {"text": "beta"}, "output_modalities": ["text"]}, "{oops",
                       {"text": "gamma", "stage_params": FAIL}, {"text": "delta", "request_id": "batch-d"})
    async with engine_factory(**FAST) as eng, jobs_runner(eng):
        doc = await run_batch(eng, path)
        assert doc["state"] == "failed"
        assert {k: doc[k] for k in ("total", "submitted", "completed", "failed", "invalid")} == {
            "total": 5, "submitted": 4, "completed": 3, "failed": 2, "invalid": 1}
        lines = {row["line"]: row for row in doc["lines"]}
        assert [lines[n]["state"] for n in range(1, 6)] == ["completed", "completed", "invalid", "failed", "completed"]
        assert lines[3]["workflow_id"] is None and "not JSON" in lines[3]["error"]
        assert "injected failure" in lines[4]["error"]
        for n in (1, 2, 4, 5):
            wf = await eng.store.document(lines[n]["workflow_id"])
            assert wf["state"] == lines[n]["state"]
        assert (await eng.store.document(lines[2]["workflow_id"]))["final_stages"] == ["thinker"]
        assert (await eng.store.document(lines[5]["workflow_id"]))["request_id"] == "batch-d"


async def test_batch_waits_for_admission_and_survives_slices(engine_factory, tmp_path: Path) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.03})
    path = write_jsonl(tmp_path / "b.jsonl", *({"text": f"line {i}", "output_modalities": ["text"]} for i in range(6)))
    async with engine_factory(spec, **FAST, max_in_flight=2, batch_slice_s=0.3, batch_chunk_lines=4) as eng, \
            jobs_runner(eng) as runner:
        doc = await run_batch(eng, path)
        assert doc["state"] == "completed"
        assert (doc["total"], doc["submitted"], doc["completed"], doc["failed"]) == (6, 6, 6, 0)
        assert len({row["workflow_id"] for row in doc["lines"]}) == 6
        assert runner.worker is not None and runner.worker.jobs_retried >= 2      # several slices ran


async def test_batch_resumes_in_a_new_runner_after_a_stop(engine_factory, tmp_path: Path) -> None:
    spec = toy_spec(thinker={"token_delay_s": 0.05})
    path = write_jsonl(tmp_path / "b.jsonl",
                       *({"text": f"resume {i}", "output_modalities": ["text"]} for i in range(4)))
    async with engine_factory(spec, **FAST, jobs_grace_s=0.0) as eng:
        created = await submit_file(eng, path)
        async def submitted() -> bool:
            return (await batch_status(eng.store, created["id"], lines=False))["submitted"] >= 1

        async with jobs_runner(eng):                  # once lines are submitted (still running), it stops
            await eventually(submitted, timeout_s=15, what="a first line of the batch submitted")
        mid = await batch_status(eng.store, created["id"])
        assert mid["state"] == "running" and mid["submitted"] >= 1
        async with jobs_runner(eng):
            doc = await wait_batch(eng.store, created["id"], timeout_s=20)
        assert doc["state"] == "completed" and (doc["submitted"], doc["completed"]) == (4, 4)


# ---------------------------------------------------------------- the CLI, as a subprocess
async def cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    registered = any(group.name == "batch" for group in app.registered_groups)
    argv = ["-m", "omniflow.cli", "batch"] if registered else ["-m", "omniflow.cli.batch"]
    return await run_cli(*argv, *args, env=env)


async def test_cli_batch_submit_wait_json_and_exit_codes(engine_factory, tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", {"text": "cli one"}, {"text": "cli two", "output_modalities": ["text"]})
    mixed = write_jsonl(tmp_path / "mixed.jsonl", {"text": "cli three"}, "[]")
    junk = write_jsonl(tmp_path / "junk.jsonl", "this is not json")
    async with engine_factory(**FAST) as eng, jobs_runner(eng):
        env = cli_env(eng, tmp_path)
        no_redis = {**env, "OMNIFLOW_REDIS_URL": "redis://127.0.0.1:1/0"}
        (code, out, err), mixed_run, junk_run, down_run = await asyncio.gather(   # 4 processes at once
            cli("submit", str(good), "--wait", "--json", env=env),
            cli("submit", str(mixed), "--wait", "--json", env=env),
            cli("submit", str(junk), env=env),
            cli("submit", str(good), env=no_redis))
        assert code == 0, err
        doc = json.loads(out)
        assert doc["state"] == "completed" and doc["completed"] == 2
        assert [row["state"] for row in doc["lines"]] == ["completed", "completed"]
        assert (await batch_status(eng.store, doc["id"]))["completed"] == 2
        code, out, _ = mixed_run
        assert code == 1 and json.loads(out)["state"] == "failed"
        assert json.loads(out)["invalid_lines"] == [{"line": 2, "error": "expected a JSON object, got list"}]
        code, _, err = junk_run
        assert code == 2 and "no valid JSONL request line" in err
        code, _, err = down_run
        assert code == 3 and "Redis" in err
        code, out, err = await cli("status", doc["id"], "--json", env=env)
        assert code == 0 and json.loads(out)["id"] == doc["id"]
