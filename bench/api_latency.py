"""The HTTP path against the raw Python client: the `http` rows of `make bench`, and a CLI.

Starts an embedded Valkey (no AOF), the engine as real processes (`omniflow reconciler`, one
`omniflow worker --stage all`) on the user-path toy pipeline (bench/omniflow_bench.py's default-executor
stages; every setting at its default) and a real `omniflow api` process, then measures from this
process, on one server, one after the other:

- `GET /healthz`, one at a time: the HTTP floor;
- `POST /v1/workflows` -> 202, one at a time (submit only; the backlog drains before the next part);
- submit + wait over HTTP (httpx): `POST /v1/workflows` then `GET /v1/workflows/{id}?wait=30` (the
  document) per workflow, c = 1 and c = 8 concurrent loops; against the same workload through the
  Python `AsyncClient` (`submit` then `wait`, which returns the document), c = 1 and c = 8.
  workflows/s counts workflows (each is 2 HTTP requests); p50/p99 are POST (submit) -> document;
- submit and wait in one request: `POST /v1/workflows?wait=30` (the document), c = 1 and c = 8, against
  the same `AsyncClient` rows;
- the long-poll wake-up: the thinker works `--work-ms` (per-request stage params), the wake-up is the
  time from the workflow's `finished_at` (stamped by the transition that made it terminal) to the
  client holding the document.

    .venv/bin/python bench/api_latency.py [--n 300] [--waits 100] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from bench.common import (
    BenchError, ProcessCPU, Result, cost_delta, format_table, redis_client, running, server_stats, start_server,
    summarize,
)
from bench.omniflow_bench import USER_STAGES, Engine, pipeline_yaml

CONCURRENCY = 8
HTTP, CLIENT = "omniflow http", "omniflow client"        # the `system` of the rows
WAIT_S = 30
Record = tuple[str, float, float]
OneWorkflow = Callable[[str], Awaitable[tuple[str, dict[str, Any]]]]


async def wait_ready(http: httpx.AsyncClient, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await http.get("/readyz")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.05)
    raise BenchError("the API did not become ready")


async def closed_loops(one: OneWorkflow, tag: str, n: int, concurrency: int) -> list[Record]:
    """`concurrency` loops, each running one workflow after another (`one` submits, waits, returns the
    document) until n have run; records are (id, start, document in hand)."""
    records: list[Record] = []
    indexes = iter(range(n))

    async def loop() -> None:
        for i in indexes:
            t0 = time.time()
            wf, doc = await one(f"{tag}{i}")
            records.append((wf, t0, time.time()))
            if doc.get("state") != "completed":
                raise BenchError(f"workflow {wf} ended {doc.get('state')!r}: {doc.get('error')!r:.300}")

    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return records


class Paths:
    """The same workflow through HTTP and through the Python client."""

    def __init__(self, http: httpx.AsyncClient, client: Any) -> None:
        self.http, self.client = http, client

    async def http_one(self, text: str) -> tuple[str, dict[str, Any]]:
        resp = await self.http.post("/v1/workflows", json={"input": {"text": text}})
        if resp.status_code != 202:
            raise BenchError(f"POST /v1/workflows answered {resp.status_code}: {resp.text[:300]}")
        wf = resp.json()["id"]
        doc = await self.http.get(f"/v1/workflows/{wf}", params={"wait": WAIT_S})
        return wf, doc.json()

    async def http_post_wait(self, text: str) -> tuple[str, dict[str, Any]]:
        """Submit and wait in one request: `POST /v1/workflows?wait=` answers with the document."""
        resp = await self.http.post("/v1/workflows", params={"wait": WAIT_S}, json={"input": {"text": text}})
        if resp.status_code != 200:
            raise BenchError(f"POST /v1/workflows?wait= answered {resp.status_code}: {resp.text[:300]}")
        doc = resp.json()
        return str(doc["id"]), doc

    async def client_one(self, text: str) -> tuple[str, dict[str, Any]]:
        wf = await self.client.submit(text)
        return wf, await self.client.wait(wf, timeout_s=WAIT_S)


async def _timed(call: Callable[[int], Awaitable[str]], n: int) -> list[Record]:
    out: list[Record] = []
    for i in range(n):
        t0 = time.time()
        out.append((await call(i), t0, time.time()))
    return out


async def measure(base_url: str, eng: Engine, r: Any, procs: list[Any], n: int, waits: int,
                  work_ms: float) -> list[Result]:
    from omniflow.client import AsyncClient
    from omniflow.config import Settings
    from omniflow.pipeline import load_pipeline

    rows: list[Result] = []

    def row(system: str, variant: str, records: list[Record], before: Any, meter: ProcessCPU) -> Result:
        cost = cost_delta(before, server_stats(r), len(records))
        cost.update(ProcessCPU.per_wf(meter.take(), len(records)))
        rows.append(summarize(system, variant, 1, records, mode="http", extra=cost))
        return rows[-1]

    limits = httpx.Limits(max_connections=2 * CONCURRENCY, max_keepalive_connections=2 * CONCURRENCY)
    settings = Settings(redis_url=eng.url, prefix=eng.prefix)
    async with httpx.AsyncClient(base_url=base_url, timeout=WAIT_S + 30, limits=limits) as http, \
            AsyncClient(eng.url, settings=settings, pipeline=load_pipeline(eng.yaml)) as client:
        await wait_ready(http)
        paths = Paths(http, client)
        await closed_loops(paths.http_one, "warm-h", 50, CONCURRENCY)
        await closed_loops(paths.client_one, "warm-c", 50, CONCURRENCY)

        before, meter = server_stats(r), ProcessCPU(r, procs)
        health = await _timed(lambda i: _get_ok(http, "/healthz", str(i)), n)
        row(HTTP, "GET /healthz (HTTP floor)", health, before, meter)

        async def post(i: int) -> str:
            resp = await http.post("/v1/workflows", json={"input": {"text": f"s{i}"}})
            if resp.status_code != 202:
                raise BenchError(f"POST /v1/workflows answered {resp.status_code}: {resp.text[:300]}")
            return str(resp.json()["id"])

        before, meter = server_stats(r), ProcessCPU(r, procs)
        posted = await _timed(post, n)
        row(HTTP, "POST /v1/workflows -> 202 (submit only; the cost columns include the workflows' run)", posted, before, meter)
        for wf, _t0, _t1 in posted:                       # drain the backlog before the next part
            await client.wait(wf, timeout_s=WAIT_S)

        for concurrency in (1, CONCURRENCY):
            for system, how, one, requests in (
                    (HTTP, "POST + GET ?wait=30 (httpx)", paths.http_one, 2),
                    (HTTP, "POST ?wait=30: submit and wait in one request (httpx)", paths.http_post_wait, 1),
                    (CLIENT, "AsyncClient submit + wait", paths.client_one, 0)):
                before, meter = server_stats(r), ProcessCPU(r, procs)
                records = await closed_loops(one, f"{system.split()[-1]}{requests}{concurrency}-", n, concurrency)
                res = row(system, f"{how}, c={concurrency}", records, before, meter)
                res.extra["concurrency"] = concurrency
                if requests:
                    res.extra["requests_per_s"] = round(requests * res.workflows_per_s, 1)

        wake: list[Record] = []
        params = {"thinker": {"work_s": work_ms / 1000}}
        before, meter = server_stats(r), ProcessCPU(r, procs)
        for i in range(waits):
            resp = await http.post("/v1/workflows", json={"input": {"text": f"w{i}"}, "stage_params": params})
            doc = (await http.get(resp.json()["links"]["self"], params={"wait": WAIT_S})).json()
            received = time.time()
            if doc["state"] != "completed":
                raise BenchError(f"wake-up workflow ended {doc['state']!r}")
            wake.append((doc["id"], float(doc["finished_at"]), received))
        row(HTTP, f"GET ?wait wake-up after terminal (thinker works {work_ms:.0f} ms)", wake, before, meter)
    return rows


async def _get_ok(http: httpx.AsyncClient, path: str, tag: str) -> str:
    resp = await http.get(path)
    if resp.status_code != 200:
        raise BenchError(f"GET {path} answered {resp.status_code}")
    return tag


def run(*, quick: bool = False, n: int | None = None, waits: int | None = None, work_ms: float = 80.0) -> list[Result]:
    """The `http` rows (mode "http"), each on the same fresh server and engine."""
    from omniflow.ops.embedded import free_port

    n = n or (100 if quick else 400)
    waits = waits or (20 if quick else 100)
    with start_server() as server:
        eng = Engine(server.url, 1, pipeline_yaml(1, stages=USER_STAGES), colocated=True, defaults=True)
        port = free_port()
        cmds = [*eng.commands(), ("omniflow-api", [sys.executable, "-m", "omniflow.cli", "api",
                                                   "--host", "127.0.0.1", "--port", str(port)])]
        r = redis_client(server.url)
        with running(cmds, env=eng.env) as procs:
            eng.wait_ready(r, procs)
            rows = asyncio.run(measure(f"http://127.0.0.1:{port}", eng, r, procs, n, waits, work_ms))
    topology = "1 `omniflow worker --stage all` + 1 `omniflow reconciler` + 1 `omniflow api`, default settings"
    for res in rows:
        res.extra["topology"] = topology
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=None, help="workflows per part (default 400; quick 100)")
    parser.add_argument("--waits", type=int, default=None, help="long-poll wake-ups to time (default 100)")
    parser.add_argument("--work-ms", type=float, default=80.0, help="thinker time per workflow in the wake-up test")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(format_table(run(quick=args.quick, n=args.n, waits=args.waits, work_ms=args.work_ms), markdown=False))


if __name__ == "__main__":
    main()
