"""Admission: `submit.lua` (create, admit and pre-submit a workflow) and `abort.lua` (retire one)."""
from __future__ import annotations

from enum import Enum
from collections.abc import Sequence
from typing import Any

from omniflow.errors import InvalidRequest, WorkflowNotFound, WorkflowRetired
from omniflow.models import WorkflowState
from omniflow.storage.keys import FinalizePlan, Keys
from omniflow.storage.schema import s
from omniflow.storage.transitions._base import Call, code_of, returns, script_call


@returns("submit")
class SubmitResult(str, Enum):
    OK = "ok"
    EXISTING = "existing"       # the request id names a workflow already
    RETIRED = "retired"         # the id was aborted or failed before
    EXISTS = "exists"           # the id is taken
    BUSY = "busy"               # the cell is at its `max_in_flight` share


@returns("abort")
class AbortResult(str, Enum):
    OK = "ok"
    TERMINAL = "terminal"       # already over: its state is the second element
    GONE = "gone"               # no such workflow


def submit(keys: Keys, wf_id: str, *, tenant: str, request_id: str, admit: tuple[str, ...], now_ms: int,
           deadline_ms: int, cell_limit: int, idempotency_ttl_s: int, stages_csv: str, admit_csv: str,
           record: list[Any], priority: str = "api", fair: Sequence[Any] = ()) -> Call:
    """The `submit.lua` call of one workflow (`record`: flat field/value pairs, tenant first); its
    idempotency key is that of (`tenant`, `request_id`), ignored when `idempotency_ttl_s` is 0.
    `admit`: the queues admitted, written in the streams of class `priority` (the record's `prio`);
    `fair`: the fair-share arguments (`FairShare.submit_args`: share, floor, cap; none: no check)."""
    cell = keys.cell_of(wf_id)
    return script_call("submit", [
        keys.wf(wf_id), keys.log(wf_id), keys.inflight(cell), keys.tomb(wf_id),
        keys.idem(tenant, request_id or "-", cell),
        keys.all_wf(cell), keys.tenant_index(tenant, cell), keys.tenants(cell), keys.tenant_inflight(cell),
        *(keys.tasks(st, cell, priority) for st in admit),
    ], [keys.prefix, wf_id, now_ms, deadline_ms, cell_limit, idempotency_ttl_s, stages_csv, admit_csv,
        len(record) // 2, *record, *fair])


def submit_result(reply: Any) -> tuple[SubmitResult, str]:
    """(code, id or count) of a `submit.lua` reply."""
    return code_of(SubmitResult, reply, "submit"), s(reply[1])


def retired(wf_id: str) -> WorkflowRetired:
    return WorkflowRetired(f"workflow {wf_id} is retired (aborted or failed) and cannot be resubmitted; "
                           "submit again with a fresh request_id")


def raise_for_submit(code: SubmitResult, ident: str) -> None:
    """The error a refused submit means (`BUSY` is the caller's: its message depends on the cells)."""
    if code is SubmitResult.RETIRED:
        raise retired(ident)
    if code is SubmitResult.EXISTS:
        raise InvalidRequest(f"workflow id {ident} already exists")


def abort(keys: Keys, plan: FinalizePlan, wf_id: str, *, now_ms: int, state: WorkflowState, reason: str,
          stage: str, tombstone_ttl_s: int, result_ttl_s: int) -> Call:
    """The `abort.lua` call retiring `wf_id` (a client's abort, the reconciler's deadline sweep)."""
    return script_call(
        "abort", [keys.wf(wf_id), keys.inflight(keys.cell_of(wf_id)), *keys.finalize_keys(wf_id, plan)],
        [keys.prefix, now_ms, state.value, reason, stage, tombstone_ttl_s, result_ttl_s])


def abort_code(reply: Any) -> AbortResult:
    return code_of(AbortResult, reply, "abort")


def abort_result(wf_id: str, reply: Any, state: WorkflowState) -> str:
    """The state an abort left the workflow in; `WorkflowNotFound` when there is none."""
    code = abort_code(reply)
    if code is AbortResult.GONE:
        raise WorkflowNotFound(f"no workflow {wf_id}")
    return state.value if code is AbortResult.OK else s(reply[1])
