"""The data-plane interface: where a chunk's payload lives, and the reference that says so.

A producer `put`s a payload and gets a `Ref`; the ref (or, for the inline transport, the
encoded payload itself) goes into the durable edge-log entry. A consumer `get`s the payload
back from the ref; it `release`s the refs it consumed when its session is done. What a ref
points at has an owner (the workflow; shared-memory segments also name the producing worker)
and a TTL, so nothing outlives its workflow by more than that.

Errors (all `StageError`s: they fail the consuming session, which is retried per its policy):

    DataPlaneError             a chunk's payload cannot be delivered
    ├── PayloadMissing         the key or segment is gone (released, expired, swept); retryable
    │   └── PayloadTruncated   the segment or arena is shorter than the payload it held: cut short,
    │                          its bytes are lost as if it were gone; retryable
    ├── WrongHost              the segment is in another host's shared memory; retryable
    ├── InputLost              either of the two above, met by a consuming session: its producer
    │                          stage is run again (`restart.lua`, regenerate) instead
    ├── SharedMemoryRefused    this host's shared memory cannot take a payload now (full: ENOSPC, or
    │                          the write failed); the data plane puts it in a Redis key instead
    └── BadReference           the reference or what it points at is not ours or not sound
        ├── ForeignReference   outside our namespace (path, prefix, workflow)
        ├── SizeMismatch       the segment or key is not the size the reference says
        ├── ChecksumMismatch   the checksum in the reference does not match the payload
        └── UndecodablePayload the payload does not decode (bad header, dtype, shape, offsets)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

from omniflow.errors import StageError


class DataPlaneError(StageError):
    """A chunk's payload cannot be delivered; the consuming session fails with this reason."""


class PayloadMissing(DataPlaneError):
    """The key or segment a reference names is gone (released, expired or swept)."""


class PayloadTruncated(PayloadMissing):
    """The segment or arena holding a payload is shorter than that payload (truncated under its
    reference: what was cut off is lost, as when the file is gone; its producer can write it again).
    Told apart from a reference that lies about the size by the frame header still in the file."""


class SharedMemoryRefused(DataPlaneError):
    """This host's shared memory cannot take a payload now: the directory is full (ENOSPC, no room
    for an arena's pages or a segment) or the write failed. Nothing of it is left behind; the data
    plane (`DataPlane.prepare`, `put`, `put_op`) puts the payload in a Redis key instead."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class WrongHost(DataPlaneError):
    """The segment lives in another host's shared memory (a replica there may read it)."""


class InputLost(DataPlaneError):
    """A consuming session cannot read its producer's chunk `seq` from stage `src` here (the payload
    is gone, or in the shared memory of a host this one cannot map: the producer's host died, or
    this retry landed elsewhere). Retrying the consumer cannot help; running `src` again can."""

    def __init__(self, message: str, *, src: str, seq: int) -> None:
        super().__init__(message)
        self.src, self.seq = src, seq


class BadReference(DataPlaneError):
    """The reference, or what it points at, is not sound; retrying cannot fix it."""

    retryable = False


class ForeignReference(BadReference):
    """The reference points outside our namespace (another path, prefix or workflow)."""


class SizeMismatch(BadReference):
    """The segment or key does not have the size the reference says."""


class ChecksumMismatch(BadReference):
    """The checksum the reference carries does not match the payload."""


class UndecodablePayload(BadReference):
    """The payload does not decode: bad header, dtype, shape or offsets."""


class TransportKind(str, Enum):
    """Where a payload travels. The codes are what a packed reference carries."""

    INLINE = "inline"
    REDIS = "redis"
    SHM = "shm"

    @property
    def code(self) -> int:
        return _CODES[self]


_CODES = {TransportKind.INLINE: 0, TransportKind.REDIS: 1, TransportKind.SHM: 2}
_KINDS = {code: kind for kind, code in _CODES.items()}


@dataclass(frozen=True, slots=True)
class PutContext:
    """Who puts a payload and for whom: the owner and name of what `put` creates."""

    prefix: str
    wf_id: str
    src: str                 # producing stage
    dst: str                 # consuming stage
    attempt: int             # the producer's attempt
    seq: int                 # the step
    worker_id: str = ""      # the producing worker (shared-memory segments are attributed to it)
    ttl_s: float = 3900.0    # at least the workflow deadline: a retry may replay the chunk until then


@dataclass(frozen=True, slots=True)
class Ref:
    """A payload reference small enough for a stream entry.

    `location` is the Redis key, the shared-memory segment or the arena's name; `nbytes` its exact
    size; `checksum` the CRC32 of the payload header (or of all of it); `host` the shared-memory
    domain of a segment (empty for Redis); in an arena, `slot` and the generation `gen` of the payload
    it holds there (-1 and 0 otherwise). An inline ref carries the encoded payload in `data`.
    """

    kind: TransportKind
    location: str = ""
    nbytes: int = 0
    checksum: int = 0
    host: str = ""
    data: bytes = b""
    slot: int = -1
    gen: int = 0

    def pack(self) -> bytes:
        """The reference as it is stored in an edge entry (msgpack; inline refs: the payload)."""
        if self.kind is TransportKind.INLINE:
            return self.data
        fields: list[Any] = [self.kind.code, self.location, self.nbytes, self.checksum, self.host]
        if self.slot >= 0:
            fields += [self.slot, self.gen]
        packed: bytes = msgpack.packb(fields)
        return packed

    @classmethod
    def unpack(cls, raw: bytes) -> Ref:
        """Parse a packed (non-inline) reference; refuse anything that is not one."""
        try:
            fields = msgpack.unpackb(raw, raw=False)
            code, location, nbytes, checksum, host = fields[:5]
            slot, gen = fields[5:] if len(fields) == 7 else (-1, 0)
            if len(fields) not in (5, 7):
                raise ValueError(f"{len(fields)} fields")
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
            raise UndecodablePayload(f"not a payload reference: {exc}") from exc
        kind = _KINDS.get(code) if isinstance(code, int) else None
        if kind is None or kind is TransportKind.INLINE:
            raise UndecodablePayload(f"not a payload reference: unknown transport {code!r}")
        if not (isinstance(location, str) and isinstance(host, str) and isinstance(nbytes, int)
                and isinstance(checksum, int) and nbytes >= 0 and isinstance(slot, int) and isinstance(gen, int)
                and slot >= -1 and gen >= 0):
            raise UndecodablePayload("not a payload reference: fields of the wrong type")
        return cls(kind, location, nbytes, checksum, host, slot=slot, gen=gen)


class Transport(ABC):
    """One way to move payloads. Implementations: inline, Redis key, shared memory."""

    kind: TransportKind

    @abstractmethod
    async def put(self, payload: Any, ctx: PutContext) -> Ref:
        """Store `payload` for the consumer named in `ctx`; returns the reference for the entry."""

    @abstractmethod
    async def get(self, ref: Ref, *, wf_id: str | None = None) -> Any:
        """The payload `ref` points at (refused with a `DataPlaneError` when it cannot be trusted).

        With `wf_id`, a reference to anything that is not that workflow's is refused."""

    async def release(self, refs: Sequence[Ref]) -> int:
        """Free what `refs` point at (gone already is fine); returns how many were freed."""
        return 0

    async def release_workflow(self, wf_id: str) -> int:
        """Free everything this transport holds for one workflow; returns how many."""
        return 0
