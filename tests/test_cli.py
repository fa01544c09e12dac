"""The CLI, run as a real subprocess against a real server and in-process workers."""
from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import soundfile as sf
import yaml

import helpers
from helpers import omniflow


@pytest.fixture
def cli_env(tmp_path: Path):
    return lambda eng: helpers.cli_env(eng, tmp_path)


async def test_cli_submit_wait_round_trip_writes_audio(engine_factory, cli_env, tmp_path) -> None:
    async with engine_factory() as eng:
        env = cli_env(eng)
        out = tmp_path / "a.wav"
        code, stdout, stderr = await omniflow("submit", "hello from the cli", "--modalities", "text,audio",
                                              "--wait", "--out", str(out), "--json", env=env)
        assert code == 0, stderr
        doc = json.loads(stdout)
        assert doc["state"] == "completed"
        assert doc["outputs"]["thinker"]["text"].startswith("You said: hello from the cli")
        data, rate = sf.read(str(out), dtype="int16")
        assert rate == 22050 and len(data) == round(doc["outputs"]["code2wav"]["duration_s"] * rate)
        code, stdout, _ = await omniflow("inspect", doc["id"], "--json", env=env)
        assert code == 0
        events = [row["event"] for row in json.loads(stdout)["timeline"]]
        assert events[0] == "state" and events[-1] == "terminal" and "text" in events and "audio" in events
        code, stdout, _ = await omniflow("ls", "--state", "completed", "--json", env=env)
        assert [row["id"] for row in json.loads(stdout)] == [doc["id"]]


async def test_cli_abort_then_exit_code_and_retry(engine_factory, cli_env) -> None:
    async with engine_factory(workers=False) as eng:
        env = cli_env(eng)
        code, stdout, _ = await omniflow("submit", "never runs", "--json", env=env)
        wf_id = json.loads(stdout)["id"]
        code, stdout, _ = await omniflow("abort", wf_id, "--json", env=env)
        assert code == 0 and json.loads(stdout) == {"id": wf_id, "state": "aborted"}
        code, stdout, _ = await omniflow("retry", wf_id, "--json", env=env)
        assert code == 0 and json.loads(stdout)["retry_of"] == wf_id
        code, stdout, _ = await omniflow("stats", "--json", env=env)
        assert json.loads(stdout)["in_flight"] == 1


@pytest.mark.parametrize("args,message", [
    (["submit", "x", "--modalities", "video"], "'video' is not produced"),
    (["submit", "x", "--out", "a.mp3"], "--out: a.mp3 must end in .wav"),
    (["ls", "--state", "weird"], "--state: 'weird' is not one of"),
    (["inspect", "no-such-id"], "no workflow no-such-id"),
    (["purge"], "--yes"),
])
async def test_cli_bad_input_exits_2_with_a_clear_message(engine_factory, cli_env, args, message) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        code, _, stderr = await omniflow(*args, env=cli_env(eng))
        assert code == 2
        assert message in " ".join(stderr.split())


async def test_cli_without_redis_exits_3_saying_how_to_start_one(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env["OMNIFLOW_HOME"] = str(tmp_path)
    code, _, stderr = await omniflow("ls", env=env)
    assert code == 3 and "omniflow up" in stderr
    env["OMNIFLOW_REDIS_URL"] = "redis://127.0.0.1:1/0"
    code, _, stderr = await omniflow("ls", env=env)
    assert code == 3 and "unreachable" in stderr


async def test_cli_bad_pipeline_yaml_exits_2(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "x", "stages": {"a": {"executor": "m:C"}},
                                   "edges": [{"from": "a", "to": "b"}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env.update({"OMNIFLOW_PIPELINE": str(bad), "OMNIFLOW_REDIS_URL": "redis://127.0.0.1:1/0"})
    code, _, stderr = await omniflow("ls", env=env)
    assert code == 2 and "edges[0].to: unknown stage 'b'" in stderr


@pytest.mark.slow
async def test_make_demo_script_runs_end_to_end(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    repo = Path(__file__).resolve().parent.parent
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "omniflow.demo", cwd=str(tmp_path), env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    assert "text:  You said: Tell me why durable queues matter" in text
    data, rate = sf.read(str(tmp_path / "demo.wav"), dtype="int16")
    assert rate == 22050 and len(data) > rate      # over a second of audio
    assert "completed" in text and "terminal" in text
    assert not (tmp_path / ".omniflow" / "demo" / "redis.url").exists()   # shut down cleanly
    assert repo.exists()
