"""`omniflow up`: everything in one command.

Starts the embedded Valkey (when `OMNIFLOW_REDIS_URL` is unset; AOF on, data in
`$OMNIFLOW_HOME/valkey`), then the reconciler, the jobs runner, one worker
process per stage replica and the API, each as a child process, and supervises
them all:

- one `up` per home: an OS lock on `$OMNIFLOW_HOME/up.lock` (released by the
  kernel when its holder dies) refuses a second one, naming the first;
- a child that dies is restarted with backoff (its sessions were re-queued by
  the reconciler); the embedded Valkey too, from its AOF, on the same port;
- a Valkey reading a large AOF back (at the start, or restarted) is waited for as
  long as it loads, its progress printed (`loading N% after T s, about E s
  left`); Ctrl-C meanwhile stops it cleanly;
- a child that cannot start (it exits with a configuration error, or keeps
  exiting right after its start) stops `up` with the reason, and "is up" is
  printed only once the API answers;
- nothing outlives `up`: every child gets SIGTERM from the kernel if `up` dies
  (PR_SET_PDEATHSIG), and a Valkey left behind anyway is found by its pid file
  and stopped at the next `up`.

Ctrl-C / SIGTERM stops the children, then Valkey.
"""
from __future__ import annotations

import collections
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from omniflow.config import Settings
from omniflow.ops.embedded import EmbeddedServer, Loading, _die_with_parent, stop_orphan
from omniflow.errors import ConfigError
from omniflow.pipeline import Pipeline

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
LOCK_FILE = "up.lock"
STARTUP_GRACE_S = 5.0           # a child that exits sooner than this after its start did not start
MAX_FAILED_STARTS = 3           # ... and after this many such exits in a row, `up` stops
API_READY_TIMEOUT_S = 60.0
EXIT_CONFIG = 2                 # the CLI's "bad input" (a child that exits with it will never start)
STDERR_TAIL_LINES = 20
POLL_S = 0.2


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    failed_starts: int = 0      # exits within STARTUP_GRACE_S of the start, in a row
    started_at: float = 0.0
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))

    def start(self, env: dict[str, str]) -> None:
        """Start the child; its stderr is passed through to ours, and its last lines kept (the reason
        it gives when it cannot start)."""
        self.tail.clear()
        self.proc = subprocess.Popen(self.argv, env=env, stderr=subprocess.PIPE, preexec_fn=_die_with_parent())
        self.started_at = time.monotonic()
        assert self.proc.stderr is not None
        threading.Thread(target=_pass_through, args=(self.proc.stderr, self.tail), daemon=True,
                         name=f"stderr:{self.name}").start()

    def reason(self) -> str:
        """The child's last words: the last non-empty stderr line."""
        lines = [line for line in self.tail if line.strip()]
        return lines[-1].strip() if lines else "(no message)"


def _pass_through(stream: IO[bytes], tail: collections.deque[str]) -> None:
    out = sys.stderr.buffer
    for raw in stream:
        out.write(raw)
        out.flush()
        tail.append(raw.decode(errors="replace").rstrip())


class HomeLock:
    """An exclusive lock on `$OMNIFLOW_HOME`, held by one `up` (released by the kernel when it dies)."""

    def __init__(self, home: Path) -> None:
        self.path = home / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "unknown pid"
            os.close(fd)
            raise ConfigError(f"another `omniflow up` ({holder}) is running on OMNIFLOW_HOME={self.path.parent}; "
                              "stop it first, or use another OMNIFLOW_HOME") from None
        self._fd = fd
        self.note(f"pid {os.getpid()}")

    def note(self, text: str) -> None:
        """What a refused second `up` reads about us."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
    # more pipelines served beside `pipeline` (`--pipeline a.yaml --pipeline b.yaml`): (pipeline, its YAML)
    more: tuple[tuple[Pipeline, Path], ...] = ()
    children: list[Child] = field(default_factory=list)
    server: EmbeddedServer | None = None
    _stop: bool = False
    _lock: HomeLock | None = None

    def url_file(self) -> Path:
        return self.settings.home / "redis.url"

    def start_redis(self) -> str:
        """The Redis URL: `OMNIFLOW_REDIS_URL`, else the embedded Valkey's, started here ('' when a
        Ctrl-C came while it loaded its data)."""
        if self.settings.redis_url:
            return self.settings.redis_url
        data_dir = (self.settings.home / "valkey").resolve()
        stop_orphan(data_dir)
        self.server = EmbeddedServer(data_dir=data_dir, appendonly=True, appendfsync=self.fsync,
                                     extra_args=list(self.settings.embedded_valkey_args))
        if not self._start_server():
            return ""
        self.settings.home.mkdir(parents=True, exist_ok=True)
        self.url_file().write_text(self.server.url + "\n")
        return self.server.url

    def _start_server(self) -> bool:
        """Start the embedded Valkey and wait while it loads its AOF, showing how far it is; False when
        stopped meanwhile."""
        assert self.server is not None
        progress = _LoadProgress()
        self.server.start(timeout_s=self.settings.embedded_start_timeout_s, on_loading=progress,
                          cancelled=lambda: self._stop)
        if self.server.process is None:
            return False
        progress.done()
        return True

    @property
    def pipelines(self) -> list[Pipeline]:
        return [self.pipeline, *(p for p, _ in self.more)]

    def pipeline_env(self) -> str:
        """`OMNIFLOW_PIPELINE` for the children: every YAML, the default first."""
        return ",".join(str(path.resolve()) for path in [self.pipeline_path, *(p for _, p in self.more)])

    def plan_children(self) -> list[Child]:
        exe = [sys.executable, "-m", "omniflow.cli"]
        children = [Child("reconciler", [*exe, "reconciler"]), Child("jobs", [*exe, "jobs"])]
        specs = [(st, p.stages[st]) for p in self.pipelines for st in p.order]
        if self.colocate:
            # the widest stage sets how many: each process serves every stage (DESIGN §1: a stage is not a GPU)
            for i in range(max(spec.replicas for _st, spec in specs)):
                children.append(Child(f"worker:all:{i}", [*exe, "worker", "--stage", "all"]))
        else:
            # one pool of processes per stage name: `--stage talker` serves the talker of every pipeline
            # given, and the identical ones (one pool key) with one executor (docs/architecture.md)
            replicas: dict[str, int] = {}
            for stage, spec in specs:
                replicas[stage] = max(replicas.get(stage, 0), spec.replicas)
            for stage, count in replicas.items():
                for i in range(count):
                    children.append(Child(f"worker:{stage}:{i}", [*exe, "worker", "--stage", stage]))
        if self.api:
            children.append(Child("api", [*exe, "api", "--host", self.host, "--port", str(self.port)]))
        return children

    def run(self) -> int:
        """Run until Ctrl-C / SIGTERM (0), or until a child cannot start (`ConfigError` with the reason)."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self._lock = HomeLock(self.settings.home)
        self._lock.acquire()
        try:
            url = self.start_redis()
            if self._stop:
                return 0
            self._lock.note(f"pid {os.getpid()}, Redis {url}")
            env = {**os.environ, "OMNIFLOW_REDIS_URL": url,
                   "OMNIFLOW_PIPELINE": self.pipeline_env(), "OMNIFLOW_PREFIX": self.settings.prefix}
            self.children = self.plan_children()
            if self.api and _answers(self.host, self.port):
                raise ConfigError(f"--port: {self.host}:{self.port} is already taken by another process")
            for child in self.children:
                child.start(env)
            self._wait_started(env)
            if self._stop:
                return 0
            where = f"API on http://{self.host}:{self.port}" if self.api else "no API"
            names = ", ".join(p.name for p in self.pipelines)
            print(f"omniflow is up: pipeline{'s' if self.more else ''} {names}, Redis {url}, {where}. "
                  "Ctrl-C stops it.",
                  flush=True)
            while not self._stop:
                time.sleep(POLL_S)
                self._supervise(env)
            return 0
        finally:
            self.shutdown()
            self._lock.release()

    def _wait_started(self, env: dict[str, str]) -> None:
        """Until the API answers (or, without one, the children outlived their start): children that
        cannot start stop `up` here, before it says it is up."""
        deadline = time.monotonic() + (API_READY_TIMEOUT_S if self.api else STARTUP_GRACE_S)
        while not self._stop and time.monotonic() < deadline:
            self._supervise(env)
            if self.api and _answers(self.host, self.port):
                return
            time.sleep(POLL_S)
        if self.api and not self._stop:
            api = next(c for c in self.children if c.name == "api")
            raise ConfigError(f"the API did not answer on {self.host}:{self.port} within {API_READY_TIMEOUT_S:.0f}s: "
                              f"{api.reason()}")

    def _supervise(self, env: dict[str, str]) -> None:
        """Restart what died; stop `up` (ConfigError) for a child that cannot start."""
        if self.server is not None and self.server.process is not None and self.server.process.poll() is not None:
            code = self.server.process.returncode
            logger.warning("embedded Valkey exited (code %s); restarting it from its AOF on port %d",
                           code, self.server.port)
            try:
                if not self._start_server():
                    return
            except ConfigError as exc:
                raise ConfigError(f"the embedded Valkey exited (code {code}) and cannot start again: {exc}") from exc
            logger.warning("embedded Valkey is back on %s", self.server.url)
        for child in self.children:
            assert child.proc is not None
            if child.proc.poll() is None or self._stop:
                continue
            code = child.proc.returncode
            quick = time.monotonic() - child.started_at < STARTUP_GRACE_S
            child.failed_starts = child.failed_starts + 1 if quick else 0
            if code == EXIT_CONFIG or child.failed_starts >= MAX_FAILED_STARTS:
                why = "a configuration error" if code == EXIT_CONFIG else \
                    f"it exited {child.failed_starts} times within {STARTUP_GRACE_S:.0f}s of starting"
                raise ConfigError(f"{child.name} cannot start ({why}, exit code {code}): {child.reason()}")
            delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
            logger.warning("%s exited with %s; restarting in %.1fs", child.name, code, delay)
            time.sleep(delay)
            child.restarts += 1
            child.start(env)

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


class _LoadProgress:
    """Prints how far the embedded Valkey is in loading its data (on stderr, once a `LOADING_REPORT_S`)."""

    def __init__(self) -> None:
        self.last: Loading | None = None

    def __call__(self, state: Loading) -> None:
        self.last = state
        print(f"embedded Valkey is loading its data: {state.loaded_perc:.0f}% after {state.elapsed_s:.1f}s, about "
              f"{state.eta_s}s left ({state.loaded_bytes >> 20} of {state.total_bytes >> 20} MiB)",
              file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.last is not None:
            print("embedded Valkey has loaded its data", file=sys.stderr, flush=True)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host if host not in ("0.0.0.0", "::") else "127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
