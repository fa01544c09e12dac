"""`make demo`: one spoken answer from the real CPU omni pipeline, end to end through omniflow.

Starts `omniflow up --no-api --pipeline deploy/pipelines/omni-cpu.yaml` (embedded Valkey,
reconciler, one worker per stage: SmolLM2 Thinker, Piper Talker and Code2Wav), asks one
question, prints the answer as it streams, shows the time to first audio, writes the
spoken answer to `demo.wav`, draws the workflow's timeline and shuts everything down.

    python -m omniflow.ops.demo ["your question"]

The first run builds the model cache (SmolLM2 dequantised, the voice cut in two: about
half a minute); later runs start in seconds.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DEMO_HOME = Path(".omniflow/demo")
MODELS_DIR = Path(".omniflow/models")
PIPELINE = Path(__file__).resolve().parents[2] / "deploy" / "pipelines" / "omni-cpu.yaml"
QUESTION = "Why is the sky blue?"
OUT = Path("demo.wav")
READY_TIMEOUT_S = 600.0
ANSWER_TIMEOUT_S = 300.0


def omniflow(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omniflow.cli", *args], env=env, text=True, capture_output=True)


def wait_ready(env: dict[str, str], up: subprocess.Popen[bytes], stages: int) -> None:
    """Ready when every stage has a live worker (a worker's first heartbeat follows its model load)."""
    import json

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"omniflow up exited early with code {up.returncode}")
        if (DEMO_HOME / "redis.url").exists():
            res = omniflow("stats", "--json", env=env)
            if res.returncode == 0:
                doc = json.loads(res.stdout)
                live = [s for s, st in doc.get("stages", {}).items() if st.get("live_workers", 0) > 0]
                if len(live) >= stages:
                    return
        time.sleep(0.5)
    raise SystemExit("omniflow up did not become ready in time")


async def ask(question: str, redis_url: str) -> dict[str, object]:
    """Submit, print the answer as it streams, time first text and first audio, save the WAV."""
    from omniflow.client import AsyncClient

    from omniflow.pipeline import load_pipeline

    # the pipeline `up` serves: a client submits on the version it names (a workflow finishes on it)
    async with AsyncClient(redis_url, pipeline=load_pipeline(PIPELINE)) as client:
        started = time.monotonic()
        wf_id = await client.submit(question, modalities=["text", "audio"])
        first_text = first_audio = None
        print("answer: ", end="", flush=True)
        async for _, entry in client.events(wf_id, timeout_s=ANSWER_TIMEOUT_S):
            kind = entry.get("t")
            if kind == "text":
                first_text = first_text or time.monotonic() - started
                print(entry.get("delta", ""), end="", flush=True)
            elif kind == "audio" and first_audio is None:
                first_audio = time.monotonic() - started
                print(f" [first audio {first_audio:.2f}s]", end="", flush=True)
        total = time.monotonic() - started
        print()
        doc = await client.get(wf_id)
        seconds = await client.save_audio(wf_id, OUT) if doc["state"] == "completed" else 0.0
    return {"id": wf_id, "doc": doc, "first_text": first_text, "first_audio": first_audio, "total": total,
            "audio_s": seconds}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    question = " ".join(args).strip() or QUESTION
    env = {k: v for k, v in os.environ.items() if k != "OMNIFLOW_REDIS_URL"}
    env.update({"OMNIFLOW_HOME": str(DEMO_HOME), "OMNIFLOW_LOG_LEVEL": "WARNING",
                "OMNIFLOW_MODELS_DIR": str(Path(env.get("OMNIFLOW_MODELS_DIR", MODELS_DIR)).resolve())})
    shown = PIPELINE.relative_to(Path.cwd()) if PIPELINE.is_relative_to(Path.cwd()) else PIPELINE
    print(f"$ omniflow up --no-api --pipeline {shown}", flush=True)
    print("  (SmolLM2-135M thinker, Piper talker + code2wav on this CPU; the first start builds the "
          "model cache, ~30 s)", flush=True)
    t0 = time.monotonic()
    # up's own banner would land in the middle of the streamed answer: its stdout goes (errors still show)
    up = subprocess.Popen([sys.executable, "-m", "omniflow.cli", "up", "--no-api", "--pipeline", str(PIPELINE)],
                          env=env, stdout=subprocess.DEVNULL)
    try:
        wait_ready(env, up, stages=3)
        print(f"ready in {time.monotonic() - t0:.1f}s", flush=True)
        print(f"question: {question}", flush=True)
        redis_url = (DEMO_HOME / "redis.url").read_text().strip()
        result = asyncio.run(ask(question, redis_url))
        doc = result["doc"]
        assert isinstance(doc, dict)
        if doc["state"] != "completed":
            print(f"workflow {doc['state']}: {doc.get('error')}", file=sys.stderr)
            return 1
        audio_s = float(result["audio_s"])  # type: ignore[arg-type]
        total = float(result["total"])  # type: ignore[arg-type]
        print(f"time to first text {result['first_text']:.2f}s, time to first audio {result['first_audio']:.2f}s, "
              f"total {total:.2f}s for {audio_s:.1f}s of speech (RTF {total / max(audio_s, 1e-9):.2f})")
        print(f"audio: {audio_s:.2f}s written to {OUT}")
        print(f"$ omniflow inspect {result['id']}", flush=True)
        print(omniflow("inspect", str(result["id"]), env=env).stdout, end="")
        return 0
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()


if __name__ == "__main__":
    raise SystemExit(main())
