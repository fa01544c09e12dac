"""The `tracing` rows of `make bench`: what OpenTelemetry traces cost the hot path.

The omniflow reference row with one worker process serving the three stages (the row where the
engine's own CPU bounds throughput), run three ways, interleaved with the other rows:

- `tracing off`: no `OTEL_TRACES_EXPORTER` (the default): the SDK is never imported, every call
  site makes one check;
- `tracing on, nothing sampled`: `OTEL_TRACES_EXPORTER=otlp` with `OTEL_TRACES_SAMPLER=always_off`:
  the context is carried (record, claim, decisions), spans are non-recording;
- `tracing on, every span exported`: every span (the client's submit, 3 sessions with their chunk
  events, the reconciler's decision) exported with OTLP/HTTP to a local sink (`python -m
  bench.tracing_bench sink PORT`, a process that answers 200 to every export).

The client process (this harness) traces its submits too while a row is on. `bench/report.py`
prints the ratios (`tracing_lines`).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import REPO_ROOT, BenchError, Result, bench_env

MODES = {
    "off": "tracing off",
    "unsampled": "tracing on, nothing sampled",
    "exported": "tracing on, every span exported",
}


def _free_port() -> int:
    from omniflow.ops.embedded import free_port

    return free_port()


@contextlib.contextmanager
def _sink() -> Iterator[str]:
    """An OTLP/HTTP sink in its own process; yields its endpoint."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.tracing_bench", "sink", str(port)], cwd=REPO_ROOT,
                            env=bench_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        import socket

        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise BenchError("the OTLP sink did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _environment(mode: str) -> Iterator[None]:
    """The row's OTEL_* variables in this process (inherited by the engine's processes), and this
    process's own tracing (its submits) on for the row."""
    from omniflow import tracing

    names = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_SERVICE_NAME")
    saved = {k: os.environ.get(k) for k in names}
    for k in names:
        os.environ.pop(k, None)
    try:
        if mode == "off":
            yield
            return
        with _sink() as endpoint:
            os.environ.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
            if mode == "unsampled":
                os.environ["OTEL_TRACES_SAMPLER"] = "always_off"
            tracing.setup("bench")
            try:
                yield
            finally:
                tracing.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(redis_url: str, n: int, mode: str) -> Result:
    from bench import omniflow_bench

    with _environment(mode):
        res = omniflow_bench.run_throughput(redis_url, n, 1, colocated=True)
    res.variant = f"{res.variant}, {MODES[mode]}"
    res.extra["tracing"] = mode
    return res


def sink(port: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "sink":
        sink(int(sys.argv[2]))
    else:
        from bench.common import start_server

        n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
        for mode in MODES:
            with start_server() as server:
                r = run(server.url, n, mode)
                print(f"{r.variant}: {r.workflows_per_s:,.0f} wf/s, cpu/wf {r.extra.get('cpu_us_per_wf_total')} µs")
