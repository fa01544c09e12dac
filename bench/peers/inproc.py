"""In-process asyncio: three stages linked by asyncio.Queue, no Redis, no durability.

The floor a non-durable in-process orchestrator (vLLM-Omni style) sits at. Runs in
the harness process; the Redis URL is ignored.
"""
from __future__ import annotations

import asyncio
import time

from bench import workload
from bench.common import Result, summarize


async def _pipeline(n: int, one_at_a_time: bool) -> list[tuple[str, float, float]]:
    q_think: asyncio.Queue = asyncio.Queue()
    q_talk: asyncio.Queue = asyncio.Queue()
    q_wav: asyncio.Queue = asyncio.Queue()
    records: list[tuple[str, float, float]] = []
    waiters: dict[str, asyncio.Future] = {}

    async def thinker() -> None:
        while True:
            wf, ts, prompt = await q_think.get()
            q_talk.put_nowait((wf, ts, workload.thinker(prompt)))

    async def talker() -> None:
        while True:
            wf, ts, texts = await q_talk.get()
            q_wav.put_nowait((wf, ts, workload.talker(texts)))

    async def code2wav() -> None:
        while True:
            wf, ts, codes = await q_wav.get()
            workload.code2wav(codes)
            records.append((wf, ts, time.time()))
            fut = waiters.pop(wf, None)
            if fut is not None:
                fut.set_result(None)

    tasks = [asyncio.create_task(c()) for c in (thinker, talker, code2wav)]
    loop = asyncio.get_running_loop()
    try:
        if one_at_a_time:
            for i in range(n):
                wf = f"lat-{i}"
                fut = waiters[wf] = loop.create_future()
                q_think.put_nowait((wf, time.time(), "hello"))
                await fut
        else:
            done = loop.create_future()
            last = f"wf-{n - 1}"
            waiters[last] = done
            for i in range(n):
                q_think.put_nowait((f"wf-{i}", time.time(), "hello"))
                if i % 256 == 255:
                    await asyncio.sleep(0)       # let the stages run while submitting
            await asyncio.wait_for(done, 60)
            while len(records) < n:              # FIFO: the last one done means all done
                await asyncio.sleep(0)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


def run_throughput(url: str | None, n: int, procs: int = 1) -> Result:
    records = asyncio.run(_pipeline(n, one_at_a_time=False))
    return summarize("inproc-asyncio", "asyncio.Queue x3", 1, records,
                     extra={"topology": "1 process, 3 tasks", "submit_mode": "in-process"})


def run_latency(url: str | None, n: int, procs: int = 1) -> Result:
    records = asyncio.run(_pipeline(n, one_at_a_time=True))
    return summarize("inproc-asyncio", "asyncio.Queue x3", 1, records, mode="latency",
                     extra={"topology": "1 process, 3 tasks"})
