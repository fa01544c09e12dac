"""`make demo`: a spoken question heard and answered aloud by the real CPU pipelines, through omniflow.

Starts `omniflow up --no-api --pipeline deploy/pipelines/omni-cpu.yaml` (embedded Valkey,
reconciler, one worker per stage: Whisper ASR, SmolLM2 Thinker, Piper Talker and Code2Wav) and,
on the same Valkey under its own key prefix, the tts-cpu pipeline (one worker serving its Talker
and Code2Wav, and a reconciler). The question is said by the TTS pipeline (written to
`demo-question.wav`), streamed into an omni-cpu workflow as audio, and what Whisper heard is
printed; then the answer is printed as it streams, with the time to first audio, the spoken
answer is written to `demo.wav`, the workflow's timeline drawn, and everything shut down.

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
TTS_PIPELINE = PIPELINE.with_name("tts-cpu.yaml")
TTS_PREFIX = "ofdemo-tts"        # the TTS deployment's keys, beside omni-cpu's on the same Valkey
QUESTION = "Why is the sky blue?"
OUT = Path("demo.wav")
QUESTION_OUT = Path("demo-question.wav")
READY_TIMEOUT_S = 600.0
ANSWER_TIMEOUT_S = 300.0


def omniflow(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omniflow.cli", *args], env=env, text=True, capture_output=True)


def wait_ready(env: dict[str, str], up: subprocess.Popen[bytes], stages: int,
               others: tuple[subprocess.Popen[bytes], ...] = ()) -> None:
    """Ready when every stage has a live worker (a worker's first heartbeat follows its model load)."""
    import json

    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc in (up, *others):
            if proc.poll() is not None:
                raise SystemExit(f"{proc.args!r} exited early with code {proc.returncode}")
        if (DEMO_HOME / "redis.url").exists():
            res = omniflow("stats", "--json", env=env)
            if res.returncode == 0:
                doc = json.loads(res.stdout)
                live = [s for s, st in doc.get("stages", {}).items() if st.get("live_workers", 0) > 0]
                if len(live) >= stages:
                    return
        time.sleep(0.5)
    raise SystemExit("omniflow up did not become ready in time")


async def say(question: str, redis_url: str) -> tuple[int, object]:
    """The question as speech, made by the TTS pipeline (its own deployment on the same Valkey)."""
    from omniflow.client import AsyncClient
    from omniflow.config import Settings
    from omniflow.pipeline import load_pipeline

    settings = Settings(redis_url=redis_url, prefix=TTS_PREFIX)
    async with AsyncClient(redis_url, settings=settings, pipeline=load_pipeline(TTS_PIPELINE)) as tts:
        wf_id = await tts.submit(question, modalities=["audio"])
        doc = await tts.wait(wf_id, timeout_s=ANSWER_TIMEOUT_S)
        if doc["state"] != "completed":
            raise SystemExit(f"the TTS workflow {doc['state']}: {doc.get('error')}")
        await tts.save_audio(wf_id, QUESTION_OUT)
        return await tts.audio(wf_id)


def heard_of(doc: dict[str, object]) -> str:
    """What the ASR stage heard (its segments, from its usage)."""
    stages = doc.get("stages")
    usage = stages.get("asr", {}).get("usage") if isinstance(stages, dict) else None
    timeline = usage.get("timeline", []) if isinstance(usage, dict) else []
    return " ".join(str(seg.get("text", "")) for seg in timeline if isinstance(seg, dict))


async def ask(question: str, redis_url: str) -> dict[str, object]:
    """Say the question, stream it in as audio, print what was heard and the answer as it streams,
    time first text and first audio, save the WAV."""
    import numpy as np

    from omniflow.client import AsyncClient

    rate, spoken = await say(question, redis_url)
    assert isinstance(spoken, np.ndarray)
    print(f"said: {spoken.size / rate:.2f}s of speech by the TTS pipeline ({QUESTION_OUT})", flush=True)
    from omniflow.pipeline import load_pipeline

    # the pipeline `up` serves: a client submits on the version it names (a workflow finishes on it)
    async with AsyncClient(redis_url, pipeline=load_pipeline(PIPELINE)) as client:
        started = time.monotonic()
        wf_id = await client.submit(modalities=["text", "audio"], audio_sample_rate=rate)
        step = rate // 5             # 200 ms pieces, as a microphone would stream them
        await client.append_input(wf_id, [spoken[i:i + step] for i in range(0, spoken.size, step)], final=True)
        first_text = first_audio = None
        async for _, entry in client.events(wf_id, timeout_s=ANSWER_TIMEOUT_S):
            kind = entry.get("t")
            if kind == "stage" and entry.get("stage") == "asr" and entry.get("status") == "done":
                print(f"heard: {heard_of(await client.get(wf_id))} [{time.monotonic() - started:.2f}s]", flush=True)
                print("answer: ", end="", flush=True)
            elif kind == "text":
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
    env.update({"OMNIFLOW_HOME": str(DEMO_HOME), "OMNIFLOW_LOG_LEVEL": "WARNING", "OMNIFLOW_PIPELINE": str(PIPELINE),
                "OMNIFLOW_MODELS_DIR": str(Path(env.get("OMNIFLOW_MODELS_DIR", MODELS_DIR)).resolve())})
    shown = PIPELINE.relative_to(Path.cwd()) if PIPELINE.is_relative_to(Path.cwd()) else PIPELINE
    print(f"$ omniflow up --no-api --pipeline {shown}", flush=True)
    print("  (Whisper base ASR, SmolLM2-135M thinker, Piper talker + code2wav on this CPU; the first start "
          "builds the model cache, ~30 s)", flush=True)
    t0 = time.monotonic()
    # up's own banner would land in the middle of the streamed answer: its stdout goes (errors still show)
    up = subprocess.Popen([sys.executable, "-m", "omniflow.cli", "up", "--no-api", "--pipeline", str(PIPELINE)],
                          env=env, stdout=subprocess.DEVNULL)
    tts: list[subprocess.Popen[bytes]] = []
    try:
        while not (DEMO_HOME / "redis.url").exists() and up.poll() is None:
            time.sleep(0.2)
        redis_url = (DEMO_HOME / "redis.url").read_text().strip() if up.poll() is None else ""
        tts_env = {**env, "OMNIFLOW_REDIS_URL": redis_url, "OMNIFLOW_PREFIX": TTS_PREFIX,
                   "OMNIFLOW_PIPELINE": str(TTS_PIPELINE)}
        print(f"$ OMNIFLOW_PREFIX={TTS_PREFIX} omniflow worker --stage all + reconciler (tts-cpu)", flush=True)
        for command in (["worker", "--stage", "all"], ["reconciler"]):
            tts.append(subprocess.Popen([sys.executable, "-m", "omniflow.cli", *command], env=tts_env,
                                        stdout=subprocess.DEVNULL))
        wait_ready(env, up, stages=4, others=tuple(tts))
        wait_ready(tts_env, up, stages=2, others=tuple(tts))
        print(f"ready in {time.monotonic() - t0:.1f}s", flush=True)
        print(f"question: {question}", flush=True)
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
        for proc in (*tts, up):
            proc.send_signal(signal.SIGINT)
        for proc in (*tts, up):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
