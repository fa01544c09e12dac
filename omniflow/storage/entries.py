"""The stream entries omniflow reads, decoded and checked before use.

Anything can be written into a stream (a bug, an old version, an operator's
typo), so every field read from an entry is validated here, with bounds, and
an entry that does not pass raises `MalformedEntry`: its reader dead-letters it
with the reason and carries on. Nothing downstream of these functions sees an
unchecked value (an attempt of 2**1100 once overflowed the reconciler's backoff
and crash-looped every reconciler).
"""
from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

from omniflow.errors import MalformedEntry
from omniflow.pipeline import STAGE_NAME_PATTERN
from omniflow.models import PRIORITY_ORDER

PRIORITY_NAMES = tuple(p.value for p in PRIORITY_ORDER)

MAX_ATTEMPT = 10_000          # RetryPolicy.max_attempts is at most 100; restarts of upstream stages add some
MAX_ID_CHARS = 256
MAX_DETAIL_BYTES = 64 * 1024  # an error message or a usage document
MAX_SEQ = 1_000_000_000
MAX_INT_CHARS = 1024          # an integer field this long is not read at all (out of every bound anyway)

Fields = dict[bytes, bytes]


class EventKind(str, Enum):
    DONE = "done"
    FAILED = "failed"
    LOST = "lost"


def text(fields: Fields, name: bytes, *, max_chars: int = MAX_ID_CHARS, required: bool = True) -> str:
    """A UTF-8 field of at most `max_chars` characters (non-empty when `required`)."""
    raw = fields.get(name)
    if raw is None:
        if required:
            raise MalformedEntry(f"field {name.decode()!r} is missing")
        return ""
    if not isinstance(raw, (bytes, str)):
        raise MalformedEntry(f"field {name.decode()!r} is not a string")
    try:
        value = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:
        raise MalformedEntry(f"field {name.decode()!r} is not UTF-8") from exc
    if required and not value:
        raise MalformedEntry(f"field {name.decode()!r} is empty")
    if len(value) > max_chars:
        raise MalformedEntry(f"field {name.decode()!r} is longer than {max_chars}")
    return value


def integer(fields: Fields, name: bytes, *, low: int, high: int) -> int:
    """An integer field within [low, high]."""
    raw = text(fields, name, max_chars=MAX_INT_CHARS)
    try:
        value = int(raw)
    except ValueError as exc:
        raise MalformedEntry(f"field {name.decode()!r} is not an integer: {raw!r}") from exc
    if not low <= value <= high:
        raise MalformedEntry(f"field {name.decode()!r} = {value} is out of bounds [{low}, {high}]")
    return value


def one_of(value: str, allowed: Collection[str], what: str) -> str:
    if value not in allowed:
        raise MalformedEntry(f"{what} {value!r} is not one of {sorted(allowed)}")
    return value


@dataclass(frozen=True, slots=True)
class Task:
    """An entry of `<p>:stage:<s>@<version>:tasks`: a session to run."""

    wf_id: str
    stage: str
    attempt: int


def task(fields: Fields | None, *, stage: str) -> Task:
    """A task entry of `stage`'s stream."""
    if not fields:
        raise MalformedEntry("empty task entry")
    got = text(fields, b"s")
    if got != stage:
        raise MalformedEntry(f"task for stage {got!r} on {stage}'s stream")
    return Task(wf_id=text(fields, b"wf"), stage=stage, attempt=integer(fields, b"a", low=1, high=MAX_ATTEMPT))


def stage_name(value: str) -> str:
    """A well-formed stage name (`MalformedEntry` otherwise)."""
    if not re.match(STAGE_NAME_PATTERN, value):
        raise MalformedEntry(f"stage {value[:40]!r} is not a stage name")
    return value


@dataclass(frozen=True, slots=True)
class Event:
    """An entry of `<p>:events`: a stage report the reconciler applies."""

    kind: EventKind
    wf_id: str
    stage: str
    attempt: int
    detail: str
    retryable: bool
    task_entry: str               # 'lost' only: the task entry to acknowledge
    version: str = ""             # the workflow's pipeline version ('': not said, the default pipeline)
    priority: str = "api"         # the workflow's priority class (a 'lost' one's: of the stream that entry is in)
    classed: bool = False         # the entry said its class (field `c`; a finish's report and a 'lost' one do)


def event(fields: Fields | None, *, stages: Collection[str] | None = None) -> Event:
    """An event entry; `stages`: the stage names it may name (None: any well-formed name; the
    reconciler checks it against the stages of the event's pipeline version)."""
    if not fields:
        raise MalformedEntry("empty event entry")
    kind = EventKind(one_of(text(fields, b"t"), [k.value for k in EventKind], "event type"))
    return Event(
        kind=kind,
        wf_id=text(fields, b"wf"),
        stage=one_of(text(fields, b"s"), stages, "stage") if stages is not None else stage_name(text(fields, b"s")),
        attempt=integer(fields, b"a", low=1, high=MAX_ATTEMPT),
        detail=text(fields, b"d", max_chars=MAX_DETAIL_BYTES, required=False),
        retryable=text(fields, b"r", max_chars=1, required=False) == "1",
        task_entry=text(fields, b"e", max_chars=64, required=False),
        version=text(fields, b"p", max_chars=64, required=False),
        priority=one_of(text(fields, b"c", max_chars=16, required=False) or "api", PRIORITY_NAMES, "priority"),
        classed=bool(fields.get(b"c")),
    )


@dataclass(frozen=True, slots=True)
class InboxEntry:
    """An entry of a worker's inbox: one edge entry's chunks for one of its sessions."""

    wf_id: str
    stage: str | None             # the consuming stage (None: old entries of single-stage workers)
    attempt: int
    src: str
    packed: bytes                 # the msgpack array of chunks (decoded by the worker)


def inbox(fields: Fields | None) -> InboxEntry:
    if not fields:
        raise MalformedEntry("empty inbox entry")
    packed = fields.get(b"m")
    if not isinstance(packed, bytes):
        raise MalformedEntry("field 'm' is missing")
    return InboxEntry(wf_id=text(fields, b"wf"), stage=text(fields, b"ds", required=False) or None,
                      attempt=integer(fields, b"da", low=1, high=MAX_ATTEMPT), src=text(fields, b"src"),
                      packed=packed)


@dataclass(frozen=True, slots=True)
class Notification:
    """An entry of `<p>:notify`: a terminal workflow that asked for a webhook."""

    wf_id: str
    state: str


def notification(fields: Fields | None) -> Notification:
    if not fields:
        raise MalformedEntry("empty notify entry")
    state = one_of(text(fields, b"state"), ("completed", "failed", "aborted"), "state")
    return Notification(wf_id=text(fields, b"wf"), state=state)


def retry_member(member: str, *, stages: Collection[str] | None = None) -> tuple[str, str, int]:
    """A member of `<p>:retries` (`<id>|<stage>|<attempt>`)."""
    parts = member.rsplit("|", 2)
    if len(parts) != 3 or not parts[0] or len(parts[0]) > MAX_ID_CHARS:
        raise MalformedEntry(f"retry member {member[:80]!r} is not '<id>|<stage>|<attempt>'")
    wf_id, stage, raw = parts
    if stages is None:
        stage_name(stage)
    else:
        one_of(stage, stages, "stage")
    try:
        attempt = int(raw)
    except ValueError as exc:
        raise MalformedEntry(f"retry member {member[:80]!r}: attempt is not an integer") from exc
    if not 1 <= attempt <= MAX_ATTEMPT:
        raise MalformedEntry(f"retry member {member[:80]!r}: attempt out of bounds")
    return wf_id, stage, attempt
