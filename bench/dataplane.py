"""The data-plane benchmark: chunk payloads between two worker processes, per transport.

    .venv/bin/python bench/dataplane.py [--quick]      # prints the table, writes bench/out/dataplane.json
    (`make bench` runs it through bench/run.py, which renders docs/benchmarks.md and docs/dataplane.png)

A producer process and a consumer process, a fresh embedded Valkey (AOF everysec). Each chunk
takes the engine's path: the producer stores the payload (inline / Redis key / shared-memory
segment, `omniflow.dataplane`), then XADDs the entry to the edge log and to the consumer's inbox
in one pipeline (what emit.lua writes); the consumer blocks in XREAD on its inbox, resolves the
payload, touches every 4 KiB page of it (a mapped segment faults its pages in), releases it and
acks. Beside them, in the same run: a plain in-process numpy copy of the same bytes, and raw
Redis SET/GET of the same sizes between the same two processes (SET + XADD of the key name;
GET + DEL).

- latency: one chunk at a time (the next is sent once the last is acked); the consumer measures
  send -> payload in hand on CLOCK_MONOTONIC, which both processes share.
- throughput: the producer streams with at most `WINDOW` chunks unacked; payload bytes / (first
  send -> last chunk in hand).
- Redis memory and AOF bytes per MiB of payload: 1 MiB chunks written the producer's way and
  not yet consumed; deltas of INFO used_memory and aof_current_size.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack
import numpy as np

from bench.common import OUT_DIR, BenchError, bench_env, log, percentile, start_server
from omniflow.workers.base import Executor, Session

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
# through the engine: the policy's choice (4 KiB inline, 1 MiB a segment), and 1 MiB forced through a
# Redis key (what a consumer on another host gets)
ENGINE_RUNS = [(4 << 10, "auto"), (1 << 20, "auto"), (1 << 20, "redis")]
TRANSPORTS = ["inline", "redis", "shm", "raw"]         # raw: plain SET/GET, the Redis ceiling
LABELS = {"inline": "inline (in the entry)", "redis": "Redis key (reference)", "shm": "shared memory (reference)",
          "raw": "raw Redis SET/GET", "copy": "in-process numpy copy",
          "engine": "through the engine (emit → session input)",
          "engine-redis": "through the engine, Redis key forced (another host)"}
PAGE = 4096
COLORS = {"copy": "#7f7f7f", "shm": "#d62728", "redis": "#1f77b4", "raw": "#2ca02c", "inline": "#9467bd"}
WF = "wfbench"
EDGE_MAXLEN = 64


def counts(size: int, quick: bool) -> tuple[int, int]:
    """(latency chunks, throughput chunks) for one size."""
    table = {4 << 10: (300, 2000), 64 << 10: (200, 1000), 1 << 20: (100, 200), 16 << 20: (15, 24)}
    lat, thr = table[size]
    return (max(5, lat // 4), max(8, thr // 4)) if quick else (lat, thr)


def window(size: int) -> int:
    return 4 if size >= 16 << 20 else 16


def touch(obj: Any) -> int:
    """Read one byte of every page of the payload (a view of a segment maps them)."""
    if isinstance(obj, np.ndarray):
        return int(obj.reshape(-1).view(np.uint8)[::PAGE].sum())
    if isinstance(obj, (bytes, bytearray)):
        return sum(obj[::PAGE])
    return 0


# --------------------------------------------------------------------------- the two processes


def _keys(prefix: str) -> dict[str, str]:
    return {"inbox": f"{prefix}:inbox:consumer", "edge": f"{prefix}:wf:{{{WF}}}:edge:a:b", "ack": f"{prefix}:ack"}


async def producer(url: str, prefix: str, transport: str, quick: bool) -> None:
    from omniflow.config import DataPlaneMode, Settings
    from omniflow.dataplane import DataPlane, TransportKind, ref_field
    from omniflow.store import connect

    redis = connect(url)
    plane = DataPlane(redis, Settings(redis_url=url, prefix=prefix, dataplane_mode=DataPlaneMode.AUTO),
                      worker_id="bench-producer")
    k = _keys(prefix)
    acked, ack_last = 0, "0-0"

    async def wait_acks(until: int) -> None:
        nonlocal acked, ack_last
        while acked < until:
            reply = await redis.xread({k["ack"]: ack_last}, block=30_000)
            if not reply:
                raise BenchError("consumer stopped acking")
            for _key, entries in reply:
                for entry_id, fields in entries:
                    ack_last, acked = entry_id, acked + int(fields[b"n"])

    sent, seq = 0, 0
    for size in SIZES:
        arr = np.frombuffer(os.urandom(size), dtype=np.uint8)
        raw = arr.tobytes()
        for phase, n in zip(("lat", "thr"), counts(size, quick), strict=True):
            win = 1 if phase == "lat" else window(size)
            for _ in range(n):
                await wait_acks(sent - win + 1)
                seq += 1
                t0 = time.monotonic_ns()
                pipe = redis.pipeline(transaction=False)
                if transport == "raw":
                    key = f"{prefix}:raw:{seq}"
                    pipe.set(key, raw)
                    m = key.encode()
                else:
                    ref, commands = plane.prepare(arr, plane.context(WF, "a", "b", 1, seq),
                                                  kind=TransportKind(transport))
                    for command in commands:
                        pipe.execute_command(*command)
                    field, value = ref_field(ref)
                    m = msgpack.packb([["seq", seq, "a", 1, field, value]], use_bin_type=True)
                    pipe.xadd(k["edge"], {"m": m}, maxlen=EDGE_MAXLEN, approximate=False)
                pipe.xadd(k["inbox"], {"m": m, "t": t0, "size": size, "phase": phase})
                await pipe.execute()
                sent += 1
            await wait_acks(sent)
    await redis.xadd(k["inbox"], {"end": 1})
    plane.close()
    await redis.aclose()


async def consumer(url: str, prefix: str, transport: str, out: str) -> None:
    from omniflow.config import Settings
    from omniflow.dataplane import DataPlane, Ref, TransportKind
    from omniflow.store import connect

    redis = connect(url)
    plane = DataPlane(redis, Settings(redis_url=url, prefix=prefix), worker_id="bench-consumer")
    k = _keys(prefix)
    records: list[tuple[int, str, int, int]] = []
    last: Any = "0-0"
    print("ready", flush=True)
    while True:
        reply = await redis.xread({k["inbox"]: last}, count=64, block=60_000)
        if not reply:
            raise BenchError("no chunk within 60 s")
        held: list[Ref] = []
        raw_keys: list[bytes] = []
        n = 0
        for _key, entries in reply:
            for entry_id, fields in entries:
                last = entry_id
                if b"end" in fields:
                    Path(out).write_text(json.dumps(records))
                    await redis.aclose()
                    return
                if transport == "raw":
                    value = await redis.get(fields[b"m"])
                    if value is None:
                        raise BenchError("raw key missing")
                    touch(value)
                    raw_keys.append(fields[b"m"])
                else:
                    flat = msgpack.unpackb(fields[b"m"], raw=True)[0]
                    payload, ref = await plane.resolve(dict(zip(flat[::2], flat[1::2], strict=True)), wf_id=WF)
                    touch(payload)
                    if ref is not None:
                        held.append(ref)
                    del payload
                records.append((int(fields[b"size"]), fields[b"phase"].decode(), int(fields[b"t"]),
                                time.monotonic_ns()))
                n += 1
        # what the engine does when the consuming session is done: release what it read (a segment is
        # handed back to its producer for recycling)
        if plane.shm is not None:
            await plane.shm.release([r for r in held if r.kind is TransportKind.SHM])
        pipe = redis.pipeline(transaction=False)
        for ref in held:
            if ref.kind is TransportKind.REDIS:
                pipe.unlink(ref.location)
                pipe.srem(plane.keys.blobs(WF), ref.location)
        if raw_keys:
            pipe.delete(*raw_keys)
        pipe.xadd(k["ack"], {"n": n})
        pipe.xtrim(k["inbox"], minid=last)
        await pipe.execute()


def run_pair(url: str, transport: str, quick: bool) -> list[tuple[int, str, int, int]]:
    """One producer and one consumer process through `transport`; the consumer's records."""
    prefix = f"dp{uuid.uuid4().hex[:8]}"
    out = OUT_DIR / f"dataplane-{transport}.json"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    me = [sys.executable, str(Path(__file__).resolve()), "--url", url, "--prefix", prefix, "--transport", transport]
    env = bench_env()
    cons = subprocess.Popen([*me, "--role", "consumer", "--out", str(out)], env=env, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    prod = None
    try:
        assert cons.stdout is not None
        if cons.stdout.readline().strip() != "ready":
            raise BenchError(f"{transport} consumer did not start")
        prod = subprocess.Popen([*me, "--role", "producer", *(["--quick"] if quick else [])], env=env,
                                start_new_session=True)
        if prod.wait(timeout=600) != 0:
            raise BenchError(f"{transport} producer failed (rc {prod.returncode})")
        if cons.wait(timeout=120) != 0:
            raise BenchError(f"{transport} consumer failed (rc {cons.returncode})")
        return [tuple(r) for r in json.loads(out.read_text())]  # type: ignore[misc]
    finally:
        for p in (prod, cons):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        _release_prefix(prefix)


def _release_prefix(prefix: str) -> None:
    from omniflow.dataplane.shm import ShmTransport, shm_available

    if shm_available():
        ShmTransport(prefix).release_all()


# --------------------------------------------------------------------------- through the engine

ENGINE_PACE_S = 0.004          # between two emits: each chunk is measured on its own, not queued


class ChunkSource(Executor):
    """Emits `chunks` payloads of `size` bytes, each stamped with CLOCK_MONOTONIC at emit."""

    runs_on = "loop"

    async def run(self, session: Session) -> dict[str, Any]:
        size, n = int(session.params["size"]), int(session.params["chunks"])
        pace_s = float(session.params.get("pace_s", ENGINE_PACE_S))
        body = np.frombuffer(os.urandom(size), dtype=np.uint8)
        for _ in range(n):
            await session.emit(data={"t": time.monotonic_ns(), "b": body})
            await asyncio.sleep(pace_s)
        return {"chunks": n}


class ChunkSink(Executor):
    """Reads the chunks (touching every page), then emits the per-chunk latencies as its text."""

    runs_on = "loop"

    async def run(self, session: Session) -> dict[str, Any]:
        lat = []
        async for chunk in session.inputs():
            touch(chunk.data["b"])
            lat.append((time.monotonic_ns() - chunk.data["t"]) / 1e6)
        await session.emit(text=json.dumps(lat))
        return {"chunks": len(lat)}


def engine_chunk_latency(url: str, size: int, workflows: int, chunks: int, *, mode: str = "auto",
                         pace_s: float = ENGINE_PACE_S) -> dict[str, Any]:
    """Chunks of `size` through the whole engine between two worker processes (emit -> emit.lua ->
    edge log + inbox -> the consumer's session): per-chunk latency, emit to payload in hand."""
    import tempfile

    import yaml

    from bench.common import redis_client, running

    prefix = f"de{uuid.uuid4().hex[:6]}"
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-dp-"))
    stage = {"retry": {"max_attempts": 1, "input_timeout_s": 60}, "max_sessions": 4}
    spec = {"name": "dataplane", "stages": {
        "src": {**stage, "executor": "bench.dataplane:ChunkSource", "params": {"size": size, "chunks": chunks, "pace_s": pace_s}},
        "dst": {**stage, "executor": "bench.dataplane:ChunkSink", "final_output": "text"}},
        "edges": [{"from": "src", "to": "dst"}]}
    (tmp / "p.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    env = bench_env(OMNIFLOW_REDIS_URL=url, OMNIFLOW_PREFIX=prefix, OMNIFLOW_PIPELINE=str(tmp / "p.yaml"),
                    OMNIFLOW_LOG_LEVEL="WARNING", OMNIFLOW_DATAPLANE_MODE=mode,
                    # a loaded 2-core machine can starve a heartbeat for a second or two: a retry would replay
                    # chunks with old timestamps, so the lease is long and there is one attempt
                    OMNIFLOW_LEASE_TIMEOUT_S="15", OMNIFLOW_HEARTBEAT_INTERVAL_S="1")
    exe = [sys.executable, "-m", "omniflow.cli"]
    r = redis_client(url)
    lat: list[float] = []
    try:
        with running([("dp-reconciler", [*exe, "reconciler"]), ("dp-src", [*exe, "worker", "--stage", "src"]),
                      ("dp-dst", [*exe, "worker", "--stage", "dst"])], env=env) as procs:
            deadline = time.monotonic() + 60
            while r.zcount(f"{prefix}:workers", int(time.time() * 1000), "+inf") < 2:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise BenchError("engine workers did not come up (bench/out/logs/dp-*.log)")
                time.sleep(0.05)
            from omniflow.client import Client
            from omniflow.config import Settings
            from omniflow.pipeline import load_pipeline

            with Client(url, settings=Settings(redis_url=url, prefix=prefix),
                        pipeline=load_pipeline(tmp / "p.yaml")) as client:
                for i in range(workflows + 1):             # the first one warms up
                    wf_id = client.submit(f"w{i}")
                    doc = client.wait(wf_id, timeout_s=120)
                    if doc.get("state") != "completed":
                        raise BenchError(f"engine workflow ended {doc.get('state')}: {doc.get('error')}")
                    text = r.get(f"{prefix}:wf:{{{wf_id}}}:out:dst")
                    if i and text:
                        lat += json.loads(text)
    finally:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()
        _release_prefix(prefix)
    if len(lat) < workflows * chunks:
        raise BenchError(f"engine run delivered {len(lat)} of {workflows * chunks} chunks")
    return {"transport": "engine" if mode == "auto" else f"engine-{mode}", "size": size, "n": len(lat),
            "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "mib_s": float("nan")}


# --------------------------------------------------------------------------- in-process and memory


def copy_baseline(quick: bool) -> list[dict[str, Any]]:
    """A plain numpy copy of the same bytes in one process: what a hand-off costs at best."""
    rows = []
    for size in SIZES:
        src = np.frombuffer(os.urandom(size), dtype=np.uint8)
        n = max(counts(size, quick))
        times = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            dst = src.copy()
            times.append(time.perf_counter_ns() - t0)
            del dst
        mean_s = statistics.fmean(times) / 1e9
        rows.append({"transport": "copy", "size": size, "n": n, "p50_ms": percentile(times, 50) / 1e6,
                     "p99_ms": percentile(times, 99) / 1e6, "mib_s": size / mean_s / (1 << 20)})
    return rows


def shm_profile(size: int = 1 << 20, n: int = 40) -> dict[str, float]:
    """Where a shared-memory chunk's time goes, step by step in one process (µs, medians): a fresh
    segment (what the first chunks of a producer cost) and a recycled one (steady state)."""
    from omniflow.dataplane.base import PutContext
    from omniflow.dataplane.shm import ShmTransport

    arr = np.frombuffer(os.urandom(size), dtype=np.uint8)
    steps: dict[str, list[float]] = {k: [] for k in (
        "put, new segment (kernel allocates and copies pages)", "unlink (kernel frees pages)",
        "put, recycled segment (rename, copy into mapped pages)", "get (open, map, decode header: views)",
        "touch every page (page faults)", "release: hand back to the producer", "in-process numpy copy")}
    fresh = ShmTransport(f"pf{uuid.uuid4().hex[:8]}", pool_bytes=0)
    pooled = ShmTransport(f"pp{uuid.uuid4().hex[:8]}")

    def clock() -> float:
        return time.perf_counter_ns() / 1000

    async def measure() -> None:
        for seq in range(n):
            t0 = clock()
            ref = fresh.put_sync(arr, PutContext(fresh.prefix, WF, "a", "b", 1, seq, "profile", 60))
            t1 = clock()
            await fresh.release_workflow(WF)
            t2 = clock()
            ref = pooled.put_sync(arr, PutContext(pooled.prefix, WF, "a", "b", 1, seq, "profile", 60))
            t3 = clock()
            out = pooled.get_sync(ref)
            t4 = clock()
            touch(out)
            t5 = clock()
            del out
            await pooled.release([ref])
            t6 = clock()
            dst = arr.copy()
            t7 = clock()
            del dst
            if seq:            # the first put of the pooled transport made its segment
                for key, a, b in zip(steps, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7)):
                    steps[key].append(b - a)

    try:
        asyncio.run(measure())
    finally:
        fresh.release_all()
        pooled.release_all()
    return {k: statistics.median(v) for k, v in steps.items()}


def summarize_pair(transport: str, records: list[tuple[int, str, int, int]]) -> list[dict[str, Any]]:
    rows = []
    for size in SIZES:
        lat = [(done - sent) / 1e6 for s, phase, sent, done in records if s == size and phase == "lat"]
        thr = [(sent, done) for s, phase, sent, done in records if s == size and phase == "thr"]
        span_s = (max(d for _, d in thr) - min(s for s, _ in thr)) / 1e9
        rows.append({"transport": transport, "size": size, "n": len(lat) + len(thr),
                     "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
                     "mib_s": len(thr) * size / span_s / (1 << 20)})
    return rows


async def memory_per_mib(url: str, chunks: int = 16) -> dict[str, dict[str, float]]:
    """Redis memory and AOF bytes per MiB of payload, per transport, for 1 MiB chunks in flight."""
    from omniflow.config import Settings
    from omniflow.dataplane import DataPlane, TransportKind, ref_field
    from omniflow.store import connect

    redis = connect(url)
    out: dict[str, dict[str, float]] = {}
    arr = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
    try:
        for transport in TRANSPORTS:
            prefix = f"dm{uuid.uuid4().hex[:8]}"
            plane = DataPlane(redis, Settings(redis_url=url, prefix=prefix), worker_id="bench-mem")
            k = _keys(prefix)
            await redis.ping()
            mem0 = (await redis.info("memory"))["used_memory"]
            aof0 = (await redis.info("persistence"))["aof_current_size"]
            for seq in range(1, chunks + 1):
                pipe = redis.pipeline(transaction=False)
                if transport == "raw":
                    pipe.set(f"{prefix}:raw:{seq}", arr.tobytes())
                else:
                    ref, commands = plane.prepare(arr, plane.context(WF, "a", "b", 1, seq),
                                                  kind=TransportKind(transport))
                    for command in commands:
                        pipe.execute_command(*command)
                    field, value = ref_field(ref)
                    m = msgpack.packb([["seq", seq, "a", 1, field, value]], use_bin_type=True)
                    pipe.xadd(k["edge"], {"m": m})
                    pipe.xadd(k["inbox"], {"m": m})
                await pipe.execute()
            await redis.ping()
            mem1 = (await redis.info("memory"))["used_memory"]
            aof1 = (await redis.info("persistence"))["aof_current_size"]
            out[transport] = {"redis_mem_per_mib": (mem1 - mem0) / chunks / (1 << 20),
                              "aof_per_mib": (aof1 - aof0) / chunks / (1 << 20)}
            keys = [key async for key in redis.scan_iter(match=f"{prefix}:*")]
            if keys:
                await redis.delete(*keys)
            await plane.release_workflow(WF)
    finally:
        await redis.aclose()
    return out


# --------------------------------------------------------------------------- the run


def run(quick: bool = False) -> dict[str, Any]:
    """The whole benchmark; returns what bench/run.py renders (also in bench/out/dataplane.json)."""
    from omniflow.dataplane.shm import shm_available

    transports = [t for t in TRANSPORTS if t != "shm" or shm_available()]
    t_start = time.monotonic()
    rows = copy_baseline(quick)
    with start_server(appendonly=True, appendfsync="everysec") as server:
        for transport in transports:
            log(f"- data plane: {LABELS[transport]}")
            rows += summarize_pair(transport, run_pair(server.url, transport, quick))
        memory = asyncio.run(memory_per_mib(server.url))
        wfs, chunks = (3, 20) if quick else (10, 40)
        for size, mode in ENGINE_RUNS:
            log(f"- data plane: {size_label(size)} chunks through the engine ({mode})")
            rows.append(engine_chunk_latency(server.url, size, wfs, chunks, mode=mode))
    profile = shm_profile() if "shm" in transports else {}
    result = {"rows": rows, "memory": memory, "shm_profile_us": profile, "quick": quick, "wall_s": time.monotonic() - t_start,
              "load": os.getloadavg(), "lines": headline_lines(rows)}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "dataplane.json").write_text(json.dumps(result, indent=1))
    return result


def _row(rows: list[dict[str, Any]], transport: str, size: int) -> dict[str, Any] | None:
    return next((r for r in rows if r["transport"] == transport and r["size"] == size), None)


def headline_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The lines docs/benchmarks.md must carry, in exactly this form."""
    lines = []
    mib = 1 << 20
    shm, copy = _row(rows, "shm", mib), _row(rows, "copy", mib)
    if shm and copy:
        lines.append(f"shared memory vs in-process copy at 1 MiB: {100 * shm['mib_s'] / copy['mib_s']:.0f}%")
    red, raw = _row(rows, "redis", mib), _row(rows, "raw", mib)
    if red and raw:
        lines.append(f"redis transport vs raw SET/GET at 1 MiB: {100 * red['mib_s'] / raw['mib_s']:.0f}%")
    small = _row(rows, "engine", 4 << 10) or _row(rows, "inline", 4 << 10)
    if small:
        lines.append(f"4 KiB chunk overhead p50: {small['p50_ms']:.2f} ms")
    return lines


def analysis(result: dict[str, Any]) -> list[str]:
    """The targets of issue 11 against this run, and what bounds the ones that are missed."""
    rows, mib = result["rows"], 1 << 20
    out = []

    def pct(a: str, b: str, size: int) -> float | None:
        ra, rb = _row(rows, a, size), _row(rows, b, size)
        return 100 * ra["mib_s"] / rb["mib_s"] if ra and rb else None

    shm = [(size_label(s), pct("shm", "copy", s)) for s in (mib, 16 * mib)]
    red = pct("redis", "raw", mib)
    small = _row(rows, "engine", 4 << 10) or _row(rows, "inline", 4 << 10)
    if all(p is not None for _, p in shm):
        met = all(p >= 50 for _, p in shm if p is not None)
        out.append("Targets: shared memory ≥ 50 % of the in-process copy at 1 MiB and up — "
                   + ", ".join(f"{label} {p:.0f}%" for label, p in shm) + (" (met)." if met else " (not met: see below)."))
    if red is not None:
        out[-1:] = [out[-1] + f" Redis transport ≥ 50 % of raw SET/GET — {red:.0f}% at 1 MiB"
                    + (" (met)." if red >= 50 else " (not met).")]
    if small:
        out[-1:] = [out[-1] + f" 4 KiB overhead ≤ 0.3 ms p50 — {small['p50_ms']:.2f} ms"
                    + (" (met)." if small["p50_ms"] <= 0.3 else " (not met: see below).")]
        out += ["", "The 4 KiB line is measured through the engine when that row exists: two worker processes "
                "(`omniflow worker --stage src` / `dst`) and a reconciler, one chunk in flight at a time, from the "
                "producer's `emit` (group commit, `emit.lua` writing the edge log and the consumer's inbox) to the "
                "consumer's session holding the payload (inbox XREAD, decode). Each hop is a process wake-up on 2 "
                "cores that other work shares; the two-process rows above (no Lua, no worker runtime) show the floor "
                "of the same path."]
    prof = result.get("shm_profile_us") or {}
    floor = _row(rows, "inline", 4 << 10)          # the notification path alone, between two processes
    if prof and floor:
        kernel = sum(us for step, us in prof.items() if "kernel" in step)
        steady = sum(us for step, us in prof.items() if "recycled" in step or "get" in step or "touch" in step
                     or "hand back" in step)
        copy = prof.get("in-process numpy copy", 0.0)
        rate = floor["mib_s"] * mib / (4 << 10)
        out += ["", f"What bounds shared memory (the profile above): a new 1 MiB segment costs {kernel:,.0f} µs of "
                f"kernel page work (allocate + copy, then free: about 1 µs per 4 KiB page on this VM), which is why "
                f"a producer recycles its segments once their consumer is done (pages stay allocated and mapped); "
                f"in steady state a chunk's own work is {steady:,.0f} µs (recycled put, get, page faults, hand back) "
                f"against {copy:,.0f} µs for an in-process copy into warm heap memory. What remains is the chunk's "
                f"notification on the engine's path (edge + inbox XADD, XREAD, ack), which the inline 4 KiB row measures: "
                f"{rate:,.0f} chunks/s here, i.e. at most {rate:,.0f} MiB/s at 1 MiB for any transport that "
                f"notifies per chunk. Past it: notifications batched per emit call (the engine's batcher does that "
                f"under load; this benchmark sends one pipeline per chunk)."]
    return out


def size_label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def table(result: dict[str, Any]) -> list[str]:
    """The markdown table: one row per transport and size."""
    order = ["copy", "shm", "redis", "raw", "inline", "engine", "engine-redis"]
    md = ["| transport | chunk | p50 ms | p99 ms | MiB/s |", "|---|---:|---:|---:|---:|"]
    for transport in order:
        for size in SIZES:
            r = _row(result["rows"], transport, size)
            if r:
                thr = "–" if r["mib_s"] != r["mib_s"] else f"{r['mib_s']:,.0f}"      # NaN: latency only
                md.append(f"| {LABELS[transport]} | {size_label(size)} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                          f"{thr} |")
    if result.get("shm_profile_us"):
        md += ["", "Where a 1 MiB shared-memory chunk's time goes (one process, step by step, µs, median):", "",
               "| step | µs |", "|---|---:|"]
        md += [f"| {step} | {us:,.0f} |" for step, us in result["shm_profile_us"].items()]
    md += ["", "| transport | Redis memory per MiB of payload | AOF bytes per MiB of payload |", "|---|---:|---:|"]
    for transport, m in result["memory"].items():
        mem, aof = (round(m[k], 2) + 0.0 for k in ("redis_mem_per_mib", "aof_per_mib"))     # no "-0.00"
        md.append(f"| {LABELS[transport]} | {mem:.2f} MiB | {aof:.2f} MiB |")
    return md


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for transport in ["copy", "shm", "redis", "raw", "inline"]:
        rows = [r for r in result["rows"] if r["transport"] == transport and r["size"] in SIZES]
        if not rows:
            continue
        xs = [r["size"] / 1024 for r in rows]
        color = COLORS[transport]
        axes[0].plot(xs, [r["mib_s"] for r in rows], marker="o", label=LABELS[transport], color=color)
        if transport != "copy":
            axes[1].plot(xs, [r["p50_ms"] for r in rows], marker="o", label=LABELS[transport], color=color)
    for ax, title in ((axes[0], "throughput, MiB/s (log)"), (axes[1], "p50 latency per chunk between processes, ms (log)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks([size / 1024 for size in SIZES], [size_label(size) for size in SIZES])
        ax.set_yscale("log")
        ax.set_xlabel("chunk size")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--role", choices=["producer", "consumer"])
    ap.add_argument("--url")
    ap.add_argument("--prefix")
    ap.add_argument("--transport", choices=TRANSPORTS)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.role == "producer":
        asyncio.run(producer(args.url, args.prefix, args.transport, args.quick))
        return 0
    if args.role == "consumer":
        asyncio.run(consumer(args.url, args.prefix, args.transport, args.out))
        return 0
    result = run(args.quick)
    print("\n".join(table(result)))
    print()
    print("\n".join(result["lines"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
