"""Every Redis key name omniflow uses, built in this one module.

Workflows live in *cells* (`omniflow.storage.cells`): every key of a cell — a workflow's record, stage
hash, log, edge logs and outputs, and the cell's task streams, event stream, in-flight and retry
sets, tombstones, idempotency keys, dead letters, notifications and worker inboxes — starts with
the cell's base `<prefix>:{<cell tag>}`, so a Redis Cluster keeps the whole cell in one slot and
every Lua transition touches one slot. A workflow id carries its cell (`cells.cell_of`).

Keys outside the cells (the worker registry, leader lease, stats, job runner and batches) are
never touched by a script together with a cell key; the worker registry shares its own tag so
`heartbeat.lua` stays in one slot too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from omniflow.storage.cells import DEFAULT_CLUSTER_CELLS, cell_for_key, cell_of, cell_tag
from omniflow.models import PRIORITY_ORDER, WorkflowState
from omniflow.pipeline import INPUT_SRC
from omniflow.storage.schema import stages_in_record
from omniflow.storage.topology import is_cluster

if TYPE_CHECKING:
    from omniflow.config import Settings
    from omniflow.pipeline import Pipeline

DEFAULT_PREFIX = "of"
TASK_GROUP = "workers"
EVENT_GROUP = "reconciler"
NOTIFY_GROUP = "webhooks"
PRIORITY_NAMES = tuple(p.value for p in PRIORITY_ORDER)
DLQ_EVENTS = "events"           # the dead-letter stream of malformed events (`Keys.dlq`; not a stage)
# The states with a listing index (`Keys.state_index`). A pending workflow is in none: the cell's pending
# workflows are its `inflight` set less its running index (omniflow/storage/listing.py), so a workflow's
# start costs one ZADD where a pending index would cost a ZREM and a ZADD.
INDEXED_STATES = tuple(st for st in WorkflowState if st is not WorkflowState.PENDING)
# The tenant of a deployment without tenants (the client's default): submit.lua writes no tenant index for
# it, since that index would repeat `<c>:all`, nor its name in `Keys.tenants`; a listing by it walks `all`
# and checks the tenant.
UNINDEXED_TENANT = "default"
#: a payload key (`Keys.blob`): `<prefix>:{<cell tag>}:wf:<id>:blob:<src>:<dst>:<attempt>:<seq>`
BLOB_KEY = re.compile(r"[^{}]+:\{[^}]+\}:wf:[^:{}]+:blob:[^{}]+")


@dataclass(frozen=True, slots=True)
class FinalizePlan:
    """What of a pipeline's workflows `finalize` (_lib.lua) may touch: its final stages' outputs and
    every edge log (`finalize_plan`, computed once per pipeline; `Keys.finalize_keys` names them)."""
    finals: tuple[str, ...]
    edges: tuple[tuple[str, str], ...]


def finalize_plan(pipeline: Pipeline) -> FinalizePlan:
    # every edge log, the client's streamed input (`@input`) to the stage that takes audio included
    return FinalizePlan(tuple(pipeline.finals),
                        (*((e.src, e.dst) for st in pipeline.order for e in pipeline.outputs[st]),
                         *(((INPUT_SRC, pipeline.audio_stage),) if pipeline.audio_stage else ())))


@lru_cache(maxsize=4096)
def _cell_base(prefix: str, cell: int) -> str:
    return f"{prefix}:{{{cell_tag(cell)}}}"


@lru_cache(maxsize=16384)
def _wf_base(prefix: str, wf_id: str) -> str:
    """`<cell base>:wf:<id>`, the start of every key of a workflow: asked ~27 times per toy workflow
    by a co-located worker (each of its keys, each session), made once while the workflow runs."""
    return f"{_cell_base(prefix, cell_of(wf_id))}:wf:{wf_id}"


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = DEFAULT_PREFIX
    cells: int = 1

    @classmethod
    def of(cls, settings: Settings, redis: Any = None) -> Keys:
        """The keys of a deployment: its prefix and its number of cells (`OMNIFLOW_CELLS`; 0, the
        default: one cell on a single server, `DEFAULT_CLUSTER_CELLS` on a cluster, which is what
        `redis` (a client made by `redisio.connect`) is). Without a client, only the keys outside
        the cells are right when the count is automatic."""
        count = settings.cells or (DEFAULT_CLUSTER_CELLS if redis is not None and is_cluster(redis) else 1)
        return cls(settings.prefix, count)

    # --- cells ------------------------------------------------------------
    def cell(self, cell: int) -> str:
        """The base every key of `cell` starts with: `<prefix>:{<cell tag>}`."""
        return _cell_base(self.prefix, cell)

    @property
    def all_cells(self) -> range:
        return range(self.cells)

    @staticmethod
    def cell_of(wf_id: str) -> int:
        return cell_of(wf_id)

    # --- one workflow (in the cell its id carries) --------------------------
    def wf(self, wf_id: str) -> str:
        return _wf_base(self.prefix, wf_id)

    def stages(self, wf_id: str) -> str:
        """Where a workflow's stage fields (`StageField`) are: its record, beside its own fields (record
        field `sl` = '1', written by submit). A workflow an omniflow of before submitted keeps them in
        `stages_legacy` (no `sl`): readers that may meet one ask `stage_hash`."""
        return self.wf(wf_id)

    def stages_legacy(self, wf_id: str) -> str:
        """The stage hash of a workflow submitted before its stage fields moved into its record. Every
        script that reads or writes stage fields still declares it: such a workflow ends where it started."""
        return f"{self.wf(wf_id)}:stages"

    def stage_hash(self, wf_id: str, record: dict[str, str]) -> str:
        """Where the stage fields of the workflow whose (decoded) record is `record` are."""
        return self.wf(wf_id) if stages_in_record(record) else self.stages_legacy(wf_id)

    def log(self, wf_id: str) -> str:
        return f"{self.wf(wf_id)}:log"

    def done(self, wf_id: str) -> str:
        """One entry (`state`), written with the terminal log entry: what `wait` blocks on."""
        return f"{self.wf(wf_id)}:done"

    def edge(self, wf_id: str, src: str, dst: str) -> str:
        return f"{self.wf(wf_id)}:edge:{src}:{dst}"

    def input_edge(self, wf_id: str, stage: str) -> str:
        """The client's streamed input to `stage` (the pseudo-stage `@input`'s edge log)."""
        return self.edge(wf_id, "@input", stage)

    def out(self, wf_id: str, stage: str) -> str:
        return f"{self.wf(wf_id)}:out:{stage}"

    def blob(self, wf_id: str, src: str, dst: str, attempt: int, seq: int) -> str:
        """A chunk payload too large for its edge entry (the entry holds a reference to it)."""
        return f"{self.wf(wf_id)}:blob:{src}:{dst}:{attempt}:{seq}"

    def blobs(self, wf_id: str) -> str:
        """Set of a workflow's payload keys (`blob`): what its terminal releases."""
        return f"{self.wf(wf_id)}:blobs"

    def tomb(self, wf_id: str) -> str:
        return f"{self.cell(cell_of(wf_id))}:tomb:{wf_id}"

    def idem_cell(self, tenant: str, key: str) -> int:
        """The cell of a request id: fixed by (tenant, key), so a repeated request meets its workflow."""
        return cell_for_key(tenant, key, cells=self.cells)

    def idem(self, tenant: str, key: str, cell: int | None = None) -> str:
        """Idempotency key of (tenant, request id), in its cell (or in `cell`). The tenant is
        length-prefixed: both parts may contain ':', and (`team`, `a:x`) must never meet (`team:a`, `x`)."""
        where = self.idem_cell(tenant, key) if cell is None else cell
        return f"{self.cell(where)}:idem:{len(tenant)}:{tenant}:{key}"

    def finalize_keys(self, wf_id: str, plan: FinalizePlan) -> list[str]:
        """Every key `finalize` (_lib.lua) may touch besides the workflow's base key and its cell's
        in-flight set: its tombstone, its cell's notify and ends streams and state indexes, its cell's live count
        and last-seen time per tenant (fair share), its stages, log, done and payload registry, its
        final stages' outputs and its edge logs (`plan`). Every script that may end a workflow declares them."""
        return self._ending_keys(wf_id, plan, completing=False, legacy=True)

    def completion_keys(self, wf_id: str, plan: FinalizePlan, *, legacy: bool = False) -> list[str]:
        """What a session's finish that may complete its running workflow (`finalize` to 'completed'
        from 'running', in emit.lua) declares besides what its emit call declares already (the base
        key, log, payload registry, the stage's own output): `finalize_keys` less the tombstone
        and the other states' indexes, which a completion never touches, and less `<wf>:stages`
        unless the workflow is of the storage layout before (`legacy`; `finalize_declared` in
        _lib.lua checks what it needs against the record before completing)."""
        return self._ending_keys(wf_id, plan, completing=True, legacy=legacy)

    def _ending_keys(self, wf_id: str, plan: FinalizePlan, *, completing: bool, legacy: bool) -> list[str]:
        """`finalize_keys` (in its order), or only what a completion touches: one list for both, each
        key formatted once (a completing session's claim builds it: once per workflow)."""
        cell = cell_of(wf_id)
        if completing:
            keys = [self.notify(cell), self.ends(cell), self.state_index(WorkflowState.RUNNING.value, cell),
                    self.state_index(WorkflowState.COMPLETED.value, cell)]
        else:
            keys = [self.tomb(wf_id), self.notify(cell), self.ends(cell), *self.state_indexes(cell)]
        keys += [self.tenant_inflight(cell), self.tenant_seen(cell)]
        if legacy:
            keys.append(self.stages_legacy(wf_id))
        keys += [self.done(wf_id)] if completing else [self.log(wf_id), self.done(wf_id), self.blobs(wf_id)]
        keys += [self.out(wf_id, st) for st in plan.finals]
        keys += [self.edge(wf_id, a, b) for a, b in plan.edges]
        return keys

    def webhook_keys(self, wf_id: str) -> list[str]:
        """A workflow's webhook records (their own slot: never in a script with its cell's keys)."""
        return [self.webhook(wf_id), self.webhook_attempts(wf_id)]

    def registry_of_blob(self, blob_key: str) -> str:
        """The payload registry (`blobs`) a payload key (`blob`) is listed in."""
        wf, sep, _ = blob_key.partition(":blob:")
        if not sep:
            raise ValueError(f"{blob_key!r} is not a payload key")
        return f"{wf}:blobs"

    def is_blob_of(self, key: str, wf_id: str | None) -> bool:
        """Is `key` a payload key of workflow `wf_id` (None: of any workflow of any cell)?"""
        if wf_id is not None:
            return key.startswith(f"{self.wf(wf_id)}:blob:")
        return BLOB_KEY.fullmatch(key) is not None and key.startswith(f"{self.prefix}:{{")

    def blob_pattern(self, wf_id: str | None) -> str:
        """How a payload key of `wf_id` (or of any workflow) reads, for messages."""
        return f"{self.wf(wf_id or '<id>')}:blob:*"

    # --- one cell -------------------------------------------------------------
    def tasks(self, stage: str, cell: int, priority: str = "api") -> str:
        """A task stream of one priority class in one cell (consumer group `workers`): `stage` is a
        stage's queue in one pipeline version, `Pipeline.queue(stage)` = `<stage>@<version>` (a bare
        stage name is what a record without a version uses); the `api` class keeps the plain name,
        the others add theirs (`...:tasks:interactive`)."""
        base = f"{self.cell(cell)}:stage:{stage}:tasks"
        return base if priority == "api" else f"{base}:{priority}"

    def task_streams(self, stage: str, cell: int) -> list[str]:
        """A queue's task streams in one cell, highest priority class first (what a transition that
        may queue a session of any class declares)."""
        return [self.tasks(stage, cell, p) for p in PRIORITY_NAMES]

    def tenant_inflight(self, cell: int) -> str:
        """Live workflows per tenant in one cell (hash tenant -> count; submit adds, finalize takes
        away): what per-tenant fair share admission reads (`omniflow.storage.fairshare`)."""
        return f"{self.cell(cell)}:tinf"

    def tenant_seen(self, cell: int) -> str:
        """When (ms) each tenant's live workflows in one cell last fell to none (hash tenant -> ms, written
        by `finalize`): a tenant that comes and goes keeps its share between its requests."""
        return f"{self.cell(cell)}:tseen"

    def dlq(self, stage: str, cell: int) -> str:
        """Dead letters of one cell: a stage's exhausted tasks (`events`, `notify`: malformed entries)."""
        return f"{self.cell(cell)}:dlq:{stage}"

    def events(self, cell: int) -> str:
        """Stage reports of one cell (consumer group `reconciler`)."""
        return f"{self.cell(cell)}:events"

    def inflight(self, cell: int) -> str:
        """zset of the cell's live workflow ids by deadline (admission and deadline sweep)."""
        return f"{self.cell(cell)}:inflight"

    def all_wf(self, cell: int) -> str:
        """zset of every workflow id of the cell scored by creation time (listing, GC)."""
        return f"{self.cell(cell)}:all"

    def state_index(self, state: str, cell: int) -> str:
        """zset of the cell's workflow ids in one state, scored by creation ms (kept by the Lua transitions);
        `pending` has none (`INDEXED_STATES`)."""
        return f"{self.cell(cell)}:idx:state:{state}"

    def state_indexes(self, cell: int) -> list[str]:
        """Every state index of the cell (what a transition that moves a workflow declares)."""
        return [self.state_index(state.value, cell) for state in INDEXED_STATES]

    def tenant_index(self, tenant: str, cell: int) -> str:
        """zset of one tenant's workflow ids in the cell, scored by creation ms (written by submit.lua)."""
        return f"{self.cell(cell)}:idx:tenant:{tenant}"

    def tenants(self, cell: int) -> str:
        """set of the tenant names that have a tenant index in the cell (so the sweep can trim them): every
        tenant that has had a live workflow there, but `UNINDEXED_TENANT`."""
        return f"{self.cell(cell)}:idx:tenants"

    def usage(self, cell: int, bucket: int) -> str:
        """hash of one hour of the cell's usage (`omniflow.storage.usage`: `bucket` is the epoch hour;
        fields `<pipeline>|<stage>|<metric>|<tenant>`), added to by the sessions that finish in it."""
        return f"{self.cell(cell)}:usage:{bucket}"

    def retries(self, cell: int) -> str:
        """zset of the cell's scheduled retries, member ``<id>|<stage>|<attempt>``, score due ms."""
        return f"{self.cell(cell)}:retries"

    def notify(self, cell: int) -> str:
        """Stream of the cell's terminal workflows that asked for a webhook."""
        return f"{self.cell(cell)}:notify"

    def ends(self, cell: int) -> str:
        """Stream of the cell's workflows as they end (`wf`, `state`; about the last ENDS_MAX_LEN of
        them, `_lib.lua`): what a watcher of many workflows reads (`omniflow.client.bulk.Completions`)."""
        return f"{self.cell(cell)}:ends"

    def inbox(self, worker_id: str, cell: int) -> str:
        """A worker's input stream in one cell: chunks for its sessions of that cell, forwarded by
        the producers' emits."""
        return f"{self.cell(cell)}:inbox:{worker_id}"

    def wake(self, owner_id: str, cell: int) -> str:
        """Private stream a process blocks on beside its data streams of one cell, to be woken."""
        return f"{self.cell(cell)}:wake:{owner_id}"

    # --- outside the cells ----------------------------------------------------
    @property
    def fair_weights(self) -> str:
        """hash tenant -> fair-share weight, set live (`omniflow tenants weight`); one slot."""
        return f"{self.prefix}:{{fair}}:weights"

    @property
    def fair_waiting(self) -> str:
        """zset tenant -> when (ms) a submit of it was last refused as busy: a tenant waiting for room
        counts among those sharing it even before it holds anything."""
        return f"{self.prefix}:{{fair}}:waiting"

    @property
    def workers(self) -> str:
        """zset of live workers scored by lease expiry (ms)."""
        return f"{self.prefix}:{{workers}}"

    def worker_info(self, worker_id: str) -> str:
        return f"{self.prefix}:{{workers}}:{worker_id}"

    @property
    def workers_loading(self) -> str:
        """zset of the workers still loading their models (no lease yet), scored by the expiry (ms) of
        their announcement; '@' is in no worker id, so no worker's info hash can take this name."""
        return f"{self.prefix}:{{workers}}:@loading"

    @property
    def pipelines(self) -> str:
        """hash of the pipeline registry: name -> the version (content hash) new workflows of it get
        (`omniflow.storage.registry`)."""
        return f"{self.prefix}:{{pipelines}}"

    @property
    def pipeline_defs(self) -> str:
        """hash: version -> the canonical definition of that pipeline version (JSON), and when it was
        first registered; never overwritten, so a workflow can always find the version it started on."""
        return f"{self.prefix}:{{pipelines}}:defs"

    @property
    def layout(self) -> str:
        """How many cells this deployment has, recorded by its first process (`check_layout`)."""
        return f"{self.prefix}:cells"

    @property
    def abort_channel(self) -> str:
        return f"{self.prefix}:abort"

    # --- job runner (webhooks, batches) ---------------------------------
    @property
    def jobs_queue(self) -> str:
        return f"{self.prefix}:jobs"

    def job_id(self, kind: str, *parts: str) -> str:
        return ":".join((self.prefix, kind, *parts))

    def webhook(self, wf_id: str) -> str:
        return f"{self.prefix}:webhook:{{{wf_id}}}"

    def webhook_attempts(self, wf_id: str) -> str:
        """list of one workflow's webhook delivery attempts (JSON, oldest first)."""
        return f"{self.webhook(wf_id)}:attempts"

    @property
    def webhook_secret(self) -> str:
        return f"{self.prefix}:webhook-secret"

    # --- realtime sessions (`/v1/realtime`) ---------------------------------
    def realtime(self, session_id: str) -> str:
        """A realtime session's state (hash: owner connection, state JSON, tenant); its own hash tag:
        no script touches it together with a workflow's keys."""
        return f"{self.prefix}:rt:{{{session_id}}}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batch_input(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:input"

    def batch_lines(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:lines"

    def batch_done(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:done"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def stats(self) -> str:
        return f"{self.prefix}:stats"
