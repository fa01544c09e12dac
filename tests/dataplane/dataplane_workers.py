"""Helpers of the data-plane engine tests: what a prefix holds in shared memory and Redis, and worker
processes of the test engine (`omniflow worker` subprocesses: tests/dataplane on their PYTHONPATH)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from helpers import eventually, request

from omniflow.client.store import s
from omniflow.dataplane.shm import DEFAULT_SHM_DIR, ShmTransport


def segments(prefix: str, directory: Path = DEFAULT_SHM_DIR) -> list[str]:
    """Payloads of this prefix held in shared memory: segments, and arena slots in use."""
    return ShmTransport(prefix, directory=directory).payloads()


def files(prefix: str, directory: Path = DEFAULT_SHM_DIR) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(f"of-{prefix}-"))


async def blob_keys(eng: Any) -> list[bytes]:
    return [k async for k in eng.redis.scan_iter(match=f"{eng.settings.prefix}:*:wf:*:blob*", count=1000)]


def worker_of(eng: Any, stage: str) -> Any:
    return eng.workers[stage][0]


def worker_env(eng: Any, tmp_path: Path, spec: dict[str, Any], **extra: str) -> dict[str, str]:
    """The environment of an `omniflow` subprocess on the test engine (its server, prefix, pipeline)."""
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    here = str(Path(__file__).resolve().parent)
    env.update({"OMNIFLOW_REDIS_URL": eng.url, "OMNIFLOW_PREFIX": eng.settings.prefix,
                "OMNIFLOW_PIPELINE": str(path), "OMNIFLOW_HOME": str(tmp_path / "home"),
                "OMNIFLOW_LEASE_TIMEOUT_S": str(eng.settings.lease_timeout_s),
                "OMNIFLOW_HEARTBEAT_INTERVAL_S": str(eng.settings.heartbeat_interval_s),
                "PYTHONPATH": os.pathsep.join([here, env.get("PYTHONPATH", "")]), **extra})
    return env


def spawn_worker(eng: Any, tmp_path: Path, stage: str, spec: dict[str, Any], **extra: str) -> subprocess.Popen[bytes]:
    env = worker_env(eng, tmp_path, spec, **extra)
    return subprocess.Popen([sys.executable, "-m", "omniflow.cli", "worker", "--stage", stage], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


async def stage_seq(eng: Any, wf_id: str, field: str) -> int:
    return int(await eng.redis.hget(eng.store.keys.stages(wf_id), field) or 0)


async def at_least(eng: Any, wf_id: str, field: str, n: int) -> bool:
    return await stage_seq(eng, wf_id, field) >= n


async def reading(eng: Any, wf_id: str, stage: str = "dst") -> bool:
    """The consumer has its first chunk (its session went from waiting_input to running)."""
    return s(await eng.redis.hget(eng.store.keys.stages(wf_id), stage) or b"") == "running"


async def claimed(eng: Any, wf_id: str, stage: str = "dst") -> bool:
    """The session is bound to a replica: a producer asking where its consumer runs finds it."""
    return bool(await eng.redis.hget(eng.store.keys.stages(wf_id), f"{stage}:replica"))


async def consumer_first(eng: Any) -> Any:
    """Submit with the consumer's worker up and its session claimed before the producer's worker
    starts (both in the test process): a producer whose consumer is not claimed yet sends its chunks
    through Redis keys (where it runs is unknown; asked again after 0.5 s), so a test that needs
    them in shared memory from the first chunk on starts them in this order."""
    await eng.add_worker("dst")
    sub = await eng.store.submit(request("x"))
    await eventually(lambda: claimed(eng, sub.id), timeout_s=30)
    await eng.add_worker("src")
    return sub
