"""API latency: p50/p99 of `POST /v1/workflows` -> 202, and of the `GET ?wait` wake-up.

Starts an embedded Valkey (no AOF), the engine (reconciler + one worker per
stage of the toy pipeline, no simulated GPU time) in a background thread and
the API (`omniflow.api.app.serve`) in a subprocess, then measures from a
client in this process:

- submit: one POST at a time, time until the 202 arrives;
- wake-up: a long-poll `GET /v1/workflows/{id}?wait=30` is parked on a workflow
  whose thinker takes ~`--work-ms`; the wake-up latency is the time from the
  workflow's `finished_at` (stamped in Redis by the transition that made it
  terminal) to the client holding the response.

    .venv/bin/python bench/api_latency.py [--n 300] [--waits 100]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omniflow.config import DEFAULT_PIPELINE, Settings
from omniflow.ops.embedded import EmbeddedServer, free_port
from omniflow.pipeline import load_pipeline
from omniflow.engine.reconciler import Reconciler
from omniflow.engine.worker import Worker


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def fast_pipeline(path: Path) -> Path:
    raw = yaml.safe_load(Path(DEFAULT_PIPELINE).read_text())
    for stage in raw["stages"].values():
        stage["params"].update({"token_delay_s": 0.0, "chunk_delay_s": 0.0, "max_words": 8})
    path.write_text(yaml.safe_dump(raw))
    return path


class EngineThread:
    """Reconciler + one worker per stage, in their own event loop."""

    def __init__(self, settings: Settings, pipeline_path: Path, url: str) -> None:
        self.settings, self.pipeline, self.url = settings, load_pipeline(pipeline_path), url
        self.loop = asyncio.new_event_loop()
        self.stop: asyncio.Event | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        self.loop.run_until_complete(self._run())

    async def _run(self) -> None:
        self.stop = asyncio.Event()
        rec = Reconciler(settings=self.settings, pipeline=self.pipeline, redis_url=self.url)
        workers = [Worker(settings=self.settings, pipeline=self.pipeline, stage=st, redis_url=self.url)
                   for st in self.pipeline.order]
        tasks = [asyncio.create_task(x.run(self.stop)) for x in (rec, *workers)]
        await asyncio.gather(rec.started.wait(), *(w.started.wait() for w in workers))
        self.ready.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> None:
        self.thread.start()
        if not self.ready.wait(15):
            raise RuntimeError("the engine did not start")

    def close(self) -> None:
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=15)


def start_api(env: dict[str, str], pipeline_path: Path, url: str, port: int) -> subprocess.Popen[bytes]:
    code = ("import sys; from omniflow.config import Settings; from omniflow.pipeline import load_pipeline; "
            "from omniflow.api.app import serve; "
            f"serve(Settings(), load_pipeline({str(pipeline_path)!r}), {url!r}, '127.0.0.1', {port})")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


async def wait_ready(http: httpx.AsyncClient) -> None:
    for _ in range(300):
        try:
            if (await http.get("/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError("the API did not become ready")


async def measure(base_url: str, n: int, waits: int, work_ms: float) -> dict[str, list[float]]:
    submit_ms: list[float] = []
    wake_ms: list[float] = []
    health_ms: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        await wait_ready(http)
        for i in range(20):      # warm-up
            await http.post("/v1/workflows", json={"input": {"text": f"warm {i}"}})
        for _ in range(n):
            t0 = time.perf_counter()
            await http.get("/healthz")
            health_ms.append((time.perf_counter() - t0) * 1000)
        for i in range(n):
            t0 = time.perf_counter()
            r = await http.post("/v1/workflows", json={"input": {"text": f"bench {i}"}})
            submit_ms.append((time.perf_counter() - t0) * 1000)
            assert r.status_code == 202, r.text
        await asyncio.sleep(1.0)  # let the submit burst drain before timing wake-ups
        delay_s = work_ms / 1000 / 8
        for i in range(waits):
            r = await http.post("/v1/workflows", json={"input": {"text": f"wait {i}"},
                                                       "stage_params": {"thinker": {"token_delay_s": delay_s}}})
            doc = (await http.get(r.json()["links"]["self"], params={"wait": 30})).json()
            received = time.time()
            assert doc["state"] == "completed", doc
            wake_ms.append((received - doc["finished_at"]) * 1000)
    return {"health": health_ms, "submit": submit_ms, "wake": wake_ms}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="submits to time")
    parser.add_argument("--waits", type=int, default=100, help="long-poll wake-ups to time")
    parser.add_argument("--work-ms", type=float, default=80.0, help="thinker time per workflow in the wake-up test")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(data_dir=Path(tmp), appendonly=False).start()
        api: subprocess.Popen[bytes] | None = None
        engine: EngineThread | None = None
        try:
            pipeline_path = fast_pipeline(Path(tmp) / "pipeline.yaml")
            env = {**os.environ, "OMNIFLOW_REDIS_URL": server.url, "OMNIFLOW_PREFIX": "bench",
                   "OMNIFLOW_API_KEYS": "", "OMNIFLOW_ADMIN_KEYS": "", "OMNIFLOW_LOG_LEVEL": "WARNING"}
            settings = Settings(redis_url=server.url, prefix="bench")
            engine = EngineThread(settings, pipeline_path, server.url)
            engine.start()
            port = free_port()
            api = start_api(env, pipeline_path, server.url, port)
            results = asyncio.run(measure(f"http://127.0.0.1:{port}", args.n, args.waits, args.work_ms))
        finally:
            if api is not None:
                api.terminate()
                api.wait(timeout=10)
            if engine is not None:
                engine.close()
            server.stop()
    print(f"{'measure':<34}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}")
    for label, key in (("GET /healthz (HTTP floor)", "health"), ("POST /v1/workflows -> 202", "submit"), ("GET ?wait wake-up after terminal", "wake")):
        values: list[Any] = results[key]
        print(f"{label:<34}{len(values):>6}{percentile(values, 50):>10.2f}{percentile(values, 99):>10.2f}")


if __name__ == "__main__":
    main()
