"""`omniflow up` as a user runs it: embedded Valkey, supervised children, clean shutdown."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_until


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omniflow.cli", *args], env=env, text=True, capture_output=True,
                          timeout=60)


def live_workers(env: dict[str, str]) -> dict[str, int]:
    res = cli("stats", "--json", env=env)
    if res.returncode != 0:
        return {}
    return {name: st["live_workers"] for name, st in json.loads(res.stdout)["stages"].items()}


def worker_pids(up_pid: int, stage: str) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(up_pid), "-f", f"worker --stage {stage}"], text=True,
                         capture_output=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_up_restarts_a_killed_worker_and_shuts_down_cleanly(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env.update({"OMNIFLOW_HOME": str(tmp_path / "home"), "OMNIFLOW_LOG_LEVEL": "WARNING",
                "OMNIFLOW_LEASE_TIMEOUT_S": "1.0", "OMNIFLOW_HEARTBEAT_INTERVAL_S": "0.2"})
    up = subprocess.Popen([sys.executable, "-m", "omniflow.cli", "up", "--no-api"], env=env, cwd=tmp_path)
    try:
        wait_until(lambda: live_workers(env) == {"thinker": 1, "talker": 1, "code2wav": 1})
        assert (tmp_path / "home" / "valkey" / "appendonlydir").is_dir()      # AOF on, data under OMNIFLOW_HOME
        victim = wait_until(lambda: worker_pids(up.pid, "talker"))[0]
        os.kill(victim, signal.SIGKILL)
        replacement = wait_until(lambda: [p for p in worker_pids(up.pid, "talker") if p != victim])
        assert replacement
        wait_until(lambda: live_workers(env).get("talker") == 1)
        res = cli("submit", "after a crash", "--modalities", "text,audio", "--wait", "--json", env=env)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["state"] == "completed"
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    assert up.returncode == 0
    assert not (tmp_path / "home" / "redis.url").exists()
    assert cli("ls", env=env).returncode == 3          # everything is down, and the CLI says so


def test_up_colocate_runs_one_worker_process_per_replica_serving_every_stage(tmp_path: Path) -> None:
    from omniflow.config import Settings
    from omniflow.pipeline import build_pipeline
    from omniflow.ops.up import Supervisor

    from conftest import toy_spec

    spec = toy_spec()
    spec["stages"]["talker"]["replicas"] = 2
    pipe = build_pipeline(spec)
    plan = {c.name: c.argv[-2:] for c in Supervisor(settings=Settings(), pipeline=pipe, pipeline_path=tmp_path / "p.yaml",
                                                      colocate=True).plan_children() if c.name.startswith("worker")}
    assert plan == {"worker:all:0": ["--stage", "all"], "worker:all:1": ["--stage", "all"]}
    separate = [c.name for c in Supervisor(settings=Settings(), pipeline=pipe, pipeline_path=tmp_path / "p.yaml")
                .plan_children() if c.name.startswith("worker")]
    assert separate == ["worker:thinker:0", "worker:talker:0", "worker:talker:1", "worker:code2wav:0"]
