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
from conftest import toy_spec
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
    (["submit", ""], "TEXT: the prompt is empty"),
    (["submit", " \t "], "TEXT: the prompt is empty"),
    (["submit", "x", "--modalities", "text,text"], "--modalities: text given twice"),
    (["submit", "x", "--modalities", ","], "--modalities: give at least one"),
    (["submit", "x", "--deadline", "-1"], "--deadline: -1 is not a positive number"),
    (["submit", "x", "--deadline", "0"], "--deadline: 0 is not a positive number"),
    (["submit", "x", "--request-id", "bad id/x"], "--request-id: 'bad id/x' must be"),
    (["submit", "x", "--out", "/nonexistent-dir/a.wav"], "--out: folder /nonexistent-dir does not exist"),
    (["submit", "x", "--modalities", "text", "--out", "a.wav"], "--out: this request produces no audio"),
    (["submit", "x", "--wait", "--timeout", "0"], "--timeout: 0 is not a positive number"),
    (["ls", "--state", "weird"], "--state: 'weird' is not one of"),
    (["ls", "--stage", "nope"], "--stage: unknown stage 'nope'"),
    (["ls", "--since", "ten minutes"], "'ten minutes' is not a duration"),
    (["ls", "--since", "-5m"], "a duration must be positive"),
    (["inspect", "no-such-id"], "no workflow no-such-id"),
    (["purge"], "--older-than DURATION"),
    (["purge", "--older-than", "1d", "--all"], "--older-than DURATION"),
    (["purge", "--older-than", "1d", "--state", "running"], "'running' is not a finished state"),
    (["dlq", "ls", "bogus"], "unknown stage 'bogus'"),
    (["dlq", "ls", "--stage", "bogus"], "unknown stage 'bogus'"),
    (["dlq", "replay", "bogus"], "unknown stage 'bogus'"),
    (["dlq", "replay"], "give a STAGE (or --stage), or --all"),
    (["dlq", "drop", "thinker", "--all"], "give a STAGE (or --stage), or --all"),
    (["drain", "no-such-worker"], "no live worker 'no-such-worker'"),
    (["submit", "x", "--priority", "urgent"], "--priority: unknown priority 'urgent'"),
    (["tenants", "weight", "acme", "0"], "weight 0.0 is out of range"),
    (["tenants", "weight", "acme", "5000"], "weight 5000.0 is out of range"),
    (["tenants", "weight", "acme", "lots"], "weight 'lots' is not a number"),
    (["tenants", "weight", "acme"], "give a WEIGHT or --reset"),
    (["tenants", "weight", "a,b", "2"], "bad tenant name 'a,b'"),
])
async def test_cli_bad_input_exits_2_with_one_clear_line(engine_factory, cli_env, args, message) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        code, stdout, stderr = await omniflow(*args, env=cli_env(eng))
        assert code == 2, stderr
        assert message in stderr and stderr.count("\n") == 1 and "Traceback" not in stderr
        assert await eng.redis.zcard(eng.store.keys.all_wf(0)) == 0           # nothing ran


async def test_cli_priority_over_the_tenants_allowance_exits_2(engine_factory, cli_env) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        env = {**cli_env(eng), "OMNIFLOW_TENANT_PRIORITIES": "default=api"}
        code, _, stderr = await omniflow("submit", "x", "--priority", "interactive", env=env)
        assert code == 2 and "above what tenant 'default' may ask for" in stderr
        code, out, _ = await omniflow("submit", "x", "--priority", "batch", "--json", env=env)
        assert code == 0
        assert (await eng.store.document(json.loads(out)["id"]))["priority"] == "batch"


async def test_cli_tenants_weight_is_set_live_and_listed(engine_factory, cli_env) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        env = {**cli_env(eng), "OMNIFLOW_TENANT_WEIGHTS": "gold=3"}
        code, out, err = await omniflow("tenants", "weight", "acme", "2.5", "--json", env=env)
        assert code == 0, err
        assert json.loads(out)["weight"] == 2.5 and json.loads(out)["source"] == "live"
        code, out, _ = await omniflow("tenants", "ls", "--json", env=env)
        rows = {r["tenant"]: r for r in json.loads(out)}
        assert rows["acme"]["weight"] == 2.5 and rows["gold"] == {**rows["gold"], "weight": 3.0, "source": "config"}
        code, out, _ = await omniflow("tenants", "weight", "acme", "--reset", "--json", env=env)
        assert code == 0 and json.loads(out)["source"] == "default"


async def test_cli_non_utf8_argument_exits_2(engine_factory, cli_env) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "omniflow.cli", "submit", b"caf\xe9 \xff", env=cli_env(eng),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 2 and b"is not valid UTF-8" in err and b"Traceback" not in err
        assert await eng.redis.zcard(eng.store.keys.all_wf(0)) == 0


async def test_cli_wait_running_out_of_time_exits_4_and_says_so(engine_factory, cli_env, tmp_path) -> None:
    slow = toy_spec(thinker={"token_delay_s": 0.3})
    async with engine_factory(slow) as eng:
        env = cli_env(eng)
        (tmp_path / "slow.yaml").write_text(yaml.safe_dump(slow))      # the CLI submits the slow params
        env["OMNIFLOW_PIPELINE"] = str(tmp_path / "slow.yaml")
        code, stdout, stderr = await omniflow("submit", "slow one", "--wait", "--timeout", "0.5", env=env)
        assert code == 4 and "is still running after 0.5s" in stderr
        assert "None Hz" not in stdout and "(partial)" in stdout
        code, stdout, _ = await omniflow("submit", "slow json", "--wait", "--timeout", "0.5", "--json", env=env)
        assert code == 4 and json.loads(stdout)["state"] in ("pending", "running")


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
@pytest.mark.timeout(600)
async def test_make_demo_script_runs_end_to_end(tmp_path) -> None:
    """`make demo`: the TTS pipeline says the question, the real CPU omni pipeline hears it (Whisper),
    answers, speaks the answer and shuts down (models from the project's cache, which the first run builds)."""
    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env["OMNIFLOW_MODELS_DIR"] = os.environ.get("OMNIFLOW_MODELS_DIR", str(repo / ".omniflow" / "models"))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "omniflow.ops.demo", "What is a cat?",
                                                cwd=str(tmp_path), env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 540)
    text = out.decode()
    assert proc.returncode == 0, text
    assert "question: What is a cat?" in text and "answer: " in text
    heard = text.split("heard: ", 1)[1].split("\n", 1)[0].lower()
    assert "cat" in heard, text                          # what Whisper heard the TTS pipeline say
    assert sf.info(str(tmp_path / "demo-question.wav")).duration > 0.5
    assert "time to first audio" in text
    data, rate = sf.read(str(tmp_path / "demo.wav"), dtype="int16")
    assert rate == 22050 and len(data) > 2 * rate      # a spoken answer, seconds long
    assert "completed" in text and "terminal" in text
    assert not (tmp_path / ".omniflow" / "demo" / "redis.url").exists()   # shut down cleanly


def test_an_audio_output_not_produced_yet_is_never_printed_with_none() -> None:
    from omniflow.cli import _output_line

    line = _output_line("code2wav", {"type": "audio", "sample_rate": None, "duration_s": 0.0, "partial": True}, None)
    assert line.endswith("no audio yet") and "None" not in line
