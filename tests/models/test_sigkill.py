"""SIGKILL the Thinker's worker process mid-stream: the retry prefills prompt + the checkpointed
tokens and the client sees exactly the text of an uninterrupted run (tiny random Llama)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from helpers import eventually
from omniflow.testing import FakeSession, run_executor
from omniflow.workers.thinker import HFThinker

from .test_executors import PROMPT, _request, tiny_spec

TESTS = Path(__file__).resolve().parents[1]
PARAMS = {"max_tokens": 40, "temperature": 1.0, "seed": 1}


@pytest.mark.chaos
@pytest.mark.timeout(180)
async def test_sigkill_mid_stream_resumes_to_the_uninterrupted_text(engine_factory, tiny_lm_dir: Path,
                                                                   tmp_path: Path) -> None:
    reference = FakeSession(input={"text": PROMPT}, stage="thinker", params=PARAMS)
    await run_executor(HFThinker(stage="thinker", params={"model": str(tiny_lm_dir), "clause_min_words": 2,
                                                          "clause_max_words": 6}), reference, setup=True)
    spec: dict[str, Any] = tiny_spec(tiny_lm_dir, step_delay_s=0.15)
    spec["stages"]["thinker"]["executor"] = "models.executor_fixtures:SlowThinker"
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    procs: list[subprocess.Popen[bytes]] = []
    async with engine_factory(spec, workers=False) as eng:
        await eng.add_worker("talker")
        s = eng.settings
        env = {**os.environ, "OMNIFLOW_REDIS_URL": eng.url, "OMNIFLOW_PREFIX": s.prefix,
               "OMNIFLOW_PIPELINE": str(pipeline), "OMNIFLOW_HEARTBEAT_INTERVAL_S": str(s.heartbeat_interval_s),
               "OMNIFLOW_LEASE_TIMEOUT_S": str(s.lease_timeout_s), "OMNIFLOW_BLOCK_MS": "1000",
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}

        def thinker_worker() -> subprocess.Popen[bytes]:
            proc = subprocess.Popen([sys.executable, "-m", "omniflow.cli", "worker", "--stage", "thinker"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=(tmp_path / f"w{len(procs)}.log").open("wb"))
            procs.append(proc)
            return proc

        try:
            first = thinker_worker()
            sub = await eng.store.submit(_request(PROMPT))

            async def streaming() -> bool:
                log = await eng.store.read_log(sub.id)
                return sum(1 for _, e in log if e.get("t") == "text" and e.get("stage") == "thinker") >= 5
            await eventually(streaming, timeout_s=90, interval_s=0.05)
            first.send_signal(signal.SIGKILL)            # mid-stream: some text written, most not
            first.wait(10)
            thinker_worker()
            doc = await eng.store.wait(sub.id, timeout_s=90)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(15)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(5)
    assert doc["state"] == "completed", doc
    assert doc["stages"]["thinker"]["attempt"] == 2
    assert doc["stages"]["thinker"]["usage"]["resumed_at"] > 0            # it continued, it did not start over
    assert doc["outputs"]["thinker"]["text"] == reference.text_out          # nothing repeated, nothing missing
    assert doc["outputs"]["talker"]["text"] == reference.text_out
