"""The compute-thread hop, measured alone: what an input or an emit costs when the executor runs on its
stage's compute thread (the default `runs_on = "thread"`) instead of on the worker's loop.

A real engine `Session` with a stub batcher (every write answers 'ok' on the next loop turn, no Redis),
and the Talker pattern: for each input chunk, one emit. The worker's loop feeds the session's input
queue as the inbox does; the executor runs on a `ComputeThread` or on the loop itself.

- latency: one chunk at a time (fed, then its emit seen on the worker's loop, then the next): per round
  trip, an input in and an emit out; `hop` = (thread - loop) / 2, the cost of one handoff;
- burst: N chunks fed at once, until N emits are seen: the cost per item when handoffs can batch;
- wake-up: the worker's loop and a compute thread's loop hand one call back and forth, N round trips,
  through asyncio's `call_soon_threadsafe` (its self-pipe) and through `Handoff` (an eventfd after the
  first batch): CPU of the process (both threads) and wall time per round trip, two wake-ups each.

    .venv/bin/python bench/hop.py [--n 2000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import on_worker_loop
from omniflow.dataplane import codec
from omniflow.engine.compute import ComputeThread, handoff
from omniflow.engine.session import Session
from omniflow.models import SessionState
from omniflow.storage.keys import Keys


class StubBatcher:
    """What a session needs of the batcher: writes answered 'ok' on the next loop turn; counts emits."""

    def __init__(self) -> None:
        self.steps = 0
        self.calls = 0
        self.seen = asyncio.Event()
        self.want = 0

    def send(self, *command: Any, **_: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        build = command[0] if len(command) == 1 and callable(command[0]) else None

        def answer() -> None:
            if build is not None:
                build()
            if not fut.done():
                fut.set_result(b"ok")
        loop.call_soon(answer)
        return fut

    def send_lazy(self, build: Any) -> asyncio.Future[Any]:
        return self.send(build)


class CountingSession(Session):
    """Counts the steps that reach the worker's loop (`_push` runs there)."""

    def _push(self, step: list[Any]) -> None:
        super()._push(step)
        b: StubBatcher = self._batcher     # type: ignore[assignment]
        b.steps += 1
        if b.steps >= b.want:
            b.seen.set()


async def talker(session: Session) -> int:
    n = 0
    async for chunk in session.inputs():
        await session.emit(data=[chunk.data, n])
        n += 1
    return n


def _fields(seq: int) -> dict[bytes, bytes]:
    return {b"seq": str(seq).encode(), b"a": b"1", b"d": codec.dumps(seq)}


async def _one(mode: str, n: int, compute: ComputeThread | None) -> float:
    """Seconds for n chunks through one session (latency: one at a time; burst: all at once)."""
    batcher = StubBatcher()
    loop = asyncio.get_running_loop()
    session = CountingSession(wf_id="hopbench", stage="talker", attempt=1, input={}, params={}, finals=(),
                              downstream=("code2wav",), resume_seq=0, _batcher=batcher,  # type: ignore[arg-type]
                              _keys=Keys("hopbench"), upstream=("thinker",), state=SessionState.WAITING_INPUT,
                              _home=loop if compute is not None else None)
    run = compute.run(talker(session)) if compute is not None else talker(session)
    task = asyncio.ensure_future(run)
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    if mode == "burst":
        batcher.want = n
        for seq in range(1, n + 1):
            session._queue.put_nowait(("thinker", _fields(seq)))
        await batcher.seen.wait()
    else:
        for seq in range(1, n + 1):
            batcher.want = seq
            batcher.seen.clear()
            session._queue.put_nowait(("thinker", _fields(seq)))
            await batcher.seen.wait()
    took = time.perf_counter() - started
    session._queue.put_nowait(("thinker", {b"eos": b"1"}))
    assert await task == n
    return took


async def _ping_pong(n: int, compute: ComputeThread, how: str) -> tuple[float, float]:
    """(CPU µs, wall µs) per round trip of one call between this loop and the compute thread's."""
    here, there = asyncio.get_running_loop(), compute.loop
    done = asyncio.Event()
    count = 0

    def send(loop: asyncio.AbstractEventLoop, fn: Any) -> None:
        if how == "self-pipe":
            loop.call_soon_threadsafe(fn)
        else:
            handoff(loop).call(fn)

    def on_there() -> None:
        send(here, on_here)

    def on_here() -> None:
        nonlocal count
        count += 1
        if count >= n:
            done.set()
        else:
            send(there, on_there)

    cpu, wall = time.process_time(), time.perf_counter()
    send(there, on_there)
    await done.wait()
    return (time.process_time() - cpu) / n * 1e6, (time.perf_counter() - wall) / n * 1e6


async def measure(n: int, rounds: int) -> dict[str, Any]:
    compute = ComputeThread("hopbench")
    out: dict[str, Any] = {}
    try:
        for where in (None, compute):           # warm-up: first-call costs out of the figures
            await _one("burst", 100, where)
        for mode in ("latency", "burst"):
            per: dict[str, list[float]] = {"loop": [], "thread": []}
            for _ in range(rounds):
                for where in ("loop", "thread"):
                    per[where].append(await _one(mode, n, compute if where == "thread" else None) / n * 1e6)
            loop_us, thread_us = statistics.median(per["loop"]), statistics.median(per["thread"])
            # latency: a round trip is two handoffs (the input in, the emit out); burst: per item
            hop_us = (thread_us - loop_us) / (2 if mode == "latency" else 1)
            out[mode] = {"loop_us_per_item": round(loop_us, 1), "thread_us_per_item": round(thread_us, 1),
                         "hop_us": round(hop_us, 1), "runs_thread_us": [round(x, 1) for x in per["thread"]]}
        await _ping_pong(200, compute, "handoff")       # wires both loops' eventfds (their first batches)
        wake: dict[str, list[tuple[float, float]]] = {"self-pipe": [], "handoff": []}
        for _ in range(rounds):
            for how in wake:
                wake[how].append(await _ping_pong(n * 5, compute, how))
        out["wakeup"] = {how: {"cpu_us_per_round_trip": round(statistics.median(c for c, _ in runs), 1),
                               "wall_us_per_round_trip": round(statistics.median(w for _, w in runs), 1)}
                         for how, runs in wake.items()}
    finally:
        compute.stop()
    return out


def run(*, quick: bool = False) -> list[Any]:
    """The `user` group's hop rows for bench/run.py: p50 = the hop in ms (thread minus loop, the median
    of the rounds), p99 = the worst round's; wf/s = items per second through the compute thread."""
    from bench.common import Result

    n, rounds = (300, 3) if quick else (2000, 3)
    res = on_worker_loop(measure(n, rounds))
    rows = []
    for mode, what in (("latency", "one chunk at a time, ms per handoff"), ("burst", f"{n} chunks at once, ms per item")):
        row = dict(res[mode], wakeup=res["wakeup"]) if mode == "latency" else res[mode]
        per_handoff = 2 if mode == "latency" else 1
        worst = (max(row["runs_thread_us"]) - row["loop_us_per_item"]) / per_handoff
        rows.append(Result("omniflow", f"compute-thread hop (bench/hop.py): {what}", 1, n,
                           round(1e6 / row["thread_us_per_item"], 1), row["hop_us"] / 1000, round(worst / 1000, 3),
                           extra=dict(row), mode="hop"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    res = on_worker_loop(measure(args.n, args.rounds))
    print(json.dumps(res, indent=1))
    for mode in ("latency", "burst"):
        row = res[mode]
        print(f"compute-thread hop ({mode}): {row['hop_us'] / 1000:.3f} ms "
              f"(thread {row['thread_us_per_item']:.1f} us/item, loop {row['loop_us_per_item']:.1f} us/item)")
    for how, row in res["wakeup"].items():
        print(f"wake-up round trip through {how}: {row['cpu_us_per_round_trip']:.1f} us of CPU, "
              f"{row['wall_us_per_round_trip']:.1f} us wall")


if __name__ == "__main__":
    main()
