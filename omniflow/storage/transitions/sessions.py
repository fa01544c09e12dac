"""Sessions and claims: `claim.lua` (bind delivered tasks to a worker), `restart.lua` (an output
starts over, or a producer runs again), `heartbeat.lua` (a worker's lease and info)."""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from omniflow.models import WorkflowState
from omniflow.storage.keys import TASK_GROUP, Keys
from omniflow.storage.transitions._base import RETURN_CODES, Call, code_of, returns, script_call

#: one task of a claim: (task entry id, workflow id, attempt)
Claim = tuple[str, str, int]


@returns("claim")
class ClaimResult(str, Enum):
    OK = "ok"
    DROP = "drop"               # acked and deleted (the workflow gone or over, the attempt stale), or held by another replica
    LAYOUT = "layout"           # nothing written: a workflow of before (`<wf>:stages`); claim it again naming it in `legacy`


@returns("restart")
class RestartResult(str, Enum):
    OK = "ok"
    FENCED = "fenced"
    EXHAUSTED = "exhausted"     # regenerate: the producer has used its attempts; nothing changed


@dataclass(frozen=True)
class ClaimGroup:
    """The tasks of one stage delivered from one task stream: `queue` (`Pipeline.queue`:
    `<stage>@<version>`; the stage's own if None) of class `priority`, in `cell`."""

    stage: str
    upstream: Sequence[str]
    cell: int
    claims: Sequence[Claim]
    queue: str | None = None
    priority: str = "api"


def claim(keys: Keys, stage: str, upstream: Sequence[str], cell: int, claims: Sequence[Claim], *, worker_id: str,
          now_ms: int, queue: str | None = None, priority: str = "api", legacy: Collection[str] = ()) -> Call:
    """One `claim.lua` call for a batch of tasks of `stage` in `cell` delivered to `worker_id` (one
    `ClaimGroup`: see `claim_groups`)."""
    return claim_groups(keys, [ClaimGroup(stage, upstream, cell, claims, queue, priority)], worker_id=worker_id,
                        now_ms=now_ms, legacy=legacy)


def claim_groups(keys: Keys, groups: Sequence[ClaimGroup], *, worker_id: str, now_ms: int,
                 legacy: Collection[str] = ()) -> Call:
    """One `claim.lua` call for the tasks of several stages delivered to `worker_id` together (one
    read of a worker serving several stages), all in one cell; its replies come in the order of the
    groups' tasks. `legacy`: the workflows of the batch known to be of the storage layout before
    (their stage fields in `<wf>:stages`, declared for them only: a claim of one without it answers
    `ClaimResult.LAYOUT`)."""
    kk: list[str] = []
    args: list[Any] = [keys.prefix, TASK_GROUP, worker_id, now_ms]
    for n, group in enumerate(groups):
        stage, upstream = group.stage, group.upstream
        kk.append(keys.tasks(group.queue or stage, group.cell, group.priority))
        if n == 0:
            kk.append(keys.state_index(WorkflowState.RUNNING.value, group.cell))
        else:
            args.append("+")
        args += [",".join(upstream), stage]
        for entry_id, wf_id, attempt in group.claims:
            kk += [keys.wf(wf_id), keys.log(wf_id), *(keys.edge(wf_id, src, stage) for src in upstream)]
            args += [entry_id, wf_id, attempt]
    wf_ids = dict.fromkeys(wf_id for group in groups for _entry_id, wf_id, _attempt in group.claims if wf_id in legacy)
    kk += [keys.stages_legacy(wf_id) for wf_id in wf_ids]
    return script_call("claim", kk, args)


def claim_code(reply: Any) -> ClaimResult:
    """The code of one task's reply of a `claim.lua` call."""
    return code_of(ClaimResult, reply, "claim")


def restart(keys: Keys, wf_id: str, stage: str, *, attempt: int | str, below: Sequence[str], edges: Sequence[tuple[str, str]],
            requeued: Sequence[str], now_ms: int, regenerate: tuple[str, int, int, str] | None = None,
            priority: str = "api") -> Call:
    """The `restart.lua` call: `stage` (attempt `attempt`; '' to regenerate) and the stages `below`
    it start over; `edges` (src, dst) are cleared, the task streams `requeued` (the queues of the
    stages re-queued: `Pipeline.queue`; of the workflow's class `priority`) written to. `regenerate`:
    (the consuming stage that asks, its attempt, the producer's most attempts, why)."""
    cell = keys.cell_of(wf_id)
    kk = [keys.wf(wf_id), keys.stages_legacy(wf_id), keys.log(wf_id), *(keys.edge(wf_id, a, b) for a, b in edges),
          *(keys.out(wf_id, st) for st in (stage, *below)), *(keys.tasks(st, cell, priority) for st in requeued)]
    args: list[Any] = [keys.prefix, stage, attempt, now_ms, ",".join(below), ",".join(f"{a}:{b}" for a, b in edges)]
    if regenerate is not None:
        args += list(regenerate)
    return script_call("restart", kk, args)


def restart_result(reply: Any) -> RestartResult:
    return code_of(RestartResult, reply, "restart")


RETURN_CODES["heartbeat"] = None       # answers the `drain` field


def heartbeat(keys: Keys, worker_id: str, *, loading: bool, expiry_ms: int, info_ttl_s: int,
              info: dict[str, Any]) -> Call:
    """The `heartbeat.lua` call: renew `worker_id`'s lease (or its loading announcement) and info.
    Its reply is the info hash's `drain` field (or None)."""
    registry = keys.workers_loading if loading else keys.workers
    return script_call("heartbeat", [registry, keys.worker_info(worker_id)],
                       [worker_id, expiry_ms, info_ttl_s, *(x for kv in info.items() for x in kv)])

