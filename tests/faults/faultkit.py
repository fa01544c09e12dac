"""Fault injection against a real server: RedisClient says no (issue 9).

The engine runs as real processes (`tests.chaos.driver.Cluster`: workers, a reconciler, a jobs
runner) under a steady load of workflows, while `FaultRun` makes the server refuse in every way
it can, one fault at a time, each injected and then cleared:

| fault        | how                                                                          |
|--------------|------------------------------------------------------------------------------|
| oom          | `CONFIG SET maxmemory 1` (below usage: every write that can grow memory is refused), then 0 |
| readonly     | the server becomes a replica of a spare server that holds its data (writes paused until the spare caught up, so nothing is lost), then is promoted back |
| busy         | a script that runs for the whole window (`busy-reply-threshold` lowered): every other command gets BUSY |
| pause        | `CLIENT PAUSE <window> ALL`                                                   |
| kill-clients | `CLIENT KILL TYPE normal` and `TYPE pubsub`: every connection of the engine dropped |
| script-flush | `FUNCTION FLUSH`: every script call finds its function gone                   |
| poison       | malformed entries in every stream the engine reads: each stage's task stream, the events stream, a worker's inbox, the notify stream, the retries zset, and one workflow's edge log (with the inbox copy its consumer reads) |

Then, after quiescence, `verify` checks: no process exited; every accepted workflow completed with
exactly the output a fault-free run produces (no chunk missing or duplicated), except the one whose
edge log was poisoned, which failed with the reason; every poison entry is in a dead-letter stream
with a reason; nothing left pending; no key kind and no stream grew without bound.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
from omniflow.storage.client import RedisClient

from omniflow.ops.embedded import EmbeddedServer
from omniflow.errors import AdmissionRefused, OmniflowError
from omniflow.storage.keys import EVENT_GROUP, NOTIFY_GROUP, TASK_GROUP, Keys
from omniflow.models import SubmitRequest, WorkflowInput
from omniflow.storage.redisio import REDIS_ERRORS, connect
from omniflow.client.store import Store
from omniflow.storage.schema import StageField, now_ms, s, texts_in_record
from omniflow.storage.usage import bucket_of
from omniflow.storage.schema import log_events_raw
from helpers import eventually
from tests.chaos.driver import STAGES, TERMINAL, ChaosConfig, Cluster, expected_output, prompt_for

FAULTS = ("oom", "readonly", "busy", "pause", "kill-clients", "script-flush", "poison")
BUSY_SCRIPT = """
local t = redis.call('TIME')
local stop = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[1]) * 1000
repeat t = redis.call('TIME') until tonumber(t[1]) * 1000000 + tonumber(t[2]) >= stop
return 1
"""
POISON_PROMPT = "poisoned edge"


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Window:
    fault: str
    start_ms: int
    end_ms: int = 0


@dataclass
class Submitted:
    index: int
    t_ms: int
    wf_id: str | None            # None: refused (the client was told)
    error: str = ""


@dataclass
class FaultReport:
    windows: list[Window] = field(default_factory=list)
    accepted: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    completed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    missing: int = 0
    duplicated: int = 0
    not_terminal: int = 0
    dead_letters: dict[str, list[str]] = field(default_factory=dict)
    leftovers: dict[str, Any] = field(default_factory=dict)
    grown: dict[str, Any] = field(default_factory=dict)
    crashed: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def table(self) -> str:
        head = ["fault", "window s", "workflows in flight", "completed", "failed", "lost", "missing/dup chunks",
                "submits refused", "retries"]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        for row in self.rows:
            lines.append("| " + " | ".join(str(row[h]) for h in head) + " |")
        return "\n".join(lines)


class FaultRun:
    """One run: steady load, the faults one after the other, then quiescence and checks."""

    def __init__(self, cluster: Cluster, server: EmbeddedServer, spare: EmbeddedServer, *, submit_rate: float,
                 hold_s: float = 2.0, gap_s: float = 2.0, seed: int = 9) -> None:
        self.cluster, self.server, self.spare = cluster, server, spare
        self.cfg: ChaosConfig = cluster.cfg
        self.keys = Keys(cluster.settings.prefix)          # one cell: a single server
        self.submit_rate, self.hold_s, self.gap_s = submit_rate, hold_s, gap_s
        self.rng = random.Random(seed)
        self.report = FaultReport()
        self.submits: list[Submitted] = []
        self.poisoned_wf: str | None = None
        self.poison_sent: Counter[str] = Counter()
        self._load = True
        self._baseline_hour = 0          # the usage hour when the key baseline was taken

    # ------------------------------------------------------------ load
    async def submit_steadily(self, store: Store) -> None:
        interval, i, t0 = 1.0 / self.submit_rate, 0, time.monotonic()
        while self._load:
            delay = t0 + i * interval - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)      # the load's pace (submit_rate), not a synchronisation
            req = SubmitRequest(input=WorkflowInput(text=prompt_for(i)))
            t = now_ms()
            try:
                sub = await asyncio.wait_for(store.submit(req), 5.0)
                self.submits.append(Submitted(i, t, sub.id))
            except (OmniflowError, asyncio.TimeoutError, *REDIS_ERRORS) as exc:
                kind = "busy" if isinstance(exc, AdmissionRefused) else type(exc).__name__
                self.submits.append(Submitted(i, t, None, kind))
            i += 1

    # ------------------------------------------------------------ faults
    async def inject(self, admin: RedisClient, fault: str) -> Window:
        window = Window(fault, now_ms())
        hold_ms = int(self.hold_s * 1000)
        # each `sleep(self.hold_s)` below is how long the fault lasts (part of the fault, not a wait)
        if fault == "oom":
            await admin.config_set("maxmemory", 1)
            await asyncio.sleep(self.hold_s)
            await admin.config_set("maxmemory", 0)
        elif fault == "readonly":
            window.start_ms = await self._fail_over(admin)
            await asyncio.sleep(self.hold_s)
            await admin.raw.replicaof("NO", "ONE")
        elif fault == "busy":
            await admin.config_set("busy-reply-threshold", 50)
            runner = connect(self.server.url)
            try:
                await runner.raw.eval(BUSY_SCRIPT, 0, hold_ms)
            finally:
                await runner.aclose()
            await admin.config_set("busy-reply-threshold", 5000)
        elif fault == "pause":
            await admin.execute_command("CLIENT", "PAUSE", hold_ms, "ALL")
            await asyncio.sleep(self.hold_s)
        elif fault == "kill-clients":
            await admin.execute_command("CLIENT", "KILL", "TYPE", "normal")
            await admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        elif fault == "script-flush":
            await admin.script_flush()
        elif fault == "poison":
            await self._poison(admin)
        else:
            raise ValueError(fault)
        window.end_ms = now_ms()
        return window

    async def _fail_over(self, admin: RedisClient) -> int:
        """Make the server a replica of the spare, which first copies everything it holds (writes are
        paused until the spare has caught up: nothing acknowledged is lost). Returns when the
        server started refusing writes."""
        spare = connect(self.spare.url)
        try:
            await admin.config_set("repl-diskless-sync-delay", 0)
            await spare.raw.replicaof("127.0.0.1", self.server.port)
            await eventually(lambda: _link_up(spare), timeout_s=30, interval_s=0.05, what="the spare's replication link")
            await admin.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
            await eventually(lambda: _caught_up(admin, spare), timeout_s=10, interval_s=0.05,
                             what="the spare caught up")
            await spare.raw.replicaof("NO", "ONE")
            await admin.raw.replicaof("127.0.0.1", self.spare.port)
            started = now_ms()
            await admin.execute_command("CLIENT", "UNPAUSE")
            return started
        finally:
            await spare.aclose()

    async def _poison(self, admin: RedisClient) -> None:
        k = self.keys
        for stage in STAGES:
            await admin.xadd(k.tasks(self.cluster.pipeline.queue(stage), 0), {"garbage": "yes"})
            await admin.xadd(k.tasks(self.cluster.pipeline.queue(stage), 0), {"wf": "ghost", "s": stage, "a": str(2 ** 70)})
            self.poison_sent[f"dlq:{stage}"] += 2
        await admin.xadd(k.events(0), {"t": "failed", "wf": "ghost", "s": "thinker", "a": str(2 ** 1100)})
        await admin.xadd(k.events(0), {"t": "exploded", "wf": "ghost", "s": "thinker", "a": "1"})
        self.poison_sent["dlq:events"] += 2
        await admin.xadd(k.notify(0), {"wf": "ghost"})
        self.poison_sent["dlq:notify"] += 1
        await admin.zadd(k.retries(0), {"no|such|member|format": 0})
        self.poison_sent["dlq:retries"] += 1
        worker = next(iter([s(w) for w in await admin.zrange(k.workers, 0, -1)]))
        await admin.xadd(k.inbox(worker, 0), {"wf": "ghost", "da": "x", "m": b"\xc1"})
        self.poison_sent["dlq:inbox"] += 1
        # one workflow's edge log (and the inbox copy its bound consumer reads): a malformed chunk
        poisoner = connect(self.server.url)
        try:
            sub = await Store(poisoner, self.cluster.settings, self.cluster.pipeline).submit(
                SubmitRequest(input=WorkflowInput(text=POISON_PROMPT), stage_params={"thinker": {"token_delay_s": 0.3}}))
        finally:
            await poisoner.aclose()
        self.poisoned_wf = sub.id
        sk = k.stages(sub.id)

        async def talker_bound() -> list[Any] | None:
            st = await admin.hmget(sk, "talker", "talker:replica", "talker:attempt")
            return st if s(st[0]) in ("waiting_input", "running") and st[1] else None

        status, replica, attempt = await eventually(talker_bound, timeout_s=30, interval_s=0.05,
                                                   what="the poisoned workflow's talker bound")
        packed = msgpack.packb([["seq", 1, "a", 1]], use_bin_type=False)       # no payload: malformed
        await admin.xadd(k.edge(sub.id, "thinker", "talker"), {"m": packed})
        await admin.xadd(k.inbox(s(replica), 0), {"wf": sub.id, "ds": "talker", "da": s(attempt), "src": "thinker",
                                               "m": packed})

    # ------------------------------------------------------------ run
    async def run(self, faults: tuple[str, ...] = FAULTS) -> FaultReport:
        t0 = time.monotonic()
        admin = connect(self.server.url, socket_timeout=30)
        client = connect(self.server.url, socket_timeout=10)
        store = Store(client, self.cluster.settings, self.cluster.pipeline)
        load = asyncio.create_task(self.submit_steadily(store))
        try:
            # the schedule: gap_s of steady load before the first fault and between two faults
            await asyncio.sleep(self.gap_s)
            baseline = await self._key_shapes(admin)
            self._baseline_hour = bucket_of(now_ms())
            for fault in faults:
                self.report.windows.append(await self.inject(admin, fault))
                await asyncio.sleep(self.gap_s)
            self._load = False
            await load
            await self._quiesce(admin)
            self.report.duration_s = time.monotonic() - t0
            await self.verify(admin, baseline)
        finally:
            self._load = False
            if not load.done():
                load.cancel()
            await asyncio.gather(load, return_exceptions=True)
            await admin.aclose()
            await client.aclose()
        return self.report

    async def _quiesce(self, admin: RedisClient, timeout_s: float = 120.0) -> None:
        ids = [x.wf_id for x in self.submits if x.wf_id] + ([self.poisoned_wf] if self.poisoned_wf else [])
        deadline = time.monotonic() + timeout_s
        while ids and time.monotonic() < deadline:
            pipe = admin.pipeline(transaction=False)
            for wf_id in ids:
                pipe.hget(self.keys.wf(wf_id), "state")
            ids = [w for w, st in zip(ids, await pipe.execute()) if s(st) not in TERMINAL]
            await asyncio.sleep(0.25)
        settle = time.monotonic() + 15
        while time.monotonic() < settle and (await self._leftovers(admin) or not await self._dead_lettered(admin)):
            await asyncio.sleep(0.25)

    # ------------------------------------------------------------ checks
    async def verify(self, admin: RedisClient, baseline: dict[str, int]) -> None:
        rep = self.report
        rep.crashed = self.cluster.crash_report()
        if rep.crashed:
            rep.problems.append(f"processes exited: {rep.crashed}")
        for proc in self.cluster.procs:
            log = proc.log.read_text(errors="replace")
            if "Traceback" in log:
                rep.problems.append(f"{proc.role} logged a traceback: {log[log.index('Traceback'):][:600]}")
        outcome: dict[str, tuple[str, int, int, int]] = {}      # wf -> (state, created, finished, retries)
        for sub in self.submits:
            if sub.wf_id is None:
                rep.refused[sub.error] += 1
                continue
            rep.accepted += 1
            outcome[sub.wf_id] = await self._check(admin, sub)
        if self.poisoned_wf:
            rec = {s(k): s(v) for k, v in (await admin.hgetall(self.keys.wf(self.poisoned_wf))).items()}
            if rec.get("state") != "failed" or "malformed chunk" not in rec.get("error", ""):
                rep.problems.append(f"poisoned workflow {self.poisoned_wf}: {rec.get('state')} {rec.get('error')!r}")
        await self._dead_lettered(admin, record=True)
        rep.leftovers = await self._leftovers(admin)
        if rep.leftovers:
            rep.problems.append(f"leftovers: {rep.leftovers}")
        after = await self._key_shapes(admin)
        # per-process keys are bounded by the processes alive; the rest by what existed before the faults
        workers = len(self.cluster.live("worker:"))
        bound = {**baseline, **{_shape(self.keys.inbox("*", 0)): workers, _shape(self.keys.worker_info("*")): workers}}
        # fair share's per-cell tenant hashes: one key a cell (tseen appears once a tenant's live count first falls to 0)
        for cell in self.keys.all_cells:
            for key in (self.keys.tenant_inflight(cell), self.keys.tenant_seen(cell)):
                bound[_shape(key)] = max(bound.get(_shape(key), 0), 1)
            # usage is kept by the hour (each hour's hash expires with the retention): a run that
            # crosses the hour starts the next one, with or without faults
            hours = _shape(self.keys.usage(cell, 0))
            bound[hours] = bound.get(hours, 0) + bucket_of(now_ms()) - self._baseline_hour
        rep.grown = {shape: (bound.get(shape, 0), n) for shape, n in after.items()
                     if n > bound.get(shape, 0) and ":dlq:" not in shape}
        if rep.grown:
            rep.problems.append(f"keys grew: {rep.grown}")
        self._rows(outcome)

    async def _check(self, admin: RedisClient, sub: Submitted) -> tuple[str, int, int, int]:
        rep, k = self.report, self.keys
        assert sub.wf_id is not None
        pipe = admin.pipeline(transaction=False)
        pipe.hgetall(k.wf(sub.wf_id))
        pipe.get(k.out(sub.wf_id, "thinker"))
        pipe.xrange(k.out(sub.wf_id, "code2wav"))
        pipe.xrange(k.log(sub.wf_id))
        rec_raw, text, audio, log = await pipe.execute()
        log = [(eid, event) for eid, fields in log for event in log_events_raw(fields)]     # one entry per call
        rec = {s(a): s(b) for a, b in rec_raw.items()}
        if texts_in_record(rec):     # the text is in the record, not in the out key
            text = rec.get(StageField.text("thinker"))
        retries = sum(1 for _, f in log if f.get(b"t") == b"retry")
        state = rec.get("state", "")
        created, finished = int(rec.get("created_ms") or 0), int(rec.get("finished_ms") or 0)
        if state not in TERMINAL:
            rep.not_terminal += 1
            rep.problems.append(f"{sub.wf_id}: not terminal ({state or 'record missing'})")
            return "lost", created, finished, retries
        if state != "completed":
            rep.failed[sub.wf_id] = f"{state}: {rec.get('error')}"
            rep.problems.append(f"{sub.wf_id}: {state}: {rec.get('error')}")
            return state, created, finished, retries
        want_text, want_chunks = expected_output(prompt_for(sub.index), self.cfg)
        deltas = [(int(f.get(b"from") or f[b"seq"]), int(f[b"seq"]), s(f[b"delta"])) for _, f in log
                  if f.get(b"t") == b"text"]
        seqs = [q for a, b, _ in deltas for q in range(a, b + 1)]
        aseqs = [int(f[b"seq"]) for _, f in audio]
        if len(seqs) != len(set(seqs)) or len(aseqs) != len(set(aseqs)) or len(aseqs) > len(want_chunks):
            rep.duplicated += 1
            rep.problems.append(f"{sub.wf_id}: duplicated: text seqs {seqs}, audio seqs {aseqs}")
        elif s(text) != want_text or "".join(d for _, _, d in deltas) != want_text \
                or aseqs != list(range(1, len(want_chunks) + 1)) or [bytes(f[b"pcm"]) for _, f in audio] != want_chunks:
            rep.missing += 1
            rep.problems.append(f"{sub.wf_id}: output differs: {s(text)!r} vs {want_text!r}; audio seqs {aseqs}")
        else:
            rep.completed += 1
        return state, created, finished, retries

    async def _dead_lettered(self, admin: RedisClient, *, record: bool = False) -> bool:
        """Is every poison entry in its dead-letter stream, with a reason?"""
        ok = True
        for name, sent in self.poison_sent.items():
            entries = await admin.xrange(f"{self.keys.cell(0)}:{name}")
            reasons = [s(f.get(b"reason")) for _, f in entries if f.get(b"reason")]
            if record:
                self.report.dead_letters[name] = reasons
            if len(reasons) < sent:
                ok = False
                if record:
                    self.report.problems.append(f"{name}: {len(reasons)} dead letters with a reason, {sent} sent")
        return ok

    async def _leftovers(self, admin: RedisClient) -> dict[str, Any]:
        k, left = self.keys, {}
        for stream, group in [(k.tasks(self.cluster.pipeline.queue(st), 0), TASK_GROUP) for st in STAGES] + [(k.events(0), EVENT_GROUP),
                                                                                (k.notify(0), NOTIFY_GROUP)]:
            try:
                if (n := (await admin.xpending(stream, group))["pending"]):
                    left[f"pending {stream}"] = n
            except REDIS_ERRORS:
                pass
            if (n := await admin.xlen(stream)):
                left[f"XLEN {stream}"] = n
        for key in (k.inflight(0), k.retries(0)):
            if (n := await admin.zcard(key)):
                left[key] = n
        if edges := [x async for x in admin.scan_iter(match=f"{k.prefix}:*:wf:*:edge:*", count=1000)]:
            left["edge keys"] = len(edges)
        return left

    async def _key_shapes(self, admin: RedisClient) -> dict[str, int]:
        """How many keys of each kind outside the workflows' own (which expire): a worker's inbox,
        a group's consumers, and the like must not multiply with faults."""
        shapes: Counter[str] = Counter()
        async for raw in admin.scan_iter(match=f"{self.keys.prefix}:*", count=1000):
            key = s(raw)
            if any(part in key for part in (":wf:", ":tomb:", ":idem:", ":webhook:", ":idx:")):
                continue            # a workflow's own keys and the listing indexes: they expire / are trimmed
            shapes[_shape(key)] += 1
            if key.endswith(":tasks") or key in (self.keys.events(0), self.keys.notify(0)):
                try:
                    for group in await admin.xinfo_groups(key):
                        shapes[f"consumers of {_shape(key)}"] += int(group["consumers"])
                except REDIS_ERRORS:
                    pass
        return dict(shapes)

    def _rows(self, outcome: dict[str, tuple[str, int, int, int]]) -> None:
        rep = self.report
        for w in rep.windows:
            hit = {wf: o for wf, o in outcome.items() if o[1] <= w.end_ms and (o[2] == 0 or o[2] >= w.start_ms)}
            refused = sum(1 for x in self.submits if x.wf_id is None and w.start_ms <= x.t_ms <= w.end_ms + 500)
            bad = sum(1 for wf in hit if any(p.startswith(wf) and ("differs" in p or "duplicated" in p)
                                             for p in rep.problems))
            rep.rows.append({
                "fault": w.fault, "window s": f"{(w.end_ms - w.start_ms) / 1000:.1f}",
                "workflows in flight": len(hit) + (1 if w.fault == "poison" else 0),
                "completed": sum(1 for o in hit.values() if o[0] == "completed"),
                "failed": sum(1 for o in hit.values() if o[0] in ("failed", "aborted"))
                + (1 if w.fault == "poison" else 0),
                "lost": sum(1 for o in hit.values() if o[0] == "lost"), "missing/dup chunks": bad,
                "submits refused": refused, "retries": sum(o[3] for o in hit.values()),
            })


def _shape(key: str) -> str:
    """A process's own keys (`<cell>:inbox:<id>`, `<cell>:wake:<id>`, `<prefix>:{workers}:<id>`) as one
    shape, and a cell's usage hours (`<cell>:usage:<hour>`) as another."""
    parts = key.split(":")
    if len(parts) > 2 and parts[-2] == "usage" and parts[-1].isdigit():
        return ":".join([*parts[:-1], "*"])
    for i, part in enumerate(parts[:-1]):
        if part in ("inbox", "wake") or (part == "{workers}" and i == len(parts) - 2):
            return ":".join([*parts[:i + 1], "*"])
    return key


async def _link_up(replica: RedisClient) -> bool:
    return (await replica.info("replication")).get("master_link_status") == "up"


async def _caught_up(primary: RedisClient, replica: RedisClient) -> bool:
    a = (await primary.info("replication"))["master_repl_offset"]
    b = (await replica.info("replication"))["master_repl_offset"]
    return bool(a == b)
