"""The schema of what omniflow keeps in Redis: the field names of a workflow's stages (`StageField`,
kept in its record beside the record's own fields, `RecordField`) and the decoding every reader of
records, stage fields and stream entries shares (replies are bytes; lists are comma-separated; times
are epoch ms).

The Lua scripts write the same names (`omniflow/storage/lua/`); nothing else in Python spells them.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgpack


def now_ms() -> int:
    """The wall clock in epoch milliseconds, as every record and log entry keeps time."""
    return int(time.time() * 1000)


class ThreadPacker(threading.local):
    """`msgpack.packb(obj, **options)` with a reused `msgpack.Packer`, one per thread (`pack`).

    `packb` builds a Packer per call, its 256 KiB buffer allocated and freed each time: 0.67 µs
    against 0.33 (this `pack`) for a small step here, and a worker packs ~22 times per workflow (each chunk's
    fields, each call's steps and its finish, each inline payload). One per thread: steps are
    packed on the executors' compute threads too. A Packer resets itself when a `pack` raises; one
    whose buffer grew past `KEEP_BYTES` (a large payload) is replaced, so a thread does not keep it.
    Not for a `default` hook that packs with this same object (the codec's hooks call `packb`)."""

    KEEP_BYTES = 1 << 20

    def __init__(self, **options: Any) -> None:      # (run again in each thread that uses it)
        self.options = options
        self.packer = msgpack.Packer(**options)

    def pack(self, obj: Any) -> bytes:
        out: bytes = self.packer.pack(obj)
        if len(out) > self.KEEP_BYTES:
            self.packer = msgpack.Packer(**self.options)
        return out


#: `msgpack.packb(obj, use_bin_type=False)` (what the scripts' cmsgpack unpacks: strings raw)
pack_raw = ThreadPacker(use_bin_type=False).pack


def s(value: Any) -> str:
    """bytes -> str (replies are bytes); None -> ''."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def text_fields(raw: Mapping[Any, Any] | None) -> dict[str, str]:
    """A hash as Redis returns it (bytes -> bytes) as text: `{s(k): s(v)}`, with the bytes decoded by
    their own method (a record is ~56 fields: two Python calls each were 114 of the burst client's
    901 Python calls per workflow, bench/notes.md round 20). A client that decodes (str) or a None
    value takes `s`'s way; bytes that are not UTF-8 raise as `s` does."""
    if not raw:
        return {}
    try:
        return {k.decode(): v.decode() for k, v in raw.items()}
    except AttributeError:
        return {s(k): s(v) for k, v in raw.items()}


def csv(value: Any) -> list[str]:
    """A comma-separated field (stage sets, finals) -> its items."""
    return [x for x in s(value).split(",") if x]


def decode_fields(fields: dict[bytes, bytes]) -> dict[str, str]:
    """A log entry's fields as text (binary payload fields left out)."""
    return {s(k): s(v) for k, v in fields.items() if k not in (b"pcm", b"d")}


#: a log entry's field holding its further events (`flush_log` in _lib.lua: one entry per script call)
LOG_MORE = b"more"


def _raw(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def log_events_raw(fields: dict[bytes, bytes]) -> list[dict[bytes, bytes]]:
    """The events of one log entry, names and values as bytes: the entry's own fields, then each one
    its `more` field holds (a script call that logs several events of a workflow writes one entry).
    A `more` that does not decode is one event of kind `malformed`."""
    more = fields.get(LOG_MORE)
    if more is None:
        return [fields]
    events = [{k: v for k, v in fields.items() if k != LOG_MORE}]
    try:
        for flat in msgpack.unpackb(more, raw=True):
            events.append({_raw(k): _raw(v) for k, v in zip(flat[::2], flat[1::2])})
    except (ValueError, TypeError, msgpack.UnpackException):
        events.append({b"t": b"malformed"})
    return events


def log_events(entry_id: str, fields: dict[bytes, bytes]) -> list[tuple[str, dict[str, str]]]:
    """The events of one log entry, decoded, each with its id: the entry's id for its first event,
    `<entry id>.<k>` for the k-th one after it (what SSE sends as `id` and takes back as `Last-Event-ID`)."""
    return [(entry_id if k == 0 else f"{entry_id}.{k}", decode_fields(event))
            for k, event in enumerate(log_events_raw(fields))]


def event_position(event_id: str) -> tuple[int, int, int]:
    """An event id -> (ms, seq, k): its entry's stream id and its place in the entry (ValueError if it is
    none: `1700000000000-3`, `1700000000000-3.1`; a bare ms time counts as seq 0)."""
    entry, _, k = event_id.partition(".")
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0), int(k or 0)


class StageField:
    """Field names of a workflow's stages (in its record: `Keys.stages`): one group per stage, named after it.

    The stage's own field (`status`, the stage's name) holds its `StageStatus`."""

    @staticmethod
    def status(stage: str) -> str:
        return stage

    @staticmethod
    def attempt(stage: str) -> str:
        return f"{stage}:attempt"

    @staticmethod
    def seq(stage: str) -> str:
        """How many output steps the current attempt has stored."""
        return f"{stage}:seq"

    @staticmethod
    def replica(stage: str) -> str:
        """The worker the current attempt is bound to."""
        return f"{stage}:replica"

    @staticmethod
    def checkpoint(stage: str) -> str:
        return f"{stage}:ckpt"

    @staticmethod
    def text(stage: str) -> str:
        """A final text stage's output so far (a record with `RecordField.KEY_OUTPUTS`; else `Keys.out`)."""
        return f"{stage}:text"

    @staticmethod
    def sample_rate(stage: str) -> str:
        return f"{stage}:sr"

    @staticmethod
    def samples(stage: str) -> str:
        return f"{stage}:samples"

    @staticmethod
    def usage(stage: str) -> str:
        return f"{stage}:usage"

    @staticmethod
    def error(stage: str) -> str:
        return f"{stage}:error"

    @staticmethod
    def compute_ms(stage: str) -> str:
        return f"{stage}:compute_ms"

    @staticmethod
    def time(stage: str, event: str) -> str:
        """When the stage was submitted, started or ended (`event`: submit, start, end), epoch ms."""
        return f"{stage}:t_{event}"

    @staticmethod
    def read_pos(dst: str, src: str) -> str:
        """How far the consuming stage `dst` has read the output of `src` (backpressure)."""
        return f"{dst}:rd:{src}"


class StatsField:
    """Field names of the deployment's counters (`Keys.stats`)."""

    WEBHOOK_PREFIX = "webhook:"

    @staticmethod
    def webhook(outcome: str) -> str:
        """Webhook deliveries that ended with `outcome`."""
        return f"{StatsField.WEBHOOK_PREFIX}{outcome}"

    @staticmethod
    def webhook_outcome(field: str) -> str | None:
        """The outcome a `webhook` field counts; None for another field."""
        return field.removeprefix(StatsField.WEBHOOK_PREFIX) if field.startswith(StatsField.WEBHOOK_PREFIX) else None


def _int(value: str | None) -> int:
    return int(value or 0)


def _seconds(ms: str | None) -> float | None:
    """An epoch-ms field as epoch seconds; None when absent."""
    return int(ms) / 1000 if ms else None


@dataclass(frozen=True, slots=True)
class StageRecord:
    """One stage of a workflow, decoded from its stage hash (`StageField` names)."""

    name: str
    status: str
    attempt: int
    replica: str | None
    seq: int                    # output steps the current attempt stored
    submitted_at: float | None  # epoch seconds
    started_at: float | None
    finished_at: float | None
    usage: Any                  # the executor's usage (JSON), None before it is done
    error: str | None
    sample_rate: int
    samples: int
    compute_ms: int

    @classmethod
    def decode(cls, name: str, st: dict[str, str]) -> StageRecord:
        """Stage `name` of the decoded stage hash `st`."""
        (f_status, f_attempt, f_replica, f_seq, f_submit, f_start, f_end, f_usage, f_error, f_sr, f_samples,
         f_compute) = _stage_record_fields(name)
        g = st.get
        raw_usage = g(f_usage)
        return cls(
            name=name, status=g(f_status, "pending"), attempt=_int(g(f_attempt)),
            replica=g(f_replica) or None, seq=_int(g(f_seq)),
            submitted_at=_seconds(g(f_submit)), started_at=_seconds(g(f_start)), finished_at=_seconds(g(f_end)),
            usage=json.loads(raw_usage) if raw_usage else None, error=g(f_error) or None,
            sample_rate=_int(g(f_sr)), samples=_int(g(f_samples)), compute_ms=_int(g(f_compute)))


@lru_cache(maxsize=1024)
def _stage_record_fields(name: str) -> tuple[str, ...]:
    """The stage fields `StageRecord.decode` reads, in its order (made once per stage name: a
    workflow document decodes every stage)."""
    return (StageField.status(name), StageField.attempt(name), StageField.replica(name), StageField.seq(name),
            StageField.time(name, "submit"), StageField.time(name, "start"), StageField.time(name, "end"),
            StageField.usage(name), StageField.error(name), StageField.sample_rate(name), StageField.samples(name),
            StageField.compute_ms(name))


class RecordField:
    """Field names of a workflow's record (`Keys.wf`), written by `submit.lua` and the transitions."""

    ID = "id"
    STATE = "state"
    TENANT = "tenant"
    REQUEST_ID = "request_id"
    INPUT = "input"
    PARAMS = "params"
    WEBHOOK = "webhook"
    PIPELINE = "pipeline"
    PIPELINE_HASH = "pipeline_hash"   # the version of the pipeline it runs on (its content hash)
    STAGES = "stages"           # csv: the plan's stages
    FINALS = "finals"           # csv: its final stages
    KINDS = "kinds"             # csv of `<final stage>=<text|audio>`
    CREATED_MS = "created_ms"
    FINISHED_MS = "finished_ms"
    DEADLINE_MS = "deadline_ms"
    ERROR = "error"
    ERROR_STAGE = "error_stage"
    BODY_HASH = "body_hash"
    PRIORITY = "prio"           # its priority class (omniflow.models.Priority; none: api)
    DEGRADED = "degraded"       # why deadline-aware shedding degraded it ('' or none: it was not)
    DROPPED = "dropped"         # csv: the outputs shedding dropped
    TENANT_COUNTED = "tf"       # '1': counted in its cell's live workflows per tenant (fair share)
    STAGES_IN_RECORD = "sl"     # '1': its stage fields (`StageField`) are in the record (`Keys.stages`)
    KEY_OUTPUTS = "ko"          # csv: the finals whose outputs are keys (`Keys.out`: audio); present: the
                                # text finals' outputs are their `StageField.text` fields in the record


def texts_in_record(record: dict[str, str]) -> bool:
    """Whether a (decoded) record holds its final text outputs (`StageField.text`, storage layout 3:
    `ko` is there); a workflow submitted before keeps each in its `Keys.out` key."""
    return RecordField.KEY_OUTPUTS in record


def stages_in_record(record: dict[str, str]) -> bool:
    """Whether a (decoded) record holds its workflow's stage fields (`sl`); a workflow submitted
    before they moved there keeps them in `Keys.stages_legacy`."""
    return record.get(RecordField.STAGES_IN_RECORD) == "1"


#: Every field a workflow's record may hold besides its stage fields: RecordField's and those only the
#: scripts and the submit write. The stage fields share the record (`Keys.stages`), and each stage's
#: status field is the stage's own name: a stage may not be named like one of these
#: (omniflow.pipeline refuses it). A new record field is added here (tests/test_layout.py checks
#: the records a whole run writes); the others of a stage contain ':' and never meet a record field.
RECORD_FIELD_NAMES = frozenset(
    {v for k, v in vars(RecordField).items() if k.isupper()}
    | {"updated_ms", "finished", "gsub", "groups", "edges", "blobs", "trace", "tracestate"})


@dataclass(frozen=True, slots=True)
class WorkflowRecord:
    """A workflow's record, decoded (what the document, the listing and a retry read)."""

    id: str
    state: str
    tenant: str
    request_id: str
    input: str                  # the request's input, JSON
    params: str                 # the stages' params, JSON
    webhook: str
    pipeline: str
    pipeline_version: str       # its content hash (`Pipeline.digest`); '' for a record of before versions
    stages: list[str]
    finals: list[str]
    kinds: dict[str, str]       # final stage -> `text` or `audio`
    created_ms: int
    finished_ms: int | None
    deadline_ms: int
    error: str
    error_stage: str
    priority: str = "api"       # its priority class ('api' when it has none)

    @classmethod
    def decode(cls, wf_id: str, rec: dict[str, str]) -> WorkflowRecord:
        """The record of `wf_id` from its decoded hash (absent fields read as empty)."""
        g = rec.get
        return cls(
            id=g(RecordField.ID) or wf_id, state=g(RecordField.STATE) or "", tenant=g(RecordField.TENANT) or "",
            request_id=g(RecordField.REQUEST_ID) or "", input=g(RecordField.INPUT) or "",
            params=g(RecordField.PARAMS) or "", webhook=g(RecordField.WEBHOOK) or "",
            pipeline=g(RecordField.PIPELINE) or "", pipeline_version=g(RecordField.PIPELINE_HASH) or "",
            stages=csv(g(RecordField.STAGES)),
            finals=csv(g(RecordField.FINALS)),
            kinds=dict(x.split("=", 1) for x in csv(g(RecordField.KINDS))),
            created_ms=_int(g(RecordField.CREATED_MS)),
            finished_ms=int(g(RecordField.FINISHED_MS) or 0) or None, deadline_ms=_int(g(RecordField.DEADLINE_MS)),
            error=g(RecordField.ERROR) or "", error_stage=g(RecordField.ERROR_STAGE) or "",
            priority=g(RecordField.PRIORITY) or "api")

    @classmethod
    def decode_raw(cls, wf_id: str, raw: dict[Any, Any]) -> WorkflowRecord:
        """From the hash as Redis returns it (bytes)."""
        return cls.decode(wf_id, text_fields(raw))
