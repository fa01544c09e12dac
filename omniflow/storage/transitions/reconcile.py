"""The reconciler's transitions: `stage_event.lua` (apply one stage report), `retry_due.lua` (a
scheduled retry whose time has come) and `dead_letter.lua` (a poison entry out of its stream)."""
from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, IntEnum
from typing import Any

from omniflow.pipeline import stage_queue
from omniflow.storage.keys import EVENT_GROUP, TASK_GROUP, FinalizePlan, Keys
from omniflow.storage.transitions._base import Call, code_of, returns, script_call

DEAD_LETTER_MAX_FIELDS = 32
DEAD_LETTER_MAX_VALUE_BYTES = 64 * 1024


@returns("stage_event")
class EventResult(str, Enum):
    IGNORED = "ignored"
    ADVANCED = "advanced"
    COMPLETED = "completed"
    RETRY = "retry"
    FAILED = "failed"


@returns("retry_due")
class RetryResult(str, Enum):
    QUEUED = "queued"
    DROPPED = "dropped"


@returns("dead_letter")
class DeadLetterResult(IntEnum):
    MOVED = 1


def stage_event_keys(keys: Keys, plan: FinalizePlan, stages: Sequence[str], wf_id: str, stage: str,
                     priority: str | None = None) -> list[str]:
    """KEYS of a `stage_event.lua` call (see its header): all of `wf_id`'s cell. `priority`: the
    workflow's class when the event said it (then only that class's task streams are declared:
    the record's class is the one a retry or a successor is queued in), else every class's."""
    wf, cell = keys.wf(wf_id), keys.cell_of(wf_id)
    streams = [keys.tasks(st, cell, priority) for st in stages] if priority else \
        [k for st in stages for k in keys.task_streams(st, cell)]
    return [wf, keys.inflight(cell), keys.retries(cell), keys.events(cell), keys.dlq(stage, cell),
            *streams, *keys.finalize_keys(wf_id, plan)]


def stage_event(keys: Keys, plan: FinalizePlan, stages: Sequence[str], wf_id: str, stage: str, kind: str,
                attempt: int, *, now_ms: int, detail: str, retryable: bool, max_attempts: int, due_ms: int,
                tombstone_ttl_s: int, result_ttl_s: int, dlq_max_len: int, task: tuple[str, bytes | str] = ("", ""),
                event_id: bytes | str = "", priority: str | None = None) -> Call:
    """A `stage_event.lua` call: `task` is the (stream, entry) a `lost` session's task is
    acknowledged in, `event_id` the event entry it applies ('' for a sweep's)."""
    stream, entry = task
    return script_call("stage_event", stage_event_keys(keys, plan, stages, wf_id, stage, priority), [
        keys.prefix, kind, stage, attempt, now_ms, detail, "1" if retryable else "0", max_attempts, due_ms,
        tombstone_ttl_s, result_ttl_s, stream, entry, TASK_GROUP if stream else "", EVENT_GROUP, event_id,
        dlq_max_len])


def event_code(reply: Any) -> EventResult:
    return code_of(EventResult, reply, "stage_event")


def retry_due(keys: Keys, wf_id: str, stage: str, attempt: int, member: str, *, version: str = "") -> Call:
    """The `retry_due.lua` call moving the scheduled retry `member` onto its stage's task stream (the
    queue of the workflow's pipeline `version`: `stage_queue`; every priority class's stream of it, the
    record names its own)."""
    cell = keys.cell_of(wf_id)
    return script_call("retry_due", [keys.wf(wf_id), keys.retries(cell), keys.stages_legacy(wf_id),
                                     *keys.task_streams(stage_queue(stage, version), cell)],
                       [keys.prefix, member, stage, attempt])


def dead_letter(dlq: str, source: str, group: str, entry_id: str | bytes, fields: dict[bytes, bytes] | None,
                reason: str, *, max_len: int) -> Call:
    """The `dead_letter.lua` call that moves one poison entry of `source` to `dlq` (both keys from
    `Keys`) with the reason (acked in `group` when one is given; deleted from `source`) in one step."""
    flat: list[Any] = []
    for k, v in list((fields or {}).items())[:DEAD_LETTER_MAX_FIELDS]:
        flat += [k, v[:DEAD_LETTER_MAX_VALUE_BYTES] if isinstance(v, (bytes, str)) else v]
    return script_call("dead_letter", [dlq, source], [group, entry_id, max_len, reason[:DEAD_LETTER_MAX_VALUE_BYTES],
                                                      *flat])
