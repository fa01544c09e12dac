"""`make demo`: run `omniflow up` on the toy pipeline, submit one text+audio
request, print the text, write the WAV, show the timeline, shut down."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DEMO_HOME = Path(".omniflow/demo")
PROMPT = "Tell me why durable queues matter for omni models"
OUT = Path("demo.wav")


def omniflow(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omniflow.cli", *args], env=env, text=True, capture_output=True)


def wait_ready(env: dict[str, str], up: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Ready when Redis answers and every stage has a live worker."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"omniflow up exited early with code {up.returncode}")
        if (DEMO_HOME / "redis.url").exists():
            res = omniflow("stats", "--json", env=env)
            if res.returncode == 0 and '"live_workers": 0' not in res.stdout:
                return
        time.sleep(0.3)
    raise SystemExit("omniflow up did not become ready in time")


def main() -> int:
    env = {k: v for k, v in os.environ.items() if k != "OMNIFLOW_REDIS_URL"}
    env.update({"OMNIFLOW_HOME": str(DEMO_HOME), "OMNIFLOW_LOG_LEVEL": "WARNING"})
    print("$ omniflow up --no-api   (embedded Valkey, reconciler, one worker per stage)", flush=True)
    up = subprocess.Popen([sys.executable, "-m", "omniflow.cli", "up", "--no-api"], env=env)
    try:
        wait_ready(env, up)
        print(f'$ omniflow submit "{PROMPT}" --modalities text,audio --wait --out {OUT}', flush=True)
        res = omniflow("submit", PROMPT, "--modalities", "text,audio", "--wait", "--out", str(OUT), "--json", env=env)
        if res.returncode != 0:
            print(res.stdout, res.stderr, file=sys.stderr)
            return res.returncode
        import json

        doc = json.loads(res.stdout)
        print(f"text:  {doc['outputs']['thinker']['text']}")
        print(f"audio: {doc['audio_seconds']:.2f}s written to {OUT}")
        print(f"$ omniflow inspect {doc['id']}", flush=True)
        res = omniflow("inspect", doc["id"], env=env)
        print(res.stdout, end="")
        return 0 if doc["state"] == "completed" else 1
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()


if __name__ == "__main__":
    raise SystemExit(main())
