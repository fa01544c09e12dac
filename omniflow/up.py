"""`omniflow up`: everything in one command.

Starts the embedded Valkey (when `OMNIFLOW_REDIS_URL` is unset; AOF on, data in
`$OMNIFLOW_HOME/valkey`), then the reconciler, one worker process per stage
replica and the API, each as a child process, and supervises them: a child
that dies is restarted (its sessions were already re-queued by the
reconciler). Ctrl-C / SIGTERM stops the children, then Valkey.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from omniflow.config import Settings
from omniflow.embedded import EmbeddedServer
from omniflow.pipeline import Pipeline

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = 0.0

    def start(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(self.argv, env=env)
        self.started_at = time.monotonic()


@dataclass
class Supervisor:
    settings: Settings
    pipeline: Pipeline
    pipeline_path: Path
    api: bool = True
    host: str = "127.0.0.1"
    port: int = 8000
    fsync: str = "everysec"
    colocate: bool = False       # one worker process per replica serving every stage (one small box)
    children: list[Child] = field(default_factory=list)
    server: EmbeddedServer | None = None
    _stop: bool = False

    def url_file(self) -> Path:
        return self.settings.home / "redis.url"

    def start_redis(self) -> str:
        if self.settings.redis_url:
            return self.settings.redis_url
        self.server = EmbeddedServer(data_dir=(self.settings.home / "valkey").resolve(), appendonly=True,
                                     appendfsync=self.fsync)
        self.server.start()
        self.settings.home.mkdir(parents=True, exist_ok=True)
        self.url_file().write_text(self.server.url + "\n")
        return self.server.url

    def plan_children(self) -> list[Child]:
        exe = [sys.executable, "-m", "omniflow.cli"]
        children = [Child("reconciler", [*exe, "reconciler"]), Child("jobs", [*exe, "jobs"])]
        if self.colocate:
            # the widest stage sets how many: each process serves every stage (DESIGN §1: a stage is not a GPU)
            for i in range(max(spec.replicas for spec in self.pipeline.stages.values())):
                children.append(Child(f"worker:all:{i}", [*exe, "worker", "--stage", "all"]))
        else:
            for stage in self.pipeline.order:
                for i in range(self.pipeline.stages[stage].replicas):
                    children.append(Child(f"worker:{stage}:{i}", [*exe, "worker", "--stage", stage]))
        if self.api:
            children.append(Child("api", [*exe, "api", "--host", self.host, "--port", str(self.port)]))
        return children

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        url = self.start_redis()
        env = {**os.environ, "OMNIFLOW_REDIS_URL": url, "OMNIFLOW_PIPELINE": str(self.pipeline_path.resolve()),
               "OMNIFLOW_PREFIX": self.settings.prefix}
        self.children = self.plan_children()
        try:
            for child in self.children:
                child.start(env)
            where = f"API on http://{self.host}:{self.port}" if self.api else "no API"
            print(f"omniflow is up: pipeline {self.pipeline.name}, Redis {url}, {where}. Ctrl-C stops it.",
                  flush=True)
            while not self._stop:
                time.sleep(0.2)
                for child in self.children:
                    assert child.proc is not None
                    if child.proc.poll() is not None and not self._stop:
                        delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                        logger.warning("%s exited with %s; restarting in %.1fs", child.name, child.proc.returncode,
                                       delay)
                        time.sleep(delay)
                        child.restarts += 1
                        child.start(env)
            return 0
        finally:
            self.shutdown()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stop = True

    def shutdown(self) -> None:
        for child in self.children:
            if child.proc and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        if self.server is not None:
            self.server.stop()
            self.url_file().unlink(missing_ok=True)
        print("omniflow stopped.", flush=True)
