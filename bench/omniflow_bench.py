"""The omniflow rows of `make bench`: the full durable path on the common workload.

client submit (Lua admission) -> stage worker pools on consumer groups (real
`omniflow worker` processes) -> reconciler process -> completion in the
workflow record. The stages are the no-op executors below (the same work as
the peers: 4 text chunks, 4 code chunks, one audio chunk).
"""
from __future__ import annotations

import asyncio
import atexit
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import yaml

from bench import workload
from bench.common import (
    BenchError, ProcessCPU, Result, bench_env, check_alive, cost_delta, redis_client, running, server_stats,
    summarize, timeout_for,
)
from omniflow.storage.keys import Keys
from omniflow.executor import Executor, Session

MAX_SESSIONS = 512


class Thinker(Executor):
    """The user path's stages: the public `Executor` API with no flags (they run on the stage's
    compute thread, the default `runs_on = "thread"`, as every real executor does). A request's
    `work_s` stage param makes the thinker work that long first (bench/api_latency.py's wake-up)."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        if session.params.get("work_s"):
            await asyncio.sleep(float(session.params["work_s"]))
        chunks = workload.thinker(session.text)
        for text in chunks:
            await session.emit(text=text, data=text)
        return {"chunks": len(chunks)}


class Talker(Executor):
    async def run(self, session: Session) -> Mapping[str, Any]:
        n = 0
        async for chunk in session.inputs():
            await session.emit(data=[len(chunk.data), n])
            n += 1
        return {"chunks": n}


class Code2Wav(Executor):
    async def run(self, session: Session) -> Mapping[str, Any]:
        codes = [chunk.data async for chunk in session.inputs()]
        pcm = np.frombuffer(workload.code2wav(codes), dtype=np.int16)
        await session.emit(audio=pcm, sample_rate=16000)
        return {"chunks": 1}


class _AsyncStage(Executor):
    """The reference rows' stages are pure asyncio (they never block): they run on the worker's loop."""

    runs_on = "loop"


class BenchThinker(_AsyncStage, Thinker):
    pass


class BenchTalker(_AsyncStage, Talker):
    pass


class BenchCode2Wav(_AsyncStage, Code2Wav):
    pass


class SimThinker(_AsyncStage):
    """A GPU-bound thinker: `service_s` of (simulated) GPU time per chunk."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        started = time.perf_counter()
        for text in workload.thinker(session.text):
            await asyncio.sleep(float(self.params["service_s"]))
            await session.emit(text=text, data=text)
        return {"chunks": workload.TEXT_CHUNKS, "busy_s": time.perf_counter() - started}


# The reference rows, as they were measured before the user path existed: stages on the worker's loop,
# completion seen in the in-flight set (throughput) or by an XREAD of `<wf>:done` (latency, no document).
REF_THROUGHPUT = "reference: runs_on=loop, in-flight poll"
REF_LATENCY = "reference: runs_on=loop, XREAD <wf>:done"
LOOP_STAGES = ("BenchThinker", "BenchTalker", "BenchCode2Wav")      # the reference rows (runs_on = "loop")
USER_STAGES = ("Thinker", "Talker", "Code2Wav")                      # the user path (no flags)


def pipeline_yaml(procs: int, *, thinker: str | None = None, thinker_replicas: int | None = None,
                  thinker_sessions: int = MAX_SESSIONS, thinker_params: dict[str, Any] | None = None,
                  stages: tuple[str, str, str] = LOOP_STAGES) -> dict[str, Any]:
    stage = lambda cls, final=None: {  # noqa: E731
        "executor": f"bench.omniflow_bench:{cls}", "final_output": final, "replicas": procs,
        "max_sessions": MAX_SESSIONS, "retry": {"max_attempts": 3, "input_timeout_s": 120},
    }
    spec = {"name": "bench", "stages": {"thinker": stage(thinker or stages[0], "text"), "talker": stage(stages[1]),
                                        "code2wav": stage(stages[2], "audio")},
            "edges": [{"from": "thinker", "to": "talker"}, {"from": "talker", "to": "code2wav"}]}
    spec["stages"]["thinker"].update(replicas=thinker_replicas or procs, max_sessions=thinker_sessions,
                                     params=thinker_params or {})
    return spec


class Engine:
    """The engine's processes for one row. `defaults`: every setting at its default (the user path:
    only the Redis URL and the pipeline are given); otherwise the reference rows' tuned settings."""

    def __init__(self, redis_url: str, procs: int, spec: dict[str, Any] | None = None, *,
                 colocated: bool = False, defaults: bool = False) -> None:
        self.url = redis_url
        self.spec = spec or pipeline_yaml(procs)
        self.procs = procs
        self.colocated = colocated        # `procs` worker processes, each serving all three stages
        self.tmp = Path(tempfile.mkdtemp(prefix="omniflow-bench-"))
        # removed when the bench process ends (its workers are stopped by then): a full `make bench`
        # left ~90 of these in /tmp
        atexit.register(shutil.rmtree, self.tmp, True)
        self.yaml = self.tmp / "pipeline.yaml"
        self.yaml.write_text(yaml.safe_dump(self.spec, sort_keys=False))
        if defaults:
            from omniflow.config import Settings

            self.prefix = str(Settings.model_fields["prefix"].default)
            self.env = bench_env(OMNIFLOW_REDIS_URL=redis_url, OMNIFLOW_PIPELINE=str(self.yaml))
            return
        self.prefix = f"b{uuid.uuid4().hex[:6]}"
        self.env = bench_env(OMNIFLOW_REDIS_URL=redis_url, OMNIFLOW_PREFIX=self.prefix,
                             OMNIFLOW_PIPELINE=str(self.yaml), OMNIFLOW_LOG_LEVEL="WARNING",
                             OMNIFLOW_MAX_IN_FLIGHT="1000000", OMNIFLOW_BLOCK_MS="1000",
                             OMNIFLOW_READ_BATCH="256")

    def commands(self) -> list[tuple[str, list[str]]]:
        exe = [sys.executable, "-m", "omniflow.cli"]
        cmds = [("omniflow-reconciler", [*exe, "reconciler"])]
        if self.colocated:
            return cmds + [(f"omniflow-worker-{i}", [*exe, "worker", "--stage", "all"]) for i in range(self.procs)]
        for stage in ("thinker", "talker", "code2wav"):
            for i in range(self.spec["stages"][stage]["replicas"]):
                cmds.append((f"omniflow-{stage}-{i}", [*exe, "worker", "--stage", stage]))
        return cmds

    def wait_ready(self, r: Any, procs: list[Any], timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            check_alive(procs)
            expected = self.procs if self.colocated else sum(st["replicas"] for st in self.spec["stages"].values())
            if r.zcount(Keys(self.prefix).workers, int(time.time() * 1000), "+inf") >= expected:
                return
            time.sleep(0.05)
        raise BenchError("omniflow workers did not come up")


async def _submit_all(url: str, prefix: str, yaml_path: Path, n: int, concurrency: int,
                      submit_mode: str = "single") -> list[str]:
    from omniflow.storage.batcher import Batcher
    from omniflow.config import Settings
    from omniflow.models import SubmitRequest, WorkflowInput
    from omniflow.pipeline import load_pipeline
    from omniflow.client.store import Store, connect

    settings = Settings(redis_url=url, prefix=prefix, max_in_flight=1_000_000)
    if submit_mode == "single":
        # one submit after another from the synchronous client, like the peers' clients
        from omniflow.client import Client

        def submit_sync() -> list[str]:
            with Client(url, settings=settings, pipeline=load_pipeline(yaml_path)) as client:
                return [client.submit(f"p{i}") for i in range(n)]
        return await asyncio.to_thread(submit_sync)
    redis = connect(url)
    store = Store(redis, settings, load_pipeline(yaml_path), batcher=Batcher(redis))
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> str:
        async with sem:
            req = SubmitRequest(input=WorkflowInput(text=f"p{i}"))
            return (await store.submit(req)).id

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        await redis.aclose()


def _busy_s(r: Any, prefix: str, ids: list[str], stage: str) -> float:
    """Sum of the `busy_s` usage the stage's executor reported (time its sessions held a slot)."""
    pipe = r.pipeline(transaction=False)
    for wf_id in ids:
        pipe.hget(Keys(prefix).stages(wf_id), f"{stage}:usage")
    return sum(json.loads(u).get("busy_s", 0.0) for u in pipe.execute() if u)


def _stage_window(r: Any, prefix: str, ids: list[str], stage: str) -> float:
    """Seconds from the stage's first session start to its last session end, over `ids`."""
    pipe = r.pipeline(transaction=False)
    for wf_id in ids:
        pipe.hmget(Keys(prefix).stages(wf_id), f"{stage}:t_start", f"{stage}:t_end")
    spans = [(int(a), int(b)) for a, b in pipe.execute() if a and b]
    return (max(b for _, b in spans) - min(a for a, _ in spans)) / 1000 if spans else 0.0


def _records(r: Any, prefix: str, ids: list[str]) -> list[tuple[str, float, float]]:
    pipe = r.pipeline(transaction=False)
    for wf_id in ids:
        pipe.hmget(Keys(prefix).wf(wf_id), "created_ms", "finished_ms", "state")
    out = []
    for wf_id, (created, finished, state) in zip(ids, pipe.execute()):
        if state != b"completed":
            raise BenchError(f"workflow {wf_id} ended {state!r}")
        out.append((wf_id, int(created) / 1000, int(finished) / 1000))
    return out


def run_throughput(redis_url: str, n: int, procs_per_stage: int, *, submit_mode: str = "single",
                   spec: dict[str, Any] | None = None, busy_stage: str | None = None,
                   colocated: bool = False) -> Result:
    """`submit_mode` "single": one awaited submit at a time (as the peers submit); "pipelined":
    512 concurrent submits, group-committed by the client's batcher. `colocated`: `procs_per_stage`
    worker processes that each serve all three stages (as the peers' workers run all three steps)."""
    eng = Engine(redis_url, procs_per_stage, spec, colocated=colocated)
    r = redis_client(redis_url)
    with running(eng.commands(), env=eng.env) as procs:
        eng.wait_ready(r, procs)
        before = server_stats(r)
        meter = ProcessCPU(r, procs)
        ids = asyncio.run(_submit_all(redis_url, eng.prefix, eng.yaml, n, concurrency=512, submit_mode=submit_mode))
        deadline = time.monotonic() + timeout_for(n, 100)
        while r.zcard(Keys(eng.prefix).inflight(0)) > 0:      # one cell: a single server
            check_alive(procs)
            if time.monotonic() > deadline:
                raise BenchError("omniflow throughput run timed out")
            time.sleep(0.01)
        after = server_stats(r)
        cpu = meter.take()
        records = _records(r, eng.prefix, ids)
        busy = _busy_s(r, eng.prefix, ids, busy_stage) if busy_stage else None
        window = _stage_window(r, eng.prefix, ids, busy_stage) if busy_stage else None
    extra = cost_delta(before, after, n)
    if busy is not None:
        extra["busy_s"] = round(busy, 3)
        extra["stage_window_s"] = round(window or 0.0, 3)
    extra.update(ProcessCPU.per_wf(cpu, n))
    extra["submit_mode"] = submit_mode
    variant = REF_THROUGHPUT if submit_mode == "single" else f"{REF_THROUGHPUT}, pipelined submit"
    if colocated:
        variant += ", stages co-located"
    return summarize("omniflow", variant, procs_per_stage, records, extra=extra)


SIM_SERVICE_S = 0.025        # GPU time per thinker chunk: 4 chunks = 100 ms per workflow
SIM_SESSIONS = 4             # concurrent sessions (batch slots) per thinker replica
SIM_REPLICAS = (1, 2, 4, 8, 16)


def run_simulated_gpu(redis_url: str, replicas: int, *, per_replica: int = 60) -> Result:
    """The thinker is GPU-bound (`SIM_SERVICE_S` per chunk, `SIM_SESSIONS` slots per replica); how much
    of the pool's slot time does omniflow keep busy, and does throughput scale with replicas?"""
    spec = pipeline_yaml(1, thinker="SimThinker", thinker_replicas=replicas, thinker_sessions=SIM_SESSIONS,
                         thinker_params={"service_s": SIM_SERVICE_S})
    n = per_replica * replicas
    res = run_throughput(redis_url, n, 1, submit_mode="pipelined", spec=spec, busy_stage="thinker")
    busy_s = res.extra["busy_s"]            # measured time the thinker sessions held their slots
    span = res.extra["span_s"]
    capacity_s = span * replicas * SIM_SESSIONS
    res.variant = f"simulated GPU, {replicas} thinker replica(s)"
    res.procs = replicas
    # while the thinker had work: its first session start to its last session end (the GPU's own view:
    # the submit ramp and the downstream tail after its last session are not its idle time)
    window_s = res.extra.get("stage_window_s") or span
    res.extra.update(utilization=round(busy_s / capacity_s, 3), ideal_wf_s=round(
        replicas * SIM_SESSIONS / (workload.TEXT_CHUNKS * SIM_SERVICE_S), 1),
        utilization_window=round(busy_s / (window_s * replicas * SIM_SESSIONS), 3),
        gpu_work_share=round(n * workload.TEXT_CHUNKS * SIM_SERVICE_S / (window_s * replicas * SIM_SESSIONS), 3))
    return res


def run_extra(redis_url: str, *, quick: bool = False) -> list[Result]:
    """Rows beyond the peer comparison: pipelined submits, and the simulated-GPU scaling run."""
    from bench.common import start_server

    rows = [run_throughput(redis_url, 500 if quick else 2000, 2, submit_mode="pipelined")]
    for replicas in SIM_REPLICAS:
        with start_server() as server:       # a fresh server per row
            rows.append(run_simulated_gpu(server.url, replicas, per_replica=20 if quick else
                                          150 if replicas <= 4 else 100))
    return rows


async def _latency(url: str, prefix: str, yaml_path: Path, n: int) -> list[tuple[str, float, float]]:
    from omniflow.config import Settings
    from omniflow.models import SubmitRequest, WorkflowInput
    from omniflow.pipeline import load_pipeline
    from omniflow.client.store import Store, connect

    redis = connect(url)
    store = Store(redis, Settings(redis_url=url, prefix=prefix), load_pipeline(yaml_path))
    records = []
    try:
        for i in range(n):
            t0 = time.time()
            sub = await store.submit(SubmitRequest(input=WorkflowInput(text=f"l{i}")))
            # what `Store.wait` blocks on (one wake-up at the terminal), as the peers' clients block
            # on their done entry; the document fetch that `wait` adds afterwards is not timed
            reply = await redis.xread({store.keys.done(sub.id): "0-0"}, count=1, block=30_000)
            t1 = time.time()
            if not reply or reply[0][1][0][1].get(b"state") != b"completed":
                raise BenchError(f"latency workflow {sub.id} ended {reply!r:.200}")
            records.append((sub.id, t0, t1))
    finally:
        await redis.aclose()
    return records


def run_latency(redis_url: str, n: int, *, colocated: bool = False) -> Result:
    eng = Engine(redis_url, 1, colocated=colocated)
    r = redis_client(redis_url)
    with running(eng.commands(), env=eng.env) as procs:
        eng.wait_ready(r, procs)
        asyncio.run(_latency(redis_url, eng.prefix, eng.yaml, 20))      # warm up
        records = asyncio.run(_latency(redis_url, eng.prefix, eng.yaml, n))
    return summarize("omniflow", f"{REF_LATENCY}, stages co-located" if colocated else REF_LATENCY, 1, records,
                     mode="latency")


if __name__ == "__main__":
    from bench.common import start_server

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    procs = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    with start_server() as server:
        res = run_throughput(server.url, n, procs)
        print(json.dumps(res.to_dict(), indent=1))
    with start_server() as server:
        print(json.dumps(run_latency(server.url, 200).to_dict(), indent=1))
