"""Draw docs/timeline.png: one workflow of the toy omni pipeline, stage by stage.

Runs the real engine (embedded Valkey, reconciler, one worker per stage, in one
process) with simulated GPU time, then plots the workflow's event log: when each
stage was claimed, when it got input, every text delta and audio chunk, when it
finished, and the terminal entry. Run: .venv/bin/python bench/timeline_plot.py
"""
from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from omniflow.config import Settings  # noqa: E402
from omniflow.ops.embedded import EmbeddedServer  # noqa: E402
from omniflow.models import SubmitRequest, WorkflowInput  # noqa: E402
from omniflow.pipeline import build_pipeline  # noqa: E402

STAGES = ("thinker", "talker", "code2wav")
COLORS = {"thinker": "#4C72B0", "talker": "#DD8452", "code2wav": "#55A868"}


async def record() -> tuple[list[tuple[str, dict[str, str]]], int]:
    from conftest import Engine, toy_spec

    spec = toy_spec(thinker={"token_delay_s": 0.03, "max_words": 16}, talker={"chunk_delay_s": 0.01},
                    code2wav={"chunk_delay_s": 0.02})
    server = EmbeddedServer(data_dir=Path(tempfile.mkdtemp()), appendonly=False).start()
    try:
        eng = Engine(server.url, Settings(redis_url=server.url, prefix="plot"), build_pipeline(spec))
        await eng.add_reconciler()
        for stage in STAGES:
            await eng.add_worker(stage)
        sub = await eng.store.submit(SubmitRequest(input=WorkflowInput(text="Why do durable queues matter?")))
        doc = await eng.store.wait(sub.id, timeout_s=30)
        log = await eng.store.read_log(sub.id)
        await eng.close()
        return log, int(doc["created_at"] * 1000)
    finally:
        server.stop()


def plot(log: list[tuple[str, dict[str, str]]], t0: int, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 3.4))
    lanes = {stage: i for i, stage in enumerate(reversed(STAGES))}
    since: dict[str, tuple[int, str]] = {}
    end = 0
    for eid, f in log:
        t = int(eid.split("-")[0]) - t0
        end = max(end, t)
        stage = f.get("stage", "")
        if f.get("t") == "stage":
            if stage in since:
                start, status = since.pop(stage)
                ax.barh(lanes[stage], t - start, left=start, height=0.5, color=COLORS[stage],
                        alpha=0.35 if status == "waiting_input" else 0.8)
            if f["status"] in ("waiting_input", "running"):
                since[stage] = (t, f["status"])
        elif f.get("t") in ("text", "audio"):
            ax.plot([t, t], [lanes[stage] - 0.3, lanes[stage] + 0.3], color="black", lw=0.8)
        elif f.get("t") == "terminal":
            ax.axvline(t, color="crimson", ls="--", lw=1)
            ax.text(t, len(STAGES) - 0.45, f" completed {t} ms", color="crimson", fontsize=8)
    ax.set_yticks(list(lanes.values()), list(lanes.keys()))
    ax.set_xlabel("ms since submit")
    ax.set_xlim(0, end * 1.08)
    ax.set_title("One workflow through the toy omni pipeline (light: waiting for input, dark: running; "
                 "ticks: text deltas / audio chunks)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    entries, created = asyncio.run(record())
    target = REPO / "docs" / "timeline.png"
    plot(entries, created, target)
    print(f"wrote {target}")
