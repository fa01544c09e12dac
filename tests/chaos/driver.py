"""Chaos driver: real processes, real Redis, real signals.

`Cluster` runs the engine as separate OS processes (`python -m omniflow.cli
worker|reconciler|api`) against one Redis; `ChaosRun` submits workflows at a
steady rate while it SIGKILLs / SIGSTOPs those processes (or Redis itself),
waits for quiescence and then checks every workflow against the output a
fault-free run produces (the toy executors are deterministic).

Everything here is bounded in time and every process started is killed.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from redis.asyncio import Redis

from omniflow.config import Settings
from omniflow.dataplane.shm import DEFAULT_SHM_DIR, name_part, parse_arena, parse_name
from omniflow.ops.embedded import EmbeddedServer, _die_with_parent
from omniflow.errors import OmniflowError, RedisUnavailable
from omniflow.storage.keys import EVENT_GROUP, TASK_GROUP, Keys
from omniflow.models import SubmitRequest, WorkflowInput
from omniflow.pipeline import load_pipeline
from omniflow.client.store import Store, connect
from omniflow.storage.schema import StageField, s, texts_in_record
from omniflow.workers.toy import codes_for, hidden_state, reply_words, tone
from omniflow.storage.schema import log_events_raw
from tests.chaos.hosts import Host

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("thinker", "talker", "code2wav")
TERMINAL = {"completed", "failed", "aborted"}


# ---------------------------------------------------------------- pipeline
@dataclass
class ChaosConfig:
    workflows: int = 200
    submit_rate: float = 10.0           # workflows / s
    max_words: int = 16
    token_delay_s: float = 0.03
    chunk_delay_s: float = 0.01
    sample_rate: int = 8000
    chunk_seconds: float = 0.02
    replicas: int = 2
    max_sessions: int = 32
    max_attempts: int = 10
    heartbeat_interval_s: float = 0.3
    lease_timeout_s: float = 1.5
    sweep_interval_s: float = 0.25
    event_claim_idle_ms: int = 1500
    kill_every_s: float = 2.0
    min_worker_kills: int = 8
    quiesce_timeout_s: float = 120.0
    seed: int = 1234
    colocated: bool = False             # `replicas` worker processes, each serving every stage

    def pipeline_yaml(self) -> dict[str, Any]:
        retry = {"max_attempts": self.max_attempts, "backoff_s": 0.05, "backoff_max_s": 0.5,
                 "input_timeout_s": 60.0}
        toy = "omniflow.workers.toy"
        common = {"replicas": self.replicas, "max_sessions": self.max_sessions, "retry": retry}
        return {
            "name": "omni-toy-chaos",
            "stages": {
                "thinker": {"executor": f"{toy}:ToyThinker", "final_output": "text", **common,
                            "params": {"token_delay_s": self.token_delay_s, "max_words": self.max_words}},
                "talker": {"executor": f"{toy}:ToyTalker", **common,
                           "params": {"chunk_delay_s": self.chunk_delay_s}},
                "code2wav": {"executor": f"{toy}:ToyCode2Wav", "final_output": "audio", **common,
                             "params": {"chunk_delay_s": self.chunk_delay_s, "sample_rate": self.sample_rate,
                                        "chunk_seconds": self.chunk_seconds}},
            },
            "edges": [{"from": "thinker", "to": "talker", "mode": "chunk"},
                      {"from": "talker", "to": "code2wav", "mode": "chunk"}],
        }


def keys_for(settings: Settings, url: str) -> Keys:
    """The keys of the deployment at `url`: its cells as every process there counts them."""
    from omniflow.storage.cells import DEFAULT_CLUSTER_CELLS
    from omniflow.storage.topology import ServerKind, server_kind

    cluster = server_kind(url) is ServerKind.CLUSTER
    return Keys(settings.prefix, settings.cells or (DEFAULT_CLUSTER_CELLS if cluster else 1))


def prompt_for(i: int) -> str:
    rng = random.Random(i)
    words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "india", "juliet"]
    return f"request {i} " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))


def expected_output(prompt: str, cfg: ChaosConfig) -> tuple[str, list[bytes]]:
    """What a fault-free run produces: the final text and the PCM bytes of every audio chunk."""
    words = reply_words(prompt, cfg.max_words)
    text = " ".join(words)
    chunks = [tone(codes_for(hidden_state(w, i)), cfg.sample_rate, cfg.chunk_seconds).astype("<i2").tobytes()
              for i, w in enumerate(words)]
    return text, chunks


# ---------------------------------------------------------------- processes
@dataclass
class Proc:
    role: str                    # "worker:thinker", "reconciler", "api"
    popen: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.time)
    host: Host | None = None     # the simulated host it runs on (multi-host scenarios)


class Cluster:
    """The engine's processes for one chaos scenario (all children of this one)."""

    def __init__(self, workdir: Path, redis_url: str, prefix: str, cfg: ChaosConfig, *, api_port: int = 0) -> None:
        self.workdir = workdir
        self.cfg = cfg
        self.pipeline_path = workdir / "pipeline.yaml"
        self.pipeline_path.write_text(yaml.safe_dump(cfg.pipeline_yaml(), sort_keys=False))
        self.pipeline = load_pipeline(self.pipeline_path)
        self.env = {
            **os.environ,
            "OMNIFLOW_REDIS_URL": redis_url,
            "OMNIFLOW_PREFIX": prefix,
            "OMNIFLOW_PIPELINE": str(self.pipeline_path),
            "OMNIFLOW_HEARTBEAT_INTERVAL_S": str(cfg.heartbeat_interval_s),
            "OMNIFLOW_LEASE_TIMEOUT_S": str(cfg.lease_timeout_s),
            "OMNIFLOW_SWEEP_INTERVAL_S": str(cfg.sweep_interval_s),
            "OMNIFLOW_EVENT_CLAIM_IDLE_MS": str(cfg.event_claim_idle_ms),
            "OMNIFLOW_BLOCK_MS": "1000",
            "OMNIFLOW_LOG_LEVEL": "INFO",
            "OMNIFLOW_API_PORT": str(api_port),
            "PYTHONUNBUFFERED": "1",
        }
        self.settings = Settings(redis_url=redis_url, prefix=prefix, pipeline=self.pipeline_path,
                                 heartbeat_interval_s=cfg.heartbeat_interval_s, lease_timeout_s=cfg.lease_timeout_s,
                                 sweep_interval_s=cfg.sweep_interval_s)
        self.procs: list[Proc] = []
        self.dead: list[Proc] = []
        self._n = 0

    def spawn(self, role: str, host: Host | None = None) -> Proc:
        argv = [sys.executable, "-m", "omniflow.cli"]
        if role.startswith("worker:"):
            argv += ["worker", "--stage", role.split(":", 1)[1]]
        else:
            argv += [role]
        self._n += 1
        log = self.workdir / f"{role.replace(':', '-')}-{self._n}{'-' + host.name if host else ''}.log"
        env = {**self.env, **(host.env() if host else {})}
        with log.open("wb") as fh:
            popen = subprocess.Popen(host.argv(argv) if host else argv, env=env, stdout=fh,
                                     stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                     preexec_fn=_die_with_parent())   # a killed pytest takes them along
        proc = Proc(role, popen, log, host=host)
        self.procs.append(proc)
        return proc

    def start(self, *, reconcilers: int = 1, api: bool = False) -> None:
        for _ in range(reconcilers):
            self.spawn("reconciler")
        roles = ["worker:all"] if self.cfg.colocated else [f"worker:{stage}" for stage in STAGES]
        for role in roles:
            for _ in range(self.cfg.replicas):
                self.spawn(role)
        if api:
            self.spawn("api")

    def live(self, prefix: str) -> list[Proc]:
        return [p for p in self.procs if p.role.startswith(prefix) and p.popen.poll() is None]

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        try:
            proc.popen.send_signal(sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGKILL:
            self._bury(proc)

    def _bury(self, proc: Proc) -> None:
        """A SIGKILLed process: reaped, and counted among the dead (not as crashed)."""
        try:
            proc.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.procs.remove(proc)
        self.dead.append(proc)

    def kill_host(self, host: Host) -> list[Proc]:
        """SIGKILL every process of one simulated host at once (a machine that died)."""
        victims = [p for p in self.procs if p.host is host]
        for proc in victims:
            try:
                os.killpg(proc.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in victims:
            self._bury(proc)
        return victims

    def crashed(self) -> list[Proc]:
        """Processes that exited although nobody killed them (a bug, unless Redis was down)."""
        return [p for p in self.procs if p.popen.poll() is not None]

    def crash_report(self) -> list[str]:
        """`crashed()` as the report says it: role, pid and exit code of each."""
        return [f"{p.role} pid {p.popen.pid} rc {p.popen.returncode}" for p in self.crashed()]

    def stop(self, timeout_s: float = 15.0) -> None:
        for proc in self.procs:
            if proc.popen.poll() is None:
                try:
                    proc.popen.send_signal(signal.SIGCONT)
                    proc.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
        # Every process of this cluster is gone: what it left in shared memory (a SIGKILLed producer's
        # segments, on a "host" no surviving process sweeps) goes with it; the session-wide check in
        # conftest.py then sees nothing of ours.
        part = name_part(self.settings.prefix)
        for entry in DEFAULT_SHM_DIR.iterdir():
            seg = parse_name(entry.name) or parse_arena(entry.name)
            if seg is not None and seg.prefix == part:
                entry.unlink(missing_ok=True)


def api_available() -> bool:
    try:
        if importlib.util.find_spec("omniflow.api.app") is None:
            return False
        import omniflow.api.app as app_mod
    except Exception:  # noqa: BLE001 - a half-written API counts as absent
        return False
    return hasattr(app_mod, "serve")


# ---------------------------------------------------------------- the run
@dataclass
class Fault:
    kind: str           # "kill-worker" | "kill-reconciler" | "kill-api" | "stop-worker" | "kill-redis"
    role: str
    pid: int
    t_ms: int
    until_ms: int = 0   # SIGSTOP: when it was resumed; Redis: when it answered again


@dataclass
class Report:
    scenario: str
    workflows: int = 0
    accepted: int = 0
    refused: int = 0
    completed: int = 0
    not_completed: dict[str, str] = field(default_factory=dict)
    lost: int = 0
    duplicated: int = 0
    missing: int = 0
    bad_terminals: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    retries_by_reason: Counter[str] = field(default_factory=Counter)
    resumed: int = 0
    recovery_ms: list[int] = field(default_factory=list)
    leftovers: dict[str, Any] = field(default_factory=dict)
    crashed: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    def pct(self, q: float) -> float | None:
        if not self.recovery_ms:
            return None
        xs = sorted(self.recovery_ms)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] / 1000

    def row(self) -> dict[str, Any]:
        p50, p99 = self.pct(0.5), self.pct(0.99)
        return {
            "scenario": self.scenario, "workflows": self.accepted, "completed": self.completed,
            "worker SIGKILL": self.faults["kill-worker"], "worker SIGSTOP": self.faults["stop-worker"],
            "reconciler SIGKILL": self.faults["kill-reconciler"], "API SIGKILL": self.faults["kill-api"],
            "Redis SIGKILL": self.faults["kill-redis"], "retries": self.retries, "resumed": self.resumed,
            "lost": self.lost, "duplicated": self.duplicated, "missing": self.missing,
            "recovery p50 s": "-" if p50 is None else f"{p50:.2f}",
            "recovery p99 s": "-" if p99 is None else f"{p99:.2f}",
            "wall s": f"{self.duration_s:.0f}",
        }

    def table(self) -> str:
        row = self.row()
        head = "| " + " | ".join(row) + " |"
        sep = "|" + "|".join("---" for _ in row) + "|"
        body = "| " + " | ".join(str(v) for v in row.values()) + " |"
        return "\n".join([head, sep, body])

    def ok(self) -> bool:
        return not self.problems


class ChaosRun:
    def __init__(self, cluster: Cluster, redis_url: str, *, server: EmbeddedServer | None = None,
                 scenario: str = "processes") -> None:
        self.cluster = cluster
        self.cfg = cluster.cfg
        self.redis_url = redis_url
        self.server = server
        self.keys = keys_for(cluster.settings, redis_url)
        self.rng = random.Random(self.cfg.seed)
        self.faults: list[Fault] = []
        self.accepted: dict[str, int] = {}      # wf id -> prompt index
        self.refused = 0
        self.report = Report(scenario=scenario, workflows=self.cfg.workflows)
        self._submitting = True

    # ------------------------------------------------------------ submit
    async def submit_all(self, store: Store) -> None:
        interval = 1.0 / self.cfg.submit_rate
        t0 = time.monotonic()
        for i in range(self.cfg.workflows):
            delay = t0 + i * interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)      # the load's pace (submit_rate), not a synchronisation
            req = SubmitRequest(input=WorkflowInput(text=prompt_for(i)))
            try:
                sub = await asyncio.wait_for(store.submit(req), 5.0)
            except (RedisUnavailable, OmniflowError, asyncio.TimeoutError, ConnectionError, OSError):
                self.refused += 1      # not accepted: the client was told so
                continue
            self.accepted[sub.id] = i
        self._submitting = False

    async def accepted_at_least(self, n: int, timeout_s: float = 120.0) -> None:
        """Until `n` workflows were accepted (a fault that must hit a loaded cluster waits for this)."""
        deadline = time.monotonic() + timeout_s
        while len(self.accepted) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.accepted)} of the {n} workflows accepted within {timeout_s}s")
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------ faults
    async def _sleep_until_worker_started(self, proc: Proc, timeout_s: float = 15.0) -> None:
        """Wait until a freshly started worker heartbeats (so kills hit serving processes)."""
        r = connect(self.redis_url)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and proc.popen.poll() is None:
                try:
                    members = [s(m) for m in await r.zrange(self.keys.workers, 0, -1)]
                except Exception:  # noqa: BLE001 - Redis may be down in the Redis scenario
                    members = []
                if any(f"-{proc.popen.pid}-" in m for m in members):
                    return
                await asyncio.sleep(0.1)
        finally:
            await r.aclose()

    def _fault(self, kind: str, proc: Proc | None) -> Fault:
        fault = Fault(kind, proc.role if proc else "redis", proc.popen.pid if proc else 0, int(time.time() * 1000))
        self.faults.append(fault)
        return fault

    async def chaos_processes(self, *, kill_reconciler: bool = True, kill_api: bool = True,
                              sigstop: bool = True) -> None:
        """SIGKILL a random worker every ~kill_every_s (and restart it); once each: the reconciler,
        the API and a SIGSTOP past the lease."""
        extra = []
        if kill_reconciler:
            extra.append("reconciler")
        if kill_api and self.cluster.live("api"):
            extra.append("api")
        if sigstop:
            extra.append("stop")
        n, kills = 0, 0
        background: list[asyncio.Task[None]] = []
        while self._submitting or extra or kills < self.cfg.min_worker_kills:
            await asyncio.sleep(self.cfg.kill_every_s * self.rng.uniform(0.75, 1.25))     # the faults' pace
            n += 1
            if extra and (n % 3 == 0 or not self._submitting):
                what = extra.pop(0)
                if what == "stop":     # runs beside the kills: the stopped worker stays stopped past its lease
                    background.append(asyncio.create_task(self._stop_worker()))
                else:
                    victim = self.cluster.live(what)[0]
                    self._fault(f"kill-{what}", victim)
                    self.cluster.kill(victim)
                    self.cluster.spawn(what)
                continue
            stopped = {f.pid for f in self.faults if f.kind == "stop-worker" and not f.until_ms}
            workers = [p for p in self.cluster.live("worker:") if p.popen.pid not in stopped]
            # prefer workers that are serving (heartbeating): a kill should hit live sessions
            serving = await self._serving(workers)
            victim = self.rng.choice(serving or workers)
            self._fault("kill-worker", victim)
            self.cluster.kill(victim)
            self.cluster.spawn(victim.role)
            kills += 1
        await asyncio.gather(*background)

    async def _serving(self, procs: list[Proc]) -> list[Proc]:
        r = connect(self.redis_url, socket_timeout=2)
        try:
            members = [s(m) for m in await r.zrange(self.keys.workers, 0, -1)]
        except Exception:  # noqa: BLE001
            return []
        finally:
            await r.aclose()
        return [p for p in procs if any(f"-{p.popen.pid}-" in m for m in members)]

    async def _stop_worker(self) -> None:
        victim = self.rng.choice(self.cluster.live("worker:"))
        fault = self._fault("stop-worker", victim)
        victim.popen.send_signal(signal.SIGSTOP)
        # the fault itself: frozen for longer than its lease (a stopped process cannot renew it)
        await asyncio.sleep(self.cfg.lease_timeout_s * 2 + 1.0)
        victim.popen.send_signal(signal.SIGCONT)
        fault.until_ms = int(time.time() * 1000)

    async def chaos_redis(self, at_s: float, down_s: float = 1.0) -> None:
        """SIGKILL Redis once mid-run and restart it from its AOF (same port, same dir)."""
        assert self.server is not None
        await asyncio.sleep(at_s)           # the fault schedule: when Redis dies, and how long it stays down
        self._fault("kill-redis", None)
        self.server.kill()
        await asyncio.sleep(down_s)
        self.server.start()
        self.faults[-1].until_ms = int(time.time() * 1000)

    # ------------------------------------------------------------ run
    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until every worker process heartbeats (so the faults hit a serving cluster)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            workers = self.cluster.live("worker:")
            if len(await self._serving(workers)) == len(workers):
                return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"workers not serving within {timeout_s}s; logs in {self.cluster.workdir}")

    async def run(self, chaos: Any) -> Report:
        await self.wait_ready()
        t0 = time.monotonic()
        redis = connect(self.redis_url, socket_timeout=5)
        store = Store(redis, self.cluster.settings, self.cluster.pipeline)
        chaos_task = asyncio.create_task(chaos)
        try:
            await self.submit_all(store)
            await asyncio.wait_for(chaos_task, 120)
            await self.wait_quiet(redis)
            self.report.duration_s = time.monotonic() - t0
            await self.verify(redis)
        finally:
            if not chaos_task.done():
                chaos_task.cancel()
                await asyncio.gather(chaos_task, return_exceptions=True)
            await redis.aclose()
        self.report.crashed = self.cluster.crash_report()
        return self.report

    async def wait_quiet(self, redis: Redis) -> None:
        """Until every accepted workflow is terminal (bounded), then until the streams drain."""
        deadline = time.monotonic() + self.cfg.quiesce_timeout_s
        ids = list(self.accepted)
        while time.monotonic() < deadline:
            try:
                pipe = redis.pipeline(transaction=False)
                for wf_id in ids:
                    pipe.hget(self.keys.wf(wf_id), "state")
                states = await pipe.execute()
            except Exception:  # noqa: BLE001 - Redis may still be restarting
                await asyncio.sleep(0.5)
                continue
            ids = [wf_id for wf_id, st in zip(ids, states) if s(st) not in TERMINAL]
            if not ids:
                break
            await asyncio.sleep(0.5)
        # let the last events, acks and sweeps land; a worker killed after its last session ended
        # holds nothing anyone waits for, so only its lease says it is gone: give that one lease
        # timeout to lapse and the next sweeps to reap it
        settle = time.monotonic() + 10
        while time.monotonic() < settle:
            if not await self._pending_counts(redis):
                break
            await asyncio.sleep(0.25)
        reaped = time.monotonic() + self.cfg.lease_timeout_s + self.cfg.sweep_interval_s * 8
        while time.monotonic() < reaped and await self._stale_leases(redis):
            await asyncio.sleep(0.25)
        # and the last sweeps: seen run, not assumed from the time that passed
        if not await self._leader_sweeps(redis, 4):
            self.report.problems.append("no reconciler sweep ran after quiescence")

    async def _leader_sweeps(self, redis: Redis, n: int, timeout_s: float = 30.0) -> bool:
        """Until the reconcilers' leader renewed its lease `n` times (it does at the start of every
        sweep pass, so `n - 1` whole passes ran after this call); False past `timeout_s`. A renewal
        is the lease's PTTL going up; one missed between two reads only makes this wait longer."""
        deadline = time.monotonic() + timeout_s
        seen, last = 0, None
        while seen < n:
            if time.monotonic() > deadline:
                return False
            try:
                ttl = await redis.pttl(self.keys.leader)
            except Exception:  # noqa: BLE001 - Redis may still be restarting
                ttl = None
            if ttl is not None and last is not None and ttl > last:
                seen += 1
            last = ttl if ttl is not None else last
            await asyncio.sleep(min(0.02, self.cfg.sweep_interval_s / 5))
        return True

    async def _stale_leases(self, redis: Redis) -> list[str]:
        """Leases of worker processes that are no longer running."""
        live_pids = {p.popen.pid for p in self.cluster.procs if p.popen.poll() is None}
        workers = [s(m) for m in await redis.zrange(self.keys.workers, 0, -1)]
        return [w for w in workers if not any(f"-{pid}-" in w for pid in live_pids)]

    async def _pending_counts(self, redis: Redis) -> dict[str, int]:
        out = {}
        streams = [(self.keys.tasks(self.cluster.pipeline.queue(st), c), TASK_GROUP) for st in STAGES for c in self.keys.all_cells] + \
            [(self.keys.events(c), EVENT_GROUP) for c in self.keys.all_cells]
        for stream, group in streams:
            try:
                info = await redis.xpending(stream, group)
            except Exception:  # noqa: BLE001 - no group yet
                continue
            if info["pending"]:
                out[f"XPENDING {stream}"] = info["pending"]
        return out

    # ------------------------------------------------------------ verify
    async def verify(self, redis: Redis) -> None:
        rep, cfg = self.report, self.cfg
        rep.accepted, rep.refused = len(self.accepted), self.refused
        rep.faults = Counter(f.kind for f in self.faults)
        kill_ms = {f.pid: f for f in self.faults if f.kind in ("kill-worker", "stop-worker")}
        for wf_id, i in self.accepted.items():
            pipe = redis.pipeline(transaction=False)
            pipe.hgetall(self.keys.wf(wf_id))
            pipe.hgetall(self.keys.stages(wf_id))
            pipe.get(self.keys.out(wf_id, "thinker"))
            pipe.xrange(self.keys.out(wf_id, "code2wav"))
            pipe.xrange(self.keys.log(wf_id))
            rec, stages, text, audio, log = await pipe.execute()
            log = [(eid, event) for eid, fields in log for event in log_events_raw(fields)]     # one per call
            rec = {s(k): s(v) for k, v in rec.items()}
            stages = {s(k): s(v) for k, v in stages.items()}
            if texts_in_record(rec):     # the text is in the record, not in the out key
                text = rec.get(StageField.text("thinker"))
            if not rec:
                rep.lost += 1
                rep.problems.append(f"{wf_id}: record missing (lost)")
                continue
            state = rec.get("state")
            if state not in TERMINAL:
                rep.lost += 1
                rep.problems.append(f"{wf_id}: not terminal ({state})\n{self._timeline(wf_id, log, stages)}")
                continue
            if state != "completed":
                rep.not_completed[wf_id] = f"{state}: {rec.get('error')}"
                rep.problems.append(f"{wf_id}: {state}: {rec.get('error')}\n{self._timeline(wf_id, log, stages)}")
                continue
            rep.completed += 1
            want_text, want_chunks = expected_output(prompt_for(i), cfg)
            got_text = s(text)
            # text: the final output and the client stream (log text deltas) must match exactly
            # one text entry carries the deltas of steps `from`..`seq` (one entry per script call)
            deltas = [(int(f.get(b"from") or f[b"seq"]), int(f[b"seq"]), s(f[b"delta"]))
                      for _, f in log if f.get(b"t") == b"text"]
            seqs = [q for first, last, _ in deltas for q in range(first, last + 1)]
            if len(seqs) != len(set(seqs)) or got_text != want_text and len(got_text) > len(want_text):
                rep.duplicated += 1
                rep.problems.append(f"{wf_id}: duplicated text: {got_text!r} vs {want_text!r}")
            elif got_text != want_text or seqs != list(range(1, len(want_chunks) + 1)) \
                    or "".join(d for _, _, d in deltas) != want_text:
                rep.missing += 1
                rep.problems.append(f"{wf_id}: text mismatch: {got_text!r} vs {want_text!r}; seqs {seqs}")
            # audio: chunk seqs 1..N once each, PCM equal to the fault-free output
            aseqs = [int(f[b"seq"]) for _, f in audio]
            pcm = [bytes(f[b"pcm"]) for _, f in audio]
            if len(aseqs) != len(set(aseqs)) or len(aseqs) > len(want_chunks):
                rep.duplicated += 1
                rep.problems.append(f"{wf_id}: duplicated audio chunks: seqs {aseqs}")
            elif aseqs != list(range(1, len(want_chunks) + 1)) or pcm != want_chunks:
                rep.missing += 1
                rep.problems.append(f"{wf_id}: audio mismatch: seqs {aseqs} (want {len(want_chunks)})")
            # exactly one terminal event
            terminals = [f for _, f in log if f.get(b"t") == b"terminal"]
            if len(terminals) != 1:
                rep.bad_terminals += 1
                rep.problems.append(f"{wf_id}: {len(terminals)} terminal events")
            self._recovery(log, kill_ms)
        await self._leftovers(redis)

    def _timeline(self, wf_id: str, log: list[Any], stages: dict[str, str]) -> str:
        """What happened to a workflow that did not complete, for its failure message: its stage
        hash, then its log's transitions interleaved with the faults injected (ms from the first
        entry; chunk deltas left out)."""
        if not log:
            return "\n".join([f"  stages={stages} (empty log)", *self._log_lines(wf_id)])
        t0 = int(s(log[0][0]).split("-")[0])
        events = [(int(s(eid).split("-")[0]),
                   " ".join(f"{s(k)}={s(v)[:60]}" for k, v in f.items() if k not in (b"delta", b"text")))
                  for eid, f in log if f.get(b"t") not in (b"text", b"audio")]
        t_end = events[-1][0] if events else t0
        events += [(f.t_ms, f"FAULT {f.kind} {f.role} pid={f.pid}" + (f" until +{f.until_ms - t0}" if f.until_ms else ""))
                   for f in self.faults if t0 - 10_000 <= f.t_ms <= t_end]
        lines = [f"  +{t - t0:>6} ms  {what}" for t, what in sorted(events)]
        return "\n".join([f"  stages={stages}", *lines, *self._log_lines(wf_id)])

    def _log_lines(self, wf_id: str, most: int = 40) -> list[str]:
        """The lines of the processes' logs that name workflow `wf_id`."""
        out = []
        for path in sorted(self.cluster.workdir.glob("*.log")):
            try:
                found = [line.rstrip() for line in path.read_text(errors="replace").splitlines() if wf_id in line]
            except OSError:
                continue
            out += [f"  {path.stem}: {line[:300]}" for line in found]
        return out[-most:]

    def _recovery(self, log: list[Any], kills: dict[int, Fault]) -> None:
        """Retries, resumed sessions, and the time from a worker's death to its session's next progress."""
        rep = self.report
        entries = [(int(s(eid).split("-")[0]), {s(k): s(v) for k, v in f.items() if k not in (b"pcm",)})
                   for eid, f in log]
        for idx, (t_retry, f) in enumerate(entries):
            if f.get("t") != "retry":
                continue
            rep.retries += 1
            reason = f.get("reason", "")
            rep.retries_by_reason[reason.split(":", 1)[0]] += 1
            stage, attempt = f.get("stage"), f.get("attempt")
            before = [g for _, g in entries[:idx] if g.get("stage") == stage and g.get("t") in ("text", "audio")]
            if before or (stage == "talker" and any(g.get("t") == "audio" for _, g in entries[:idx])):
                rep.resumed += 1
            if not reason.startswith("lost:"):
                continue
            fault = next((k for pid, k in kills.items() if f"-{pid}-" in reason), None)
            if fault is None:
                continue
            t_dead = fault.t_ms
            # next progress of the re-queued session: its claim, or (final stages) its next output
            for t_next, g in entries[idx + 1:]:
                if g.get("stage") != stage:
                    continue
                if (g.get("t") == "stage" and g.get("attempt") == attempt) or g.get("t") in ("text", "audio"):
                    rep.recovery_ms.append(t_next - t_dead)
                    break

    async def _leftovers(self, redis: Redis) -> None:
        rep = self.report
        left: dict[str, Any] = dict(await self._pending_counts(redis))
        for c in self.keys.all_cells:
            for st in STAGES:
                if n := await redis.xlen(self.keys.tasks(self.cluster.pipeline.queue(st), c)):
                    left[f"XLEN tasks:{st} cell {c}"] = n
            if n := await redis.xlen(self.keys.events(c)):
                left[f"XLEN events cell {c}"] = n
            if n := await redis.zcard(self.keys.inflight(c)):
                left[f"inflight cell {c}"] = n
            if n := await redis.zcard(self.keys.retries(c)):
                left[f"scheduled retries cell {c}"] = n
        edges = [k async for k in redis.scan_iter(match=f"{self.keys.prefix}:*:wf:*:edge:*", count=1000)]
        if edges:
            left["edge keys"] = len(edges)
        if stale := await self._stale_leases(redis):
            left["stale worker leases"] = stale
        live_pids = {p.popen.pid for p in self.cluster.procs if p.popen.poll() is None}
        for kind in ("wake", "inbox"):        # a dead worker's private streams are deleted with its lease
            keys = [s(k) async for k in redis.scan_iter(match=f"{self.keys.prefix}:*:{kind}:*", count=1000)]
            stale_keys = [k for k in keys if not any(f"-{pid}-" in k for pid in live_pids)]
            if stale_keys:
                left[f"stale {kind} streams"] = len(stale_keys)
        rep.leftovers = left
        if left:
            rep.problems.append(f"leftovers after quiescence: {left}")


def summary(reports: list[Report]) -> str:
    rows = [r.row() for r in reports]
    head = "| " + " | ".join(rows[0]) + " |"
    sep = "|" + "|".join("---" for _ in rows[0]) + "|"
    return "\n".join([head, sep, *("| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows)])


def dump(report: Report, path: Path) -> None:
    doc = {**report.row(), "refused": report.refused, "faults": dict(report.faults),
           "retries_by_reason": dict(report.retries_by_reason), "recovery_ms": report.recovery_ms,
           "problems": report.problems[:50], "leftovers": report.leftovers}
    path.write_text(json.dumps(doc, indent=2, default=str))


__all__ = ["ChaosConfig", "ChaosRun", "Cluster", "Report", "api_available", "dump", "expected_output",
           "np", "summary"]
