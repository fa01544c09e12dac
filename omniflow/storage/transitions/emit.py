"""A session's writes: `emit.lua` (output steps, optionally then the finish) and `finish.lua`.

`emit.lua`'s ops never name a key by a suffix: an op that writes a stream or string names it by its
position in KEYS (`EMIT_LOG`, `EMIT_OUT`; a payload op 'B' names one of the payload keys this call
appends to KEYS, see `emit`), so the whole key layout is built here, from `Keys`.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from omniflow.storage.keys import TASK_GROUP, Keys
from omniflow.storage.schema import pack_raw, s
from omniflow.storage.transitions._base import Call, code_of, returns, script_call

#: KEYS positions (1-based, as the Lua sees them) of a session's `emit.lua` call
EMIT_LOG = 4
EMIT_OUT = 5


@returns("emit")
class EmitResult(str, Enum):
    OK = "ok"
    COMPLETED = "completed"  # with a finish that may complete the workflow: it did (the workflow ended)
    DUP = "dup"             # every step was already written
    FENCED = "fenced"       # the session no longer owns the stage
    GAP = "gap"             # steps after a lost write were refused; with a finish: the attempt closed as failed
    INBOX = "inbox"         # nothing written: a consumer's inbox was not declared (`refused_inbox`); send again


@returns("finish")
class FinishResult(str, Enum):
    OK = "ok"
    FENCED = "fenced"
    GAP = "gap"             # steps of this attempt are missing: closed as a retryable failure
    INBOX = "inbox"         # nothing written: a consumer's inbox was not declared; send again


def refused_inbox(reply: Any) -> tuple[str, str]:
    """(stage, replica) of an `inbox` reply: the consumer whose inbox the call must declare ('', ''
    when the call only waits for an earlier refused one to be sent again)."""
    return s(reply[1]), s(reply[2])


def inbox_keys(keys: Keys, cell: int, consumers: Mapping[str, Sequence[str]]) -> list[str]:
    """The inboxes, in `cell`, of the replicas known to consume each downstream stage."""
    seen: dict[str, None] = {}
    for replicas in consumers.values():
        for replica in replicas:
            seen[keys.inbox(replica, cell)] = None
    return list(seen)


def emit_keys(keys: Keys, wf_id: str, stage: str, downstream: Sequence[str],
              consumers: Mapping[str, Sequence[str]] | None = None, *, queue: str | None = None,
              priority: str = "api", legacy: bool = False) -> list[str]:
    """Every key a session's `emit.lua` calls may touch (see its header), in the order the script
    reads them: the base key, the task and event streams of the workflow's cell, log, this stage's
    output, the payload registry, its edges, the stages hash of a workflow of before (`legacy`:
    claimed as one, see `ClaimResult.LAYOUT`), the inboxes of the replicas known to consume its
    downstream stages (`consumers`). Built once per session (again when `consumers` changes).
    `queue`: the stage's task stream name (`Pipeline.queue`: `<stage>@<version>`), the stage's if None;
    `priority`: the class of the stream the session's task came from."""
    cell = keys.cell_of(wf_id)
    return [keys.wf(wf_id), keys.tasks(queue or stage, cell, priority), keys.events(cell),
            keys.log(wf_id), keys.out(wf_id, stage), keys.blobs(wf_id), *(keys.edge(wf_id, stage, dst) for dst in downstream),
            *((keys.stages_legacy(wf_id),) if legacy else ()), *inbox_keys(keys, cell, consumers or {})]


def emit(base: list[str], wf_id: str, stage: str, attempt: int, *, status: str, now_ms: int, steps: list[list[Any]],
         finish: tuple[list[str], bytes] | None = None, replica: str = "") -> Call:
    """One `emit.lua` call: `steps`, then the `finish` if given: (its task stream, event stream and
    optional usage key; the packed finish). `base` is `emit_keys`. `replica`: the calling worker, when it
    hands what the call writes for its own sessions to them in memory (no inbox copy for those).

    A payload op ('B', key, {payload, ttl_ms}) names its key in `steps`; here the key is appended
    to KEYS and the op sent names it by its position instead (`steps` are left as they are: a call
    refused for an inbox is built again)."""
    kk = base
    if finish is not None:
        # the finish's task and event streams in place of the session's, then its usage key (if metered)
        fk = finish[0]
        kk = [base[0], *fk[:2], *base[3:], *fk[2:]]
    blobs: list[str] = []
    wire = steps
    for n, step in enumerate(steps):
        for i in range(1, len(step) - 2, 3):
            if step[i] == "B":
                if wire is steps:
                    wire = [list(x) for x in steps]
                blobs.append(step[i + 1])
                wire[n][i + 1] = len(kk) + len(blobs)
    if blobs:       # payload keys this call stores: declared like every other key
        kk = [*kk, *blobs]
    args: list[Any] = [stage, attempt, status, now_ms, wf_id, pack_raw(wire)]
    if finish is not None or replica:
        args.append(finish[1] if finish is not None else "")
    if replica:
        args.append(replica)
    return script_call("emit", kk, args)


def emit_code(reply: Any) -> EmitResult:
    return code_of(EmitResult, reply, "emit")


def finish(keys: Keys, wf_id: str, stage: str, attempt: int, *, entry_id: str, outcome: str, detail: str,
           retryable: bool, now_ms: int, seq: int, downstream: Sequence[str],
           consumers: Mapping[str, Sequence[str]] | None = None, queue: str | None = None,
           priority: str = "api") -> Call:
    """The `finish.lua` call ending a session (acks its task in the stream of `queue`, the stage's
    own if None, of class `priority`; reports to the reconciler); a `done` declares the inboxes of the replicas known to
    consume its downstream stages (`consumers`)."""
    cell = keys.cell_of(wf_id)
    return script_call("finish", [keys.wf(wf_id), keys.tasks(queue or stage, cell, priority), keys.events(cell),
                                  keys.stages_legacy(wf_id), keys.log(wf_id), *(keys.edge(wf_id, stage, dst) for dst in downstream),
                                  *inbox_keys(keys, cell, consumers or {})],
                       [TASK_GROUP, entry_id, stage, attempt, outcome, detail, "1" if retryable else "0", now_ms, seq,
                        ",".join(downstream)])


def finish_code(reply: Any) -> FinishResult:
    return code_of(FinishResult, reply, "finish")
