"""Client CPU per Redis round trip: the lean transport (`omniflow.storage.resp`) against redis-py.

Two `RedisClient`s on one embedded Valkey, alike but for the transport: one standalone client as
`connect` makes it (the lean transport), one whose connection class is a subclass of redis-py's
(`Transport.for_client` refuses it: every command through redis-py, as before the transport). The
same cases run through both, alternated in short blocks in one process, so the VM's drifts (this
2-vCPU machine moves by 15 % and more) hit both alike; the medians and minima of the blocks'
`time.process_time` per round trip are printed:

- `fcall`: one FCALL through the script runner (`runner.execute`: the batcher's path);
- `pipe3`: FCALL, HSET, HGET in one round trip through the runner;
- `pipeline3`: `RedisClient.pipeline()` with HGETALL, XREVRANGE, GET (the document reads);
- `xread`: a blocking XREAD that returns one entry, written meanwhile by another client (its XADD's
  cost, measured alone, subtracted).

    .venv/bin/python bench/transport.py [--blocks 20] [--per-block 400]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis.asyncio import Redis

from omniflow.ops.embedded import EmbeddedServer
from omniflow.storage import runner
from omniflow.storage.client import RedisClient, connect
from omniflow.storage.topology import FastConnection

LIB = "#!lua name=transport_bench\nredis.register_function('transport_bench_one', function() return 1 end)"
KEY = "transport-bench"


class RedisPyConnection(FastConnection):
    """redis-py's connection as omniflow configures it, under a name the lean transport refuses."""


async def measure(url: str, blocks: int, per_block: int) -> dict[str, dict[str, float]]:
    clients = {"redis-py": RedisClient(Redis.from_url(url, connection_class=RedisPyConnection, socket_keepalive=True)),
               "lean": connect(url)}
    assert clients["lean"].lean is not None and clients["redis-py"].lean is None
    writer = connect(url)
    await writer.raw.function_load(LIB, replace=True)
    await writer.delete(f"{KEY}:s", f"{KEY}:h")
    last = [await writer.xadd(f"{KEY}:s", {"f": "v"}, maxlen=100)]

    def cases(redis: RedisClient) -> dict[str, Callable[[], Awaitable[object]]]:
        async def xread() -> None:
            reading = asyncio.ensure_future(redis.xread({f"{KEY}:s": last[0]}, count=1, block=2000))
            await asyncio.sleep(0)          # the read on the wire before the entry is written
            await asyncio.sleep(0)
            await writer.xadd(f"{KEY}:s", {"f": "v"}, maxlen=100)
            (_, entries), = await reading
            last[0] = entries[-1][0]

        return {
            "fcall": lambda: runner.execute(redis, [("FCALL", "transport_bench_one", 0)]),
            "pipe3": lambda: runner.execute(redis, [("FCALL", "transport_bench_one", 0), ("HSET", f"{KEY}:h", "f", "v"),
                                                    ("HGET", f"{KEY}:h", "f")]),
            "pipeline3": lambda: redis.pipeline().hgetall(f"{KEY}:h").xrevrange(f"{KEY}:s", count=1)
            .get(f"{KEY}:none").execute(),
            "xread": xread,
            "xadd alone": lambda: writer.xadd(f"{KEY}:s", {"f": "v"}, maxlen=100),
        }

    samples: dict[tuple[str, str], list[float]] = {}
    for block in range(-1, blocks):               # block -1: warm-up, not kept
        sides = list(clients) if block % 2 == 0 else list(reversed(clients))
        for side in sides:
            for name, case in cases(clients[side]).items():
                n = per_block // 2 if name.startswith("x") else per_block
                started = time.process_time()
                for _ in range(n):
                    await case()
                if block >= 0:
                    samples.setdefault((name, side), []).append((time.process_time() - started) / n * 1e6)
    for client in (*clients.values(), writer):
        await client.aclose()
    out = {f"{name} {side}": {"median_us": round(statistics.median(s), 1), "min_us": round(min(s), 1)}
           for (name, side), s in samples.items()}
    for side in clients:
        out[f"xread - xadd {side}"] = {k: round(out[f"xread {side}"][k] - out[f"xadd alone {side}"][k], 1)
                                       for k in ("median_us", "min_us")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--per-block", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(data_dir=Path(tmp), appendonly=False).start()
        try:
            results = asyncio.run(measure(server.url, args.blocks, args.per_block))
        finally:
            server.stop()
    for name, figures in sorted(results.items()):
        print(f"{name:24s} {json.dumps(figures)}")


if __name__ == "__main__":
    main()
