"""Workers on many hosts (issue 13 §3): two simulated hosts — separate process groups with their
own host ids and, where the machine allows, their own network namespaces reaching Redis over a
veth pair — run workers of the same pools. Sessions spread over both, chunks cross hosts through
Redis, and a whole host killed at once has its sessions resumed on the other."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis

from omniflow.ops.embedded import EmbeddedServer
from omniflow.client.store import connect
from omniflow.storage.schema import s
from omniflow.storage.schema import log_events_raw
from tests.chaos.driver import STAGES, TERMINAL, ChaosConfig, ChaosRun, Cluster
from tests.chaos.hosts import IP, Host, NetLab
from tests.chaos.test_chaos import _assert_clean, _report

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

ROLES = ("reconciler", "worker:thinker", "worker:talker", "worker:code2wav")
A_ROLES = ROLES[:-1]            # host a of the host-death test: no code2wav (see there)


@pytest.fixture
def lab() -> Iterator[NetLab | None]:
    reason = NetLab.unavailable()
    if reason:
        # still a multi-host test (process groups and host ids), without network isolation
        print(f"\nmulti-host test without network namespaces: {reason}")
        yield None
        return
    lab = NetLab(2).start()
    try:
        yield lab
    finally:
        lab.stop()


def _host_of(replica: str, hosts: list[Host]) -> str | None:
    return next((h.host_id for h in hosts if f"-{h.host_id}-" in replica), None)


@pytest.mark.timeout(300)
async def test_two_hosts_share_pools_and_survive_a_host_death(lab: NetLab | None, tmp_path: Path) -> None:
    bind = ["127.0.0.1", *(lab.bind_addresses() if lab else [])]
    server = EmbeddedServer(data_dir=tmp_path / "valkey", appendfsync="always",
                            extra_args=["--bind", " ".join(bind)]).start()
    cfg = ChaosConfig(workflows=60, submit_rate=6.0, replicas=1, max_sessions=16, min_worker_kills=0)
    cluster = Cluster(tmp_path, server.url, f"h{uuid.uuid4().hex[:8]}", cfg)
    hosts = [Host(name, f"redis://{ns.root_ip if ns else '127.0.0.1'}:{server.port}/0", ns)
             for name, ns in zip("ab", lab.namespaces if lab else [None, None])]
    # Both hosts serve the thinker and talker pools; code2wav runs on host b only, so every workflow
    # whose talker ran on host a crosses hosts (and if none did, its thinker did: the `used` check
    # below) -- crossing is certain by construction, not by luck of claims.
    roles_of = {hosts[0].name: A_ROLES, hosts[1].name: ROLES}
    try:
        for host in hosts:
            for role in roles_of[host.name]:
                cluster.spawn(role, host)
        run = ChaosRun(cluster, server.url, scenario="hosts")
        killed: list[int] = []

        async def kill_host_a() -> None:
            await run.accepted_at_least(cfg.workflows // 2)
            if lab:     # host a's processes really live in its namespace and reach Redis over the veth
                pids = set(subprocess.run([IP, "netns", "pids", lab.namespaces[0].name], capture_output=True,
                                          text=True, check=True).stdout.split())
                assert {str(p.popen.pid) for p in cluster.procs if p.host is hosts[0]} <= pids
                with Redis(port=server.port) as admin:
                    addrs = {c["addr"].rsplit(":", 1)[0] for c in admin.client_list()}
                assert {ns.ns_ip for ns in lab.namespaces} <= addrs
            # the host must die holding a session (else nothing is resumed on host b: under load
            # host b may hold them all at that moment): frozen, then killed once it is seen to hold one
            held = await _freeze_holding_a_session(cluster, run, server.url, hosts[0])
            print(f"\nkilling host {hosts[0].host_id} holding {len(held)} session(s): {held[:5]}")
            for proc in cluster.procs:
                if proc.host is hosts[0]:
                    run._fault("kill-reconciler" if proc.role == "reconciler" else "kill-worker", proc)
            killed.extend(p.popen.pid for p in cluster.kill_host(hosts[0]))

        rep = await run.run(kill_host_a())
        replicas = await _replicas(server.url, run)
    finally:
        cluster.stop()
        server.stop()
    _report(rep, tmp_path)
    _assert_clean(rep)
    assert not rep.crashed, rep.crashed
    assert len(killed) == len(A_ROLES)
    # sessions ran on both hosts; some workflows had consecutive stages on different hosts, so their
    # chunks crossed hosts (through Redis: nothing else connects the namespaces)
    by_wf = {wf: {stage: [_host_of(r, hosts) for r in rs] for stage, rs in st.items()} for wf, st in replicas.items()}
    used = {h for st in by_wf.values() for hs in st.values() for h in hs}
    assert used == {h.host_id for h in hosts}, used
    crossed = [wf for wf, st in by_wf.items()
               if st.get("thinker", [None])[-1] != st.get("talker", [None])[-1]
               or st.get("talker", [None])[-1] != st.get("code2wav", [None])[-1]]
    assert crossed
    # sessions on host a when it died were resumed on host b
    moved = [wf for wf, st in by_wf.items() if any(hs[:-1] and hs[-1] == hosts[1].host_id
                                                     and hosts[0].host_id in hs[:-1] for hs in st.values())]
    assert moved and rep.retries_by_reason["lost"] >= len(moved)


async def _freeze_holding_a_session(cluster: Cluster, run: ChaosRun, url: str, host: Host,
                                    timeout_s: float = 60.0) -> list[str]:
    """SIGSTOP every process of `host`, and return the sessions it holds once it holds one (it is left
    frozen then; until then it is let go on again and looked at anew, until `timeout_s`). Frozen, none
    of its sessions can end before the kill; a write it sent just before it stopped is read first (see
    `_sessions_on`)."""
    deadline = time.monotonic() + timeout_s
    redis = connect(url)
    try:
        while True:
            pids = [p.popen.pid for p in cluster.procs if p.host is host]
            _signal_groups(pids, signal.SIGSTOP)
            await _until_stopped(pids)
            held = await _sessions_on(redis, run, host)
            if held:
                return held
            _signal_groups(pids, signal.SIGCONT)
            if time.monotonic() > deadline:
                raise TimeoutError(f"host {host.host_id} held no session within {timeout_s}s")
            await asyncio.sleep(0.05)       # the polling period
    finally:
        await redis.aclose()


def _signal_groups(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass


async def _until_stopped(pids: list[int], timeout_s: float = 10.0) -> None:
    """Until the kernel shows every one of `pids` stopped (a signal is delivered asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {}
        for pid in pids:
            try:
                # the state is the field after the command's closing parenthesis
                states[pid] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                states[pid] = "gone"
        if all(st in ("T", "t", "Z", "X", "gone") for st in states.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes not stopped within {timeout_s}s: {states}")
        await asyncio.sleep(0.005)


async def _sessions_on(redis: Any, run: ChaosRun, host: Host) -> list[str]:
    """The sessions (`<wf>/<stage>`) that replicas of `host` hold now: claimed by one of them (the
    stage hash names it) and not finished -- so its task entry is pending on that replica, and the
    sweep re-queues it once the replica's lease lapses. A round trip first: a command the host's
    processes sent before they stopped was ready for the server with that one, so the server has
    run it before the read that follows."""
    await redis.ping()
    ids = list(run.accepted)
    pipe = redis.pipeline(transaction=False)
    for wf_id in ids:
        pipe.hgetall(run.keys.stages(wf_id))
    held = []
    for wf_id, raw in zip(ids, await pipe.execute()):
        st = {s(k): s(v) for k, v in raw.items()}
        held += [f"{wf_id}/{stage}" for stage in STAGES if st.get(stage) in ("running", "waiting_input")
                 and f"-{host.host_id}-" in st.get(f"{stage}:replica", "")]
    return held


async def _replicas(url: str, run: ChaosRun) -> dict[str, dict[str, list[str]]]:
    """Per workflow and stage, the replica of each attempt, in order (from the `stage` log entries)."""
    redis = connect(url)
    try:
        out: dict[str, dict[str, list[str]]] = {}
        for wf_id in run.accepted:
            for fields in (ev for _, entry in await redis.xrange(run.keys.log(wf_id)) for ev in log_events_raw(entry)):
                if fields.get(b"t") == b"stage" and b"replica" in fields:
                    out.setdefault(wf_id, {}).setdefault(s(fields[b"stage"]), []).append(s(fields[b"replica"]))
        return out
    finally:
        await redis.aclose()


@pytest.mark.timeout(300)
async def test_chunks_cross_hosts_through_redis_and_stay_in_shared_memory_within_one(lab: NetLab | None,
                                                                                     tmp_path: Path) -> None:
    """Every chunk by reference (no inline payloads): between stages on two hosts it travels in a
    Redis key, never in shared memory; between stages on one host, in shared memory. What decides
    is the host id (`OMNIFLOW_HOST_ID`): the namespaces here share one kernel and one /dev/shm."""
    bind = ["127.0.0.1", *(lab.bind_addresses() if lab else [])]
    server = EmbeddedServer(data_dir=tmp_path / "valkey", extra_args=["--bind", " ".join(bind)]).start()
    cfg = ChaosConfig(workflows=40, submit_rate=8.0, replicas=1, max_sessions=16, min_worker_kills=0)
    cluster = Cluster(tmp_path, server.url, f"t{uuid.uuid4().hex[:8]}", cfg)
    cluster.env.update(OMNIFLOW_DATAPLANE_INLINE_MAX_BYTES="0", OMNIFLOW_DATAPLANE_SHM_MIN_BYTES="0")
    hosts = [Host(name, f"redis://{ns.root_ip if ns else '127.0.0.1'}:{server.port}/0", ns)
             for name, ns in zip("ab", lab.namespaces if lab else [None, None])]
    seen: dict[tuple[str, str, str], set[str]] = {}
    try:
        # the thinker on host a only: its consumers are on host a or b, so both kinds of edge occur
        # (Valkey hands a task to the reader blocked longest: readers of one stage alternate)
        for role in ROLES:
            cluster.spawn(role, hosts[0])
        for role in ("worker:talker", "worker:code2wav"):
            cluster.spawn(role, hosts[1])
        run = ChaosRun(cluster, server.url, scenario="transports")

        async def watch() -> None:
            await _sample_transports(server.url, run, seen, until=lambda: len(run.accepted) >= cfg.workflows)

        rep = await run.run(watch())
        replicas = await _replicas(server.url, run)
    finally:
        cluster.stop()
        server.stop()
    _assert_clean(rep)
    kinds: dict[str, set[str]] = {"cross": set(), "same": set()}
    for (wf, src, dst), found in seen.items():
        a, b = replicas.get(wf, {}).get(src, []), replicas.get(wf, {}).get(dst, [])
        if len(a) == len(b) == 1:       # one attempt each: the hosts are known
            kinds["cross" if _host_of(a[0], hosts) != _host_of(b[0], hosts) else "same"] |= found
    assert kinds["cross"] == {"redis"}, kinds
    assert kinds["same"] == {"shm"}, kinds


@pytest.mark.timeout(300)
async def test_sigterm_rolling_restart_loses_nothing(lab: NetLab | None, tmp_path: Path) -> None:
    """A rolling restart of one host under load: SIGTERM to each of its processes in turn (a
    replacement started once it has exited). Each one exits cleanly, nothing is lost or
    duplicated, and no pending task entry stays owned by a stopped worker."""
    bind = ["127.0.0.1", *(lab.bind_addresses() if lab else [])]
    server = EmbeddedServer(data_dir=tmp_path / "valkey", appendfsync="always",
                            extra_args=["--bind", " ".join(bind)]).start()
    cfg = ChaosConfig(workflows=60, submit_rate=6.0, replicas=1, max_sessions=16, min_worker_kills=0)
    cluster = Cluster(tmp_path, server.url, f"g{uuid.uuid4().hex[:8]}", cfg)
    # shorter than a session: the drain hands running sessions back, not only idle ones
    cluster.env["OMNIFLOW_SHUTDOWN_GRACE_S"] = "0.3"
    hosts = [Host(name, f"redis://{ns.root_ip if ns else '127.0.0.1'}:{server.port}/0", ns)
             for name, ns in zip("ab", lab.namespaces if lab else [None, None])]
    stopped: list[tuple[str, int | None]] = []      # (worker id or role, exit code)
    try:
        for host in hosts:
            for role in ROLES:
                cluster.spawn(role, host)
        run = ChaosRun(cluster, server.url, scenario="sigterm")

        async def rolling_restart() -> None:
            await run.accepted_at_least(cfg.workflows // 4)
            for proc in [p for p in cluster.procs if p.host is hosts[0]]:
                ids = await _worker_ids(server.url, run, proc.popen.pid)
                proc.popen.terminate()
                code = await asyncio.to_thread(proc.popen.wait, 30)
                stopped.extend((wid, code) for wid in ids or [proc.role])
                cluster.procs.remove(proc)
                replacement = cluster.spawn(proc.role, hosts[0])
                if proc.role.startswith("worker:"):
                    await run._sleep_until_worker_started(replacement)

        rep = await run.run(rolling_restart())
        owned = await _pending_owned(server.url, run, [wid for wid, _ in stopped])
    finally:
        cluster.stop()
        server.stop()
    _report(rep, tmp_path)
    _assert_clean(rep)
    assert not rep.crashed, rep.crashed
    assert len(stopped) == len(ROLES) and all(code == 0 for _, code in stopped), stopped
    assert not owned, owned


async def _worker_ids(url: str, run: ChaosRun, pid: int) -> list[str]:
    redis = connect(url)
    try:
        return [w for w in (s(m) for m in await redis.zrange(run.keys.workers, 0, -1)) if f"-{pid}-" in w]
    finally:
        await redis.aclose()


async def _pending_owned(url: str, run: ChaosRun, consumers: list[str]) -> dict[str, int]:
    """Task entries still pending on consumers that were stopped (their stage groups)."""
    redis = connect(url)
    try:
        owned: dict[str, int] = {}
        for stage, cell in ((st, c) for st in ("thinker", "talker", "code2wav") for c in run.keys.all_cells):
            for info in await redis.xinfo_consumers(run.keys.tasks(run.cluster.pipeline.queue(stage), cell), "workers"):
                name = s(info["name"])
                if name in consumers and info["pending"]:
                    owned[f"{stage}/{name}"] = info["pending"]
        return owned
    finally:
        await redis.aclose()


async def _sample_transports(url: str, run: ChaosRun, seen: dict[tuple[str, str, str], set[str]], *,
                             until: Any, timeout_s: float = 60.0) -> None:
    """While the run goes on, the transport of every chunk reference found in the edge logs
    (they are deleted at each workflow's terminal), by (workflow, producer stage, consumer stage);
    until `until()` is true and every accepted workflow has ended (no edge log is left to see), or
    `timeout_s` after `until()` (the run's checks then report what hung)."""
    from omniflow.dataplane.base import Ref
    from omniflow.engine.worker import decode_chunks

    redis = connect(url)
    stop_at = None
    try:
        while True:
            if stop_at is None and until():
                stop_at = asyncio.get_running_loop().time() + timeout_s
            last = stop_at is not None and (await _all_ended(redis, run)
                                            or asyncio.get_running_loop().time() > stop_at)
            async for raw in redis.scan_iter(match=f"{run.keys.prefix}:*:wf:*:edge:*", count=1000):
                key = s(raw)
                wf, _, edge = key.split(":wf:", 1)[1].partition(":edge:")
                src, _, dst = edge.partition(":")
                for _, fields in await redis.xrange(key):
                    for chunk in decode_chunks(fields[b"m"]):
                        if b"r" in chunk:
                            seen.setdefault((wf, src, dst), set()).add(Ref.unpack(chunk[b"r"]).kind.value)
            if last:
                return
            await asyncio.sleep(0.1)        # the sampling period
    finally:
        await redis.aclose()


async def _all_ended(redis: Any, run: ChaosRun) -> bool:
    ids = list(run.accepted)
    pipe = redis.pipeline(transaction=False)
    for wf_id in ids:
        pipe.hget(run.keys.wf(wf_id), "state")
    return all(s(state) in TERMINAL for state in await pipe.execute())
