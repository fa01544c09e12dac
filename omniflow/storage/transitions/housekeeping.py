"""Housekeeping: `reap_consumer.lua` (an idle consumer out of its group), `lease.lua` (the
reconciler's leader lease), `purge.lua` (a finished workflow deleted with its index entries) and
`trim_tasks.lua` (the task entries of finished sessions deleted)."""
from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, IntEnum
from typing import Any

from omniflow.storage import redisio
from omniflow.storage.keys import Keys
from omniflow.storage.schema import s
from omniflow.storage.transitions._base import RETURN_CODES, Call, code_of, returns, script_call


@returns("reap_consumer")
class ReapResult(IntEnum):
    GONE = 1            # deleted now, or the group or stream is
    KEPT = 0            # it holds pending entries


@returns("lease")
class LeaseResult(str, Enum):
    TAKEN = "taken"
    RENEWED = "renewed"
    HELD = "held"       # another owner's


@returns("purge")
class PurgeResult(str, Enum):
    PURGED = "purged"
    LIVE = "live"


def reap_consumer(stream: str, group: str, consumer: str) -> Call:
    """Delete `consumer` of `group` on `stream` (a key from `Keys`) only while it holds nothing."""
    return script_call("reap_consumer", [stream], [group, consumer])


def reap_code(reply: Any) -> ReapResult:
    return code_of(ReapResult, reply, "reap_consumer")


async def reap_idle_consumers(redis: Any, stream: str, group: str, *, idle_ms: int, keep: str = "") -> int:
    """Delete the consumers of `group` that hold nothing and have not read for `idle_ms` (their
    process is gone: every live reader reads at least once per block). Atomic per consumer: one
    that took an entry meanwhile is kept. Returns how many were deleted."""
    with redisio.boundary():
        consumers = await redis.xinfo_consumers(stream, group)
    dead = [c["name"] for c in consumers
            if int(c.get("pending") or 0) == 0 and int(c.get("idle") or 0) > idle_ms
            and s(c["name"]) != keep]
    if not dead:
        return 0
    results = await redisio.execute(redis, [reap_consumer(stream, group, name) for name in dead])
    return sum(1 for r in results if r == ReapResult.GONE)


RETURN_CODES["trim_tasks"] = None      # answers how many entries went, not a code


def trim_tasks(streams: Sequence[str]) -> Call:
    """Delete the entries of task `streams` (one cell's, from `Keys.tasks`) that every group has
    delivered and acknowledged. Its reply: how many went."""
    return script_call("trim_tasks", list(streams), [])


def leader_lease(keys: Keys, owner: str, *, ttl_ms: int) -> Call:
    """Take or renew the reconciler's leader lease for `owner`."""
    return script_call("lease", [keys.leader], [owner, ttl_ms])


def lease_code(reply: Any) -> LeaseResult:
    return code_of(LeaseResult, reply, "lease")


def purge(keys: Keys, wf_id: str, *, tenant: str, request_id: str, finals: Sequence[str]) -> Call:
    """The `purge.lua` call deleting one finished workflow of its cell (its webhook records, in
    their own slot, are deleted apart: `Keys.webhook_keys`)."""
    cell = keys.cell_of(wf_id)
    doomed = [keys.stages_legacy(wf_id), keys.log(wf_id), keys.done(wf_id), *(keys.out(wf_id, st) for st in finals)]
    if request_id:
        doomed.append(keys.idem(tenant, request_id, cell))
    indexes = [keys.all_wf(cell), *keys.state_indexes(cell), keys.tenant_index(tenant, cell)]
    return script_call("purge", [keys.wf(wf_id), *doomed, *indexes], [wf_id, len(doomed)])


def purge_code(reply: Any) -> PurgeResult:
    return code_of(PurgeResult, reply, "purge")
