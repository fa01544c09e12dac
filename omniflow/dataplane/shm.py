"""Shared-memory transport: the payload in a segment under /dev/shm, the entry holds a reference.

For large payloads whose consumer runs on the producer's host. The producer writes the frame
into a new segment with one `writev` (the one copy: from the array's memory into the segment);
the consumer maps the segment copy-on-write and gets numpy arrays / torch tensors that are views
of it (no copy; writable, and a write never reaches the segment).

Segment names attribute every segment to its owner, so any process on the host can release
or sweep them (`of-<prefix>-<worker>-<wf>-<src>.<dst>-<attempt>.<seq>`; each part reduced to
`[A-Za-z0-9_]`); the frame header repeats the owner exactly and holds the expiry. A segment
lives until its consumer's session is done, its workflow ends (terminal) or its TTL passes; a
producer that dies leaves its segments to the sweep (`sweep`), which frees those of ended
workflows, expired ones and half-written ones of dead workers. A live workflow's segments stay
even when their producer died: its consumers (and their retries) replay them.

A reference names the host's shared-memory domain (`shm_domain`): a consumer elsewhere gets
`WrongHost` (retryable) instead of reading another host's segment of the same name.
"""
from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from omniflow.dataplane import codec
from omniflow.dataplane.base import (
    ForeignReference, PayloadMissing, PutContext, Ref, SizeMismatch, Transport, TransportKind, UndecodablePayload,
    WrongHost,
)

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = Path("/dev/shm")
NAMESPACE = "of"                 # every segment name starts with "of-<prefix>-"
THREAD_MIN_BYTES = 4 << 20       # segments this large are written off the event loop
_PART = re.compile(r"[^A-Za-z0-9_]")
_NAME = re.compile(r"^of-(?P<prefix>\w+)-(?P<worker>\w+)-(?P<wf>\w+)-(?P<src>\w+)\.(?P<dst>\w+)"
                   r"-(?P<attempt>\d{1,9})\.(?P<seq>\d{1,12})$", re.ASCII)
_IOV_MAX = 1024
# A segment starts with a control block the frame's checksum does not cover: magic and a state word.
# A consumer that is done with a segment (its session ended and no view of it is left) sets the state
# to FREE instead of unlinking it; its producer recycles it for a later chunk (rename + overwrite): the
# pages stay allocated and mapped, which is most of what a new segment costs (see docs/benchmarks.md).
CONTROL = struct.Struct("<4sII")     # magic, state, 1 if a producer pools it
CONTROL_BYTES = 64
SEG_MAGIC = b"OFSG"
STATE_IN_USE, STATE_FREE = 0, 1
CAPACITY_STEP = 64 << 10            # pooled segments are sized in these steps
DEFAULT_POOL_BYTES = 256 << 20


def name_part(value: str) -> str:
    """One part of a segment name: `[A-Za-z0-9_]`, at most 64 characters, never empty."""
    return _PART.sub("_", value)[:64] or "_"


def segment_name(ctx: PutContext) -> str:
    return (f"{NAMESPACE}-{name_part(ctx.prefix)}-{name_part(ctx.worker_id)}-{name_part(ctx.wf_id)}-"
            f"{name_part(ctx.src)}.{name_part(ctx.dst)}-{int(ctx.attempt)}.{int(ctx.seq)}")


@dataclass(frozen=True, slots=True)
class Segment:
    """A segment of ours found in the shared-memory directory, as its name attributes it."""

    name: str
    prefix: str
    worker: str
    wf_id: str
    src: str
    dst: str
    attempt: int
    seq: int


def parse_name(name: str) -> Segment | None:
    """The owner parts of a segment name, or None if it is not one of ours."""
    m = _NAME.match(name)
    if m is None:
        return None
    return Segment(name, m["prefix"], m["worker"], m["wf"], m["src"], m["dst"], int(m["attempt"]), int(m["seq"]))


def shm_domain(directory: Path = DEFAULT_SHM_DIR, host_id: str | None = None) -> str:
    """Who can read this host's segments: the host id (`OMNIFLOW_HOST_ID`, default the host name),
    boot id and the device of the shm mount (two containers on one machine with their own /dev/shm
    get different domains; two "hosts" given different ids never share memory)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "noboot"
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        dev = 0
    return f"{host_id or socket.gethostname()}:{boot}:{dev}"


def shm_available(directory: Path = DEFAULT_SHM_DIR) -> bool:
    """True where segments can be created (a writable tmpfs directory, e.g. Linux /dev/shm)."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


def _writev_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


class SweepReason(str, Enum):
    """Why the sweep freed a segment."""

    EXPIRED = "expired"          # past its TTL (from its header)
    ENDED = "ended"              # its workflow is terminal or gone
    ORPHAN = "orphan"            # half-written or handed back for recycling, and its worker is dead


@dataclass(frozen=True, slots=True)
class Found:
    """A segment of ours and what its header says (None: no readable header, e.g. half-written)."""

    segment: Segment
    info: codec.FrameInfo | None
    free: bool = False           # its consumer handed it back and it waits for its producer to recycle it

    @property
    def wf_id(self) -> str:
        """The exact workflow id (from the header; the name holds a reduced form)."""
        owner = self.info.owner if self.info else []
        return str(owner[0]) if owner else self.segment.wf_id


def sweep_verdict(found: Found, *, now_ms: int, live_wfs: set[str] | None,
                  live_workers: set[str] | None) -> SweepReason | None:
    """Whether the sweep frees one segment (a pure function). `live_wfs` None: unknown (not tested);
    `live_workers` None: unknown. A live workflow's segment stays even when its producer died: the
    consumer, or its retry, replays it from the edge log."""
    if found.info is not None and found.info.expiry_ms <= now_ms:
        return SweepReason.EXPIRED
    if live_wfs is not None and found.wf_id not in live_wfs:
        return SweepReason.ENDED
    # half-written, or handed back for recycling, by a producer that is gone: nobody will finish or reuse it
    if (found.info is None or found.free) and live_workers is not None and \
            found.segment.worker not in {name_part(w) for w in live_workers}:
        return SweepReason.ORPHAN
    return None


@dataclass(slots=True)
class _Pooled:
    """A segment this producer created and keeps mapped, to recycle once its consumer frees it."""

    name: str
    capacity: int
    mm: mmap.mmap

    def free(self) -> bool:
        return bool(CONTROL.unpack_from(self.mm)[1] == STATE_FREE)


class SegmentPool:
    """A producer's segments, recycled when their consumers are done: no page allocation, mapping or
    freeing per chunk. Bounded by `limit_bytes` of segment capacity; past it, segments are plain."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.items: list[_Pooled] = []
        self.bytes = 0
        self._lock = threading.Lock()        # put_sync may run on compute threads

    def take(self, need: int) -> _Pooled | None:
        """A free segment of at least `need` bytes (and at most twice that), removed from the pool."""
        with self._lock:
            for i, item in enumerate(self.items):
                if need <= item.capacity <= 2 * need + CAPACITY_STEP and item.free():
                    return self.items.pop(i)
        return None

    def room_for(self, capacity: int) -> bool:
        return self.bytes + capacity <= self.limit_bytes

    def add(self, item: _Pooled, *, new: bool) -> None:
        with self._lock:
            self.items.append(item)
            if new:
                self.bytes += item.capacity

    def drop(self, item: _Pooled) -> None:
        with self._lock:
            self.bytes -= item.capacity
        item.mm.close()

    def close(self, directory: Path) -> int:
        """Unmap everything; unlink the segments no consumer needs any more (FREE). Returns how many."""
        with self._lock:
            items, self.items, self.bytes = self.items, [], 0
        freed = 0
        for item in items:
            if item.free():
                with _suppress_missing():
                    os.unlink(os.path.join(directory, item.name))
                    freed += 1
            item.mm.close()
        return freed


class _suppress_missing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: Any) -> bool:
        return kind is not None and issubclass(kind, FileNotFoundError)


class ShmTransport(Transport):
    """Payload frames in shared-memory segments of this host."""

    kind = TransportKind.SHM

    def __init__(self, prefix: str, *, directory: Path = DEFAULT_SHM_DIR, full_checksum: bool = False,
                 domain: str | None = None, pool_bytes: int = DEFAULT_POOL_BYTES) -> None:
        self.prefix = prefix
        self.directory = Path(directory)
        self.full_checksum = full_checksum
        self.domain = domain or shm_domain(self.directory)
        self.pool = SegmentPool(pool_bytes) if pool_bytes > 0 else None
        self._mine = f"{NAMESPACE}-{name_part(prefix)}-"
        # consumer side: how many live mappings each segment we read has, and which we were told to release
        self._mapped: dict[str, int] = {}
        self._released: set[str] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------ put / get
    def put_sync(self, payload: Any, ctx: PutContext) -> Ref:
        """`put` without the event loop (for a compute thread)."""
        frame = codec.encode_frame(payload, owner=[ctx.wf_id, ctx.src, ctx.dst, ctx.attempt, ctx.seq, ctx.worker_id],
                                   expiry_ms=int((time.time() + ctx.ttl_s) * 1000), full_checksum=self.full_checksum)
        name = segment_name(ctx)
        if not self._recycle(name, frame):
            self._write(name, frame)
        return Ref(TransportKind.SHM, name, frame.nbytes, frame.checksum, self.domain)

    def _recycle(self, name: str, frame: codec.Frame) -> bool:
        """Write `frame` into a free pooled segment renamed to `name`; False if there is none."""
        if self.pool is None:
            return False
        while (item := self.pool.take(CONTROL_BYTES + frame.nbytes)) is not None:
            try:
                # atomic; replaces a segment of the same name (a repeated put of this very step)
                os.rename(os.path.join(self.directory, item.name), os.path.join(self.directory, name))
            except FileNotFoundError:        # swept meanwhile (its workflow ended): forget it
                self.pool.drop(item)
                continue
            item.name = name
            pos = CONTROL_BYTES
            for part in frame.parts():
                n = len(part) if isinstance(part, bytes) else part.nbytes
                item.mm[pos:pos + n] = part
                pos += n
            CONTROL.pack_into(item.mm, 0, SEG_MAGIC, STATE_IN_USE, 1)
            self.pool.add(item, new=False)
            return True
        return False

    def _write(self, name: str, frame: codec.Frame) -> None:
        path = os.path.join(self.directory, name)
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            # this very step of this attempt was put before (a repeated emit): the new one replaces it;
            # a reader of the old one keeps its mapping
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
        capacity = -(-(CONTROL_BYTES + frame.nbytes) // CAPACITY_STEP) * CAPACITY_STEP
        pooled = self.pool is not None and self.pool.room_for(capacity)
        control = CONTROL.pack(SEG_MAGIC, STATE_IN_USE, int(pooled)).ljust(CONTROL_BYTES, b"\0")
        try:
            _writev_all(fd, [control, *frame.parts()])
            if self.pool is not None and pooled:
                os.ftruncate(fd, capacity)
                self.pool.add(_Pooled(name, capacity, mmap.mmap(fd, capacity)), new=True)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    async def put(self, payload: Any, ctx: PutContext) -> Ref:
        if codec.payload_nbytes(payload, THREAD_MIN_BYTES) >= THREAD_MIN_BYTES:
            return await asyncio.to_thread(self.put_sync, payload, ctx)
        return self.put_sync(payload, ctx)

    def check(self, ref: Ref, wf_id: str | None) -> Segment:
        """Refuse a name that is not a segment of ours (prefix, and workflow `wf_id` if given)."""
        seg = parse_name(ref.location)
        if seg is None or not ref.location.startswith(self._mine):
            raise ForeignReference(f"segment {ref.location!r} is outside our namespace {self._mine}*")
        if wf_id is not None and seg.wf_id != name_part(wf_id):
            raise ForeignReference(f"segment {ref.location!r} belongs to another workflow than {wf_id}")
        return seg

    def get_sync(self, ref: Ref, *, wf_id: str | None = None) -> Any:
        """`get` without the event loop."""
        self.check(ref, wf_id)
        if ref.host != self.domain:
            raise WrongHost(f"segment {ref.location} is in the shared memory of {ref.host}, not of {self.domain}")
        try:
            fd = os.open(os.path.join(self.directory, ref.location), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PayloadMissing(f"segment {ref.location} is gone (released, expired or swept)") from None
        try:
            size = os.fstat(fd).st_size
            if size < CONTROL_BYTES + ref.nbytes:
                raise SizeMismatch(f"segment {ref.location} is {size} bytes, too small for the "
                                   f"{ref.nbytes}-byte payload the reference says")
            # copy-on-write: the arrays are writable views; a write stays private to this process
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        if mm[:4] != SEG_MAGIC:
            raise UndecodablePayload(f"segment {ref.location} is not an omniflow segment")
        payload = codec.decode_frame(memoryview(mm)[CONTROL_BYTES:CONTROL_BYTES + ref.nbytes], nbytes=ref.nbytes,
                                     checksum=ref.checksum, what=f"segment {ref.location}")
        with self._lock:
            self._mapped[ref.location] = self._mapped.get(ref.location, 0) + 1
        # the producer may recycle the segment once we released it AND no view of it is left here
        weakref.finalize(mm, self._unmapped, ref.location)
        return payload

    async def get(self, ref: Ref, *, wf_id: str | None = None) -> Any:
        return self.get_sync(ref, wf_id=wf_id)

    # ------------------------------------------------------------ ownership
    def _unlink(self, name: str) -> bool:
        try:
            os.unlink(os.path.join(self.directory, name))
            return True
        except FileNotFoundError:
            return False

    async def release(self, refs: Sequence[Ref]) -> int:
        """The consumer is done with these segments: each is handed back to its producer (state FREE)
        as soon as no view of it is left in this process; unlinked if it cannot be recycled."""
        freed = 0
        for ref in refs:
            if ref.kind is TransportKind.SHM and ref.host == self.domain:
                self.check(ref, None)          # never touch a path a reference smuggled in
                with self._lock:
                    if ref.location in self._released:
                        continue
                    self._released.add(ref.location)
                    mapped = self._mapped.get(ref.location, 0)
                if not mapped:
                    freed += self._hand_back(ref.location)
        return freed

    def _unmapped(self, name: str) -> None:
        with self._lock:
            left = self._mapped.get(name, 1) - 1
            if left > 0:
                self._mapped[name] = left
                return
            self._mapped.pop(name, None)
            if name not in self._released:
                return
        self._hand_back(name)

    def _hand_back(self, name: str) -> int:
        """Mark a released segment FREE for its producer to recycle (by name: a segment renamed for a
        newer chunk is left alone); one that is not poolable is unlinked."""
        with self._lock:
            self._released.discard(name)
        try:
            fd = os.open(os.path.join(self.directory, name), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        try:
            raw = os.pread(fd, CONTROL.size, 0)
            if len(raw) == CONTROL.size and CONTROL.unpack(raw)[0] == SEG_MAGIC and CONTROL.unpack(raw)[2] == 1:
                os.pwrite(fd, struct.pack("<I", STATE_FREE), 4)
                return 1
        finally:
            os.close(fd)
        return self._unlink(name)

    def segments(self) -> Iterator[Segment]:
        """Our segments (this prefix) in the shared-memory directory."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.startswith(self._mine):
                seg = parse_name(entry.name)
                if seg is not None:
                    yield seg

    async def release_workflow(self, wf_id: str) -> int:
        part = name_part(wf_id)
        return sum(self._unlink(seg.name) for seg in self.segments() if seg.wf_id == part)

    def release_all(self) -> int:
        """Free every segment of this prefix (tests, `omniflow purge`)."""
        if self.pool is not None:
            self.pool.close(self.directory)
        return sum(self._unlink(seg.name) for seg in self.segments())

    def close(self) -> int:
        """At shutdown: unmap the pool, unlink its free segments (the others may still be read)."""
        return self.pool.close(self.directory) if self.pool is not None else 0

    def read_header(self, name: str) -> codec.FrameInfo | None:
        """A segment's owner and expiry from its header; None if it has none readable (half-written)."""
        try:
            fd = os.open(os.path.join(self.directory, name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            prelude = os.pread(fd, codec.PRELUDE.size, CONTROL_BYTES)
            header_len = codec.read_prelude(prelude)[1]
            return codec.frame_info(prelude + os.pread(fd, header_len, CONTROL_BYTES + codec.PRELUDE.size))
        except UndecodablePayload:
            return None
        finally:
            os.close(fd)

    def inventory(self) -> list[Found]:
        """Every segment of this prefix with its header: what `sweep` decides on."""
        return [Found(seg, self.read_header(seg.name), self.is_free(seg.name)) for seg in self.segments()]

    def is_free(self, name: str) -> bool:
        """True when the segment's consumer handed it back (state FREE) for its producer to recycle."""
        try:
            with open(os.path.join(self.directory, name), "rb") as f:
                raw = f.read(CONTROL.size)
        except FileNotFoundError:
            return False
        return len(raw) == CONTROL.size and CONTROL.unpack(raw)[0] == SEG_MAGIC and \
            CONTROL.unpack(raw)[1] == STATE_FREE

    def sweep(self, found: Sequence[Found], *, live_wfs: set[str] | None, live_workers: set[str] | None,
              now_ms: int | None = None) -> dict[SweepReason, int]:
        """Free the segments of `found` that `sweep_verdict` condemns; counts by reason."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        freed = {reason: 0 for reason in SweepReason}
        for item in found:
            reason = sweep_verdict(item, now_ms=now, live_wfs=live_wfs, live_workers=live_workers)
            if reason is not None and self._unlink(item.segment.name):
                freed[reason] += 1
                logger.info("swept segment %s (%s)", item.segment.name, reason.value)
        return freed
