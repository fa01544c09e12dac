"""The embedded default and the CLI when things are wrong (issue 9): bad settings, Redis away,
Redis out of memory, two `up` on one home, an orphaned or killed Valkey, a child that cannot
start. Everything runs as a user runs it: real subprocesses."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import helpers
from helpers import omniflow, wait_until
from omniflow.storage.keys import Keys
from omniflow.ops.embedded import PID_FILE, EmbeddedServer, Loading, free_port


def bare_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIFLOW_")}
    env.update({"OMNIFLOW_HOME": str(tmp_path / "home"), "OMNIFLOW_LOG_LEVEL": "WARNING", **extra})
    return env


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.parametrize(("name", "value"), [("OMNIFLOW_MAX_IN_FLIGHT", "abc"), ("OMNIFLOW_REDIS_URL", "notaurl")])
async def test_a_bad_setting_is_one_line_naming_it_and_exit_2(tmp_path, name, value) -> None:
    code, _, stderr = await omniflow("ls", env=bare_env(tmp_path, **{name: value}))
    assert code == 2
    assert name in one_line(stderr)


async def test_no_redis_reachable_is_one_line_and_exit_3(tmp_path) -> None:
    code, _, stderr = await omniflow("ls", env=bare_env(tmp_path, OMNIFLOW_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"))
    assert code == 3
    assert "Redis unreachable" in one_line(stderr)


async def test_submit_while_redis_is_out_of_memory_is_busy(engine_factory, tmp_path) -> None:
    async with engine_factory(workers=False, reconciler=False) as eng:
        env = helpers.cli_env(eng, tmp_path)
        await eng.redis.config_set("maxmemory", 1)
        try:
            code, _, stderr = await omniflow("submit", "no room", env=env)
        finally:
            await eng.redis.config_set("maxmemory", 0)
        assert code == 2
        assert "out of memory" in one_line(stderr) and "retry later" in stderr


@pytest.mark.slow
async def test_daemons_wait_for_redis_with_one_line_and_serve_when_it_comes(tmp_path) -> None:
    port = free_port()
    env = bare_env(tmp_path, OMNIFLOW_REDIS_URL=f"redis://127.0.0.1:{port}/0", OMNIFLOW_LOG_LEVEL="INFO",
                   OMNIFLOW_PREFIX="waiting")
    procs = {role: await asyncio.create_subprocess_exec(
        sys.executable, "-m", "omniflow.cli", *argv, env=env, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE) for role, argv in (("worker", ["worker", "--stage", "thinker"]),
                                                          ("reconciler", ["reconciler"]), ("jobs", ["jobs"]))}
    logs: dict[str, list[str]] = {role: [] for role in procs}

    async def collect(role: str, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            logs[role].append(raw.decode(errors="replace"))

    readers = [asyncio.create_task(collect(role, p)) for role, p in procs.items()]

    def all_said(words: str) -> bool:
        return all(any(words in line for line in lines) for lines in logs.values())

    server = None
    try:
        await helpers.eventually(lambda: all_said("is not answering"), timeout_s=60, interval_s=0.2,
                                 what="every daemon saying Redis is not answering")
        assert all(p.returncode is None for p in procs.values())
        server = EmbeddedServer(data_dir=tmp_path / "late-valkey", port=port, appendonly=False).start()
        # nobody died of it: each daemon was still waiting when Redis came, and says it answers again
        await helpers.eventually(lambda: all_said("answers again"), timeout_s=30, interval_s=0.2,
                                 what="every daemon saying Redis answers again")
        from omniflow.storage.redisio import connect

        redis = connect(server.url)
        try:
            async def worker_registered() -> bool:
                return bool(await redis.zcard(Keys("waiting").workers))
            await helpers.eventually(worker_registered, timeout_s=30, what="the worker's heartbeat")
        finally:
            await redis.aclose()
    finally:
        for proc in procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            await asyncio.wait_for(proc.wait(), 30)
        await asyncio.gather(*readers)
        if server is not None:
            server.stop()
    for role, proc in procs.items():
        err = "".join(logs[role])
        assert proc.returncode == 0, (role, err)
        assert "Traceback" not in err, (role, err)
        assert err.count("is not answering") == 1, (role, err)


# ---------------------------------------------------------------- omniflow up
@pytest.fixture
def up_home(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    env = bare_env(tmp_path, OMNIFLOW_LEASE_TIMEOUT_S="1.0", OMNIFLOW_HEARTBEAT_INTERVAL_S="0.2")
    yield tmp_path / "home", env
    # nothing of ours outlives the test, whatever it did
    pid_file = tmp_path / "home" / "valkey" / PID_FILE
    if pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def start_up(env: dict[str, str], *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "omniflow.cli", "up", *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omniflow.cli", *args], env=env, text=True, capture_output=True,
                          timeout=60)


def valkey_pid(home: Path) -> int | None:
    try:
        return int((home / "valkey" / PID_FILE).read_text())
    except (OSError, ValueError):
        return None


def submit_completes(env: dict[str, str]) -> bool:
    return cli(env, "submit", "are you there", "--modalities", "text", "--wait", "--timeout", "20").returncode == 0


@pytest.mark.slow
def test_up_one_per_home_supervises_valkey_and_takes_it_down_when_killed(up_home, tmp_path) -> None:
    home, env = up_home
    first = start_up(env, "--no-api", cwd=tmp_path)
    children: list[int] = []
    try:
        wait_until(lambda: cli(env, "stats").returncode == 0)
        # a second `up` on the same home is refused, naming the first
        second = start_up(env, "--no-api", cwd=tmp_path)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2
        assert f"another `omniflow up` (pid {first.pid}" in one_line(err)
        assert submit_completes(env)                      # and the first one never noticed
        # its Valkey is killed: `up` restarts it from its AOF, and says so
        old = valkey_pid(home)
        assert old
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: (valkey_pid(home) or old) != old and alive(valkey_pid(home) or 0))
        assert wait_until(lambda: submit_completes(env), timeout_s=60)
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(first.pid)], text=True,
                                                   capture_output=True).stdout.split()]
        server = valkey_pid(home)
        assert server
        # `up` killed hard: its Valkey and its children do not outlive it
        first.kill()
        first.wait(10)
        wait_until(lambda: not alive(server) and not any(alive(p) for p in children), timeout_s=30)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGINT)
            first.wait(60)
        _, first_err = first.communicate()
    assert "restarting it from its AOF" in first_err
    assert "Traceback" not in first_err          # no child died of it (their stderr passes through `up`)


@pytest.mark.slow
def test_up_stops_an_orphaned_valkey_left_on_its_home(up_home, tmp_path) -> None:
    home, env = up_home
    orphan = EmbeddedServer(data_dir=(home / "valkey").resolve(), appendonly=True, die_with_parent=False).start()
    assert orphan.process is not None
    orphan_pid = orphan.process.pid
    up = start_up(env, "--no-api", cwd=tmp_path)
    try:
        wait_until(lambda: cli(env, "stats").returncode == 0)
        orphan.process.wait(30)                      # stopped by `up` (SIGTERM: AOF flushed)
        assert valkey_pid(home) not in (None, orphan_pid)
    finally:
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
        orphan.stop()
    assert up.returncode == 0
    assert f"orphaned Valkey (pid {orphan_pid})" in err


@pytest.mark.slow
def test_up_stops_with_the_reason_when_its_api_cannot_start(up_home, tmp_path) -> None:
    _, env = up_home
    up = start_up(env, "--host", "0.0.0.0", "--port", str(free_port()), cwd=tmp_path)
    out, err = up.communicate(timeout=120)
    assert up.returncode == 2
    assert "is up" not in out
    assert "api cannot start" in err and "refusing to bind 0.0.0.0" in err.splitlines()[-1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        up = start_up(env, "--port", str(taken.getsockname()[1]), cwd=tmp_path)
        out, err = up.communicate(timeout=120)
    assert up.returncode == 2
    assert "is up" not in out and "already taken" in err.splitlines()[-1]


# ---------------------------------------------------------------- a large AOF to load
LOADED_KEYS = 20_000
# ~150 µs a key (Valkey's own debug knob, applied as it loads each key): about 3 s for LOADED_KEYS, three
# times the start timeout the tests below set; events served every KiB loaded, so INFO answers meanwhile
SLOW_LOAD = ["--key-load-delay", "150", "--loading-process-events-interval-bytes", "1024"]
START_TIMEOUT_S = 1.0


def write_aof(data_dir: Path, keys: int = LOADED_KEYS) -> None:
    """`keys` keys in the AOF of `data_dir` (through a server of its own, rewritten to its RDB base)."""
    from redis import Redis

    server = EmbeddedServer(data_dir=data_dir, appendonly=True).start()
    try:
        with Redis(port=server.port) as client:
            for i in range(0, keys, 1000):
                client.mset({f"k{j}": j for j in range(i, min(keys, i + 1000))})
            client.bgrewriteaof()
            wait_until(lambda: not any(client.info("persistence")[f] for f in
                                       ("aof_rewrite_in_progress", "aof_rewrite_scheduled")), interval_s=0.05)
    finally:
        server.stop()


def test_a_valkey_loading_its_aof_longer_than_the_start_timeout_is_waited_for(tmp_path: Path) -> None:
    """It answers -LOADING for longer than `timeout_s` (it used to be stopped there, and `up` exit): it is
    waited for while it loads, its progress reported, and then serves every key."""
    from redis import Redis

    write_aof(tmp_path / "v")
    seen: list[Loading] = []
    server = EmbeddedServer(data_dir=tmp_path / "v", appendonly=True, extra_args=SLOW_LOAD)
    try:
        server.start(timeout_s=START_TIMEOUT_S, on_loading=seen.append)
        with Redis(port=server.port) as client:
            assert client.dbsize() == LOADED_KEYS
    finally:
        server.stop()
    assert max(s.elapsed_s for s in seen) > START_TIMEOUT_S            # still loading past the timeout
    percents = [s.loaded_perc for s in seen]
    assert percents == sorted(percents) and 0 <= percents[0] < 100 and percents[-1] > percents[0]
    assert all(s.total_bytes > 0 for s in seen)
    # a Ctrl-C while it loads: stopped at once, nothing left running
    pids: list[int] = []
    stopped = EmbeddedServer(data_dir=tmp_path / "v", appendonly=True, extra_args=SLOW_LOAD)
    stopped.start(timeout_s=START_TIMEOUT_S, on_loading=lambda _: pids.append(stopped.process.pid),  # type: ignore[union-attr]
                  cancelled=lambda: bool(pids))
    assert stopped.process is None and pids and not alive(pids[0])


@pytest.mark.slow
def test_up_waits_for_its_valkey_to_load_a_large_aof_and_shows_how_far_it_is(up_home, tmp_path) -> None:
    home, env = up_home
    write_aof(home / "valkey")
    env = {**env, "OMNIFLOW_EMBEDDED_START_TIMEOUT_S": str(START_TIMEOUT_S),
           "OMNIFLOW_EMBEDDED_VALKEY_ARGS": json.dumps(SLOW_LOAD)}
    # stdout to a file, read while it runs: `stats` answers as soon as Valkey has loaded, a moment before
    # `up` has started its children and said it is up (a SIGINT in between stops it before it says so)
    out_file = tmp_path / "up.out"
    with out_file.open("w") as sink:
        up = subprocess.Popen([sys.executable, "-m", "omniflow.cli", "up", "--no-api"], env=env, cwd=tmp_path,
                              text=True, stdout=sink, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: "omniflow is up" in out_file.read_text() or up.poll() is not None, timeout_s=90)
        assert up.poll() is None
        assert cli(env, "stats").returncode == 0
        from redis import Redis

        with Redis.from_url((home / "redis.url").read_text().strip()) as client:
            assert client.dbsize() >= LOADED_KEYS                           # everything it had is back
    finally:
        up.send_signal(signal.SIGINT)
        _, err = up.communicate(timeout=60)
    out = out_file.read_text()
    assert up.returncode == 0, err
    progress = re.findall(r"is loading its data: (\d+)% after ([\d.]+)s, about (\d+)s left", err)
    assert progress, err
    assert max(float(after) for _, after, _ in progress) > START_TIMEOUT_S        # past the timeout, still up
    assert "has loaded its data" in err and "omniflow is up" in out


def test_the_embedded_server_keeps_more_freed_chunks_per_size_unless_told_otherwise(tmp_path, monkeypatch) -> None:
    """The embedded Valkey runs with glibc's tcache enlarged (`SERVER_GLIBC_TUNABLES`, bench/notes.md
    round 9); an operator's own GLIBC_TUNABLES wins."""
    from omniflow.ops.embedded import SERVER_GLIBC_TUNABLES

    def environ_of(server: EmbeddedServer) -> dict[str, str]:
        assert server.process is not None
        raw = Path(f"/proc/{server.process.pid}/environ").read_bytes()
        return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    server = EmbeddedServer(data_dir=tmp_path / "a", appendonly=False).start()
    try:
        assert environ_of(server)["GLIBC_TUNABLES"] == SERVER_GLIBC_TUNABLES
    finally:
        server.stop()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=7")
    server = EmbeddedServer(data_dir=tmp_path / "b", appendonly=False).start()
    try:
        assert environ_of(server)["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=7"
    finally:
        server.stop()
