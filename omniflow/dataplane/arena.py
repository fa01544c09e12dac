"""Arenas: long-lived shared-memory files a producer writes chunk payloads into, slot by slot.

A segment of its own per chunk costs more kernel work than the copy it carries (1 MiB here: its
pages allocated, faulted in by the producer and again by the consumer, mapped, unmapped and freed:
~1 ms in all, against ~30 µs for the copy into memory that is already mapped). So a producer keeps a few
arenas mapped for its whole life (`DEFAULT_ARENA_BYTES` each; their pages allocated and faulted in
once, as the arena first fills) and puts each payload into a free slot of one; a consumer maps each
arena it reads once and keeps the mapping. In steady state a chunk costs the producer one copy and
the consumer nothing but the views it reads: no file is created, opened, mapped or unlinked per
chunk, and no page is faulted in.

Layout of an arena file (`of-<prefix>-<worker>-arena-<n>`, mode 0600):

    [0, 64)           header: magic "OFAR", version, slot count, data offset, size, frees (a hint)
    [64, data)        the slot table, 32 bytes a slot: gen, freed, offset, nbytes, expiry (ms)
    [data, size)      payload frames (`omniflow.dataplane.codec`), each at a page-aligned offset

Each word of the table has one writer, so processes share no lock: the producer writes a slot's
`gen` (a new number for every payload it puts there), offset, size and expiry; a consumer done with
the payload writes `freed = gen` through the file (never through its mapping) and bumps `frees`, which
tells the producer to look. A slot is in use while `freed != gen`; a late release naming a generation
the slot no longer holds changes nothing. The producer reuses the lowest free space first, so the
pages it copies into are the ones still in the CPU caches.

A reference names the arena, the slot and its generation: a payload released and replaced is
`PayloadMissing`, never someone else's bytes, and the frame header's owner (workflow, stages, attempt,
step, worker) is checked against the reading session's workflow.

Consumers map an arena private (copy-on-write): numpy views are read-only, torch tensor views are
writable and a write stays theirs. Once the last view of a payload with tensors is gone, pages of it
the consumer wrote are found in `/proc/self/pagemap` (a private copy is an anonymous page, an
untouched one is the file's) and dropped (`MADV_DONTNEED`), so the slot's next payload is not hidden
behind a stale private page.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import heapq
import mmap
import os
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniflow.dataplane import codec
from omniflow.dataplane.base import PayloadMissing, PayloadTruncated, SizeMismatch, UndecodablePayload

DEFAULT_ARENA_BYTES = 64 << 20
DEFAULT_ARENA_SLOTS = 1024
ARENA_MAGIC = b"OFAR"
ARENA_VERSION = 1
# magic, version, slot count, reserved, data offset, size, frees
HEADER = struct.Struct("<4sIIIQQQ")
FREES_AT = HEADER.size - 8
TABLE_AT = 64
SLOT = np.dtype([("gen", "<u4"), ("freed", "<u4"), ("offset", "<u8"), ("nbytes", "<u8"), ("expiry_ms", "<u8")])
ENTRY = struct.Struct("<IIQQQ")       # one row of SLOT, for reading or writing a single slot
_FREED = struct.Struct("<I")
PAGE = mmap.PAGESIZE
GROW_STEP = 4 << 20           # an arena's pages are allocated in steps of this much, as it fills
MADV_POPULATE_WRITE = 23      # Linux 5.14+: fault pages in writable in one call
LINK_CHECK_S = 0.5            # how often a producer makes sure its arena was not unlinked under it
HOLDER_STEP = 64 << 10        # consumer views are held by buffers sized in these steps (few distinct types)
_PAGEMAP = "/proc/self/pagemap"
_PM_PRESENT, _PM_SWAPPED, _PM_FILE = 1 << 63, 1 << 62, 1 << 61


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@dataclass(slots=True)
class _Held:
    """A slot the producer has filled and no consumer has handed back yet."""

    offset: int
    capacity: int
    wf_id: str
    expiry_ms: int


class Arena:
    """A producer's arena: created, allocated and mapped once; slots handed out and taken back."""

    def __init__(self, path: str, name: str, size: int, *, slots: int = DEFAULT_ARENA_SLOTS) -> None:
        data_at = _round_up(TABLE_AT + slots * SLOT.itemsize, PAGE)
        size = _round_up(max(size, data_at + PAGE), PAGE)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, data_at)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            HEADER.pack_into(mm, 0, ARENA_MAGIC, ARENA_VERSION, slots, 0, data_at, size, 0)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self.name, self.path, self.size, self.fd, self.mm = name, path, size, fd, mm
        self._close_fd = weakref.finalize(self, os.close, fd)     # also when dropped without close()
        self.table: np.ndarray = np.ndarray((slots,), dtype=SLOT, buffer=mm, offset=TABLE_AT)
        self.bytes: np.ndarray = np.frombuffer(mm, dtype=np.uint8)
        self.held: dict[int, _Held] = {}
        self._free: list[tuple[int, int]] = [(data_at, size - data_at)]     # (offset, length), by offset
        self._slots = list(range(slots))                                     # a heap: lowest index first
        self._ready = data_at            # pages below this are allocated and mapped (the arena grows as used)
        self._gen = 0
        self._frees_seen = 0
        self._checked = time.monotonic()
        self.lock = threading.Lock()
        # why the last `reserve` could not allocate pages (None: it could). A string: an exception kept
        # here would hold its traceback, whose frames hold this arena (a cycle: unmapped only by the GC)
        self.starved: str | None = None
        self.retired = False                     # its producer took it out of use: `reserve` refuses

    def _grow(self, end: int) -> bool:
        """Allocate and map the pages up to `end` (once: the lowest space is used first, so an arena
        only ever grows to what its producer had in flight). A full /dev/shm fails here (ENOSPC; then
        `starved` says why), never as a SIGBUS in the middle of a copy."""
        if end <= self._ready:
            return True
        step = min(_round_up(max(end, self._ready + GROW_STEP), PAGE), self.size)
        for grow in dict.fromkeys((step, min(_round_up(end, PAGE), self.size))):   # a step; else what is needed
            try:
                os.posix_fallocate(self.fd, self._ready, grow - self._ready)
                break
            except OSError as exc:
                self.starved = str(exc)
        else:
            return False
        with contextlib.suppress(OSError, ValueError):     # older kernels: the copy faults them in instead
            self.mm.madvise(MADV_POPULATE_WRITE, self._ready, grow - self._ready)
        self._ready = grow
        self.starved = None
        return True

    # ------------------------------------------------------------ space
    def _take(self, capacity: int) -> int | None:
        for i, (off, length) in enumerate(self._free):
            if length >= capacity:
                if length == capacity:
                    del self._free[i]
                else:
                    self._free[i] = (off + capacity, length - capacity)
                return off
        return None

    def _give(self, off: int, length: int) -> None:
        i = bisect.bisect_left(self._free, (off, 0))
        if i < len(self._free) and off + length == self._free[i][0]:
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            off, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (off, length))

    def _drop(self, slot: int) -> _Held:
        held = self.held.pop(slot)
        self._give(held.offset, held.capacity)
        heapq.heappush(self._slots, slot)
        return held

    def reclaim(self, *, force: bool = False) -> int:
        """Take back the slots consumers handed back (looked for when `frees` moved, or `force`)."""
        frees = int.from_bytes(self.mm[FREES_AT:FREES_AT + 8], "little")
        if not self.held or (frees == self._frees_seen and not force):
            return 0
        self._frees_seen = frees
        slots = np.fromiter(self.held, dtype=np.int64, count=len(self.held))
        rows = self.table[slots]
        done = slots[rows["freed"] == rows["gen"]]
        for slot in done.tolist():
            self._drop(slot)
        return int(done.size)

    def reserve(self, nbytes: int, wf_id: str, expiry_ms: int) -> tuple[int, int, int] | None:
        """(slot, offset, generation) for a payload of `nbytes`, or None when it does not fit now (in
        the arena, or, `starved` set, in the shared-memory directory: no room for its pages)."""
        self.starved = None
        capacity = _round_up(max(nbytes, 1), PAGE)
        if capacity > self.size or self.retired:
            return None
        self.reclaim()
        off = self._take(capacity) if self._slots else None
        if off is None and self.reclaim(force=True):
            off = self._take(capacity) if self._slots else None
        if off is None:
            return None
        if not self._grow(off + capacity):
            self._give(off, capacity)
            return None
        slot = heapq.heappop(self._slots)
        self._gen = self._gen % 0xFFFF_FFFF + 1           # never 0: a slot never used has gen 0
        if self._gen == self._row(slot)[1]:               # after a wrap: must differ from the last release
            self._gen = self._gen % 0xFFFF_FFFF + 1
        self.held[slot] = _Held(off, capacity, wf_id, expiry_ms)
        return slot, off, self._gen

    def _row(self, slot: int) -> tuple[int, int, int, int, int]:
        row: tuple[int, int, int, int, int] = ENTRY.unpack_from(self.mm, TABLE_AT + slot * ENTRY.size)
        return row

    def publish(self, slot: int, gen: int, offset: int, nbytes: int, expiry_ms: int) -> None:
        """Make a slot's entry say what was written (the gen last: it is what marks the slot in use)."""
        at = TABLE_AT + slot * ENTRY.size
        struct.pack_into("<QQQ", self.mm, at + 8, offset, nbytes, expiry_ms)
        struct.pack_into("<I", self.mm, at, gen)

    def write(self, offset: int, frame: codec.Frame) -> None:
        """Copy `frame` into the arena at `offset` (the one copy of the shared-memory path)."""
        dst = self.bytes
        dst[offset:offset + len(frame.head)] = np.frombuffer(frame.head, dtype=np.uint8)
        for buf, at in zip(frame.buffers, frame.offsets, strict=True):
            if buf.nbytes:
                dst[offset + at:offset + at + buf.nbytes] = np.frombuffer(buf, dtype=np.uint8)

    def forget(self, slot: int) -> None:
        """Give a slot back at once (a write that failed half-way: no reference to it exists)."""
        self._drop(slot)

    def take_back(self, slots: list[int]) -> int:
        """Free slots nobody will hand back (their workflow ended, they expired): marked freed in the
        table too, so a sweep of this arena after our death sees them free."""
        for slot in slots:
            if slot in self.held:
                _FREED.pack_into(self.mm, TABLE_AT + slot * ENTRY.size + 4, self._row(slot)[0])
                self._drop(slot)
        return len(slots)

    # ------------------------------------------------------------ life
    def linked(self) -> bool:
        """False once the file was unlinked under us (a sweep that took this worker for dead) or cut
        short (a copy into pages past its end would be a SIGBUS); asked of the file at most every
        `LINK_CHECK_S`."""
        now = time.monotonic()
        if now - self._checked < LINK_CHECK_S:
            return True
        self._checked = now
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return st.st_nlink > 0 and st.st_size >= self.size

    def close(self, *, unlink: bool) -> None:
        """Unmap (no thread may write into it any more) and close; unlink the file if asked."""
        del self.table, self.bytes
        self.mm.close()
        self._close_fd()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------- consumer side


class Mapped:
    """A consumer's mapping of one arena: opened and mapped once, kept while the file exists."""

    def __init__(self, path: str, name: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise PayloadMissing(f"arena {name} is gone (its workflows ended, or it was swept)") from None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, HEADER.size, 0)
            if len(head) < HEADER.size:
                raise PayloadTruncated(f"arena {name} is {size} bytes: cut short of its header")
            magic, version, slots, _res, data_at, declared, _frees = HEADER.unpack(head)
            if magic != ARENA_MAGIC or version != ARENA_VERSION:
                raise UndecodablePayload(f"arena {name} is not an omniflow arena (magic {magic!r}, v{version})")
            if size < declared:
                raise PayloadTruncated(f"arena {name} is {size} bytes: cut short of the {declared} it was made with")
            if declared != size or not TABLE_AT + slots * SLOT.itemsize <= data_at <= size:
                raise UndecodablePayload(f"arena {name}: header does not match the file ({declared} vs {size} bytes)")
            # private: views are writable and a write stays in this process (see `hand_back`)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.name, self.fd, self.mm, self.size, self.data_at = name, fd, mm, size, data_at
        self.slots = slots
        self.address = ctypes.addressof(ctypes.c_ubyte.from_buffer(mm))

    def _row(self, slot: int) -> tuple[int, int, int, int, int]:
        row: tuple[int, int, int, int, int] = ENTRY.unpack_from(self.mm, TABLE_AT + slot * ENTRY.size)
        return row

    def entry(self, slot: int, gen: int, nbytes: int) -> int:
        """The offset of a slot's payload, after checking the entry against the reference."""
        if not 0 <= slot < self.slots:
            raise UndecodablePayload(f"arena {self.name} has no slot {slot}")
        gen_now, freed, offset, size, _expiry = self._row(slot)
        if gen_now != gen or freed == gen:
            raise PayloadMissing(f"arena {self.name} slot {slot}: payload {gen} is gone (released or swept)")
        if size != nbytes:
            raise SizeMismatch(f"arena {self.name} slot {slot} holds {size} bytes, the reference says {nbytes}")
        if offset % PAGE or not self.data_at <= offset <= self.size - nbytes:
            raise UndecodablePayload(f"arena {self.name} slot {slot}: offset {offset} is outside its data")
        # cut short since we mapped it: reading past the file's end would be a SIGBUS, not an error
        size_now = os.fstat(self.fd).st_size
        if size_now < offset + nbytes:
            raise PayloadTruncated(f"arena {self.name} slot {slot}: the arena was cut short to {size_now} bytes")
        return int(offset)

    def holder(self, offset: int, nbytes: int) -> Any:
        """A buffer over [offset, offset + nbytes) that the views of one payload keep alive (and that
        can be watched: it dies with the last of them)."""
        length = min(_round_up(nbytes, HOLDER_STEP), self.size - offset)
        return (ctypes.c_ubyte * length).from_buffer(self.mm, offset)

    def private(self, offset: int, nbytes: int) -> mmap.mmap:
        """A mapping of its own of [offset, offset + nbytes) (a second reader of one payload)."""
        return mmap.mmap(self.fd, min(_round_up(nbytes, PAGE), self.size - offset), flags=mmap.MAP_PRIVATE,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)

    def scrub(self, slot: int, gen: int, nbytes: int, pagemap: int | None) -> None:
        """Drop this process's private copies of a slot's pages (what views of it wrote), so the next
        read of the slot, here, sees the file again."""
        row = self._row(slot)
        if row[0] != gen or not nbytes:
            return
        offset = row[2]
        if _written(pagemap, self.address + offset, nbytes):
            self.mm.madvise(mmap.MADV_DONTNEED, offset, min(_round_up(nbytes, PAGE), self.size - offset))

    def hand_back(self, slot: int, gen: int) -> bool:
        """Mark a slot freed (through the file) and tell its producer; False if it holds another
        payload by now (taken back and reused: its workflow ended)."""
        row = self._row(slot)
        if row[0] != gen or row[1] == gen:
            return False
        os.pwrite(self.fd, _FREED.pack(gen), TABLE_AT + slot * ENTRY.size + 4)
        frees = int.from_bytes(self.mm[FREES_AT:FREES_AT + 8], "little")
        os.pwrite(self.fd, (frees + 1).to_bytes(8, "little"), FREES_AT)
        return True

    def linked(self) -> bool:
        try:
            return os.fstat(self.fd).st_nlink > 0
        except OSError:
            return False

    def close(self) -> None:
        """Forget the mapping; it is unmapped when the last view of it is gone."""
        os.close(self.fd)


def _written(pagemap: int | None, address: int, nbytes: int) -> bool:
    """True if this process may hold a private copy of a page in [address, address + nbytes)."""
    if pagemap is None:
        return True                          # cannot tell: always drop
    first, count = address // PAGE, _round_up(nbytes, PAGE) // PAGE
    try:
        raw = os.pread(pagemap, 8 * count, 8 * first)
    except OSError:
        return True
    words = np.frombuffer(raw, dtype="<u8")
    mapped = (words & np.uint64(_PM_PRESENT | _PM_SWAPPED)) != 0
    return bool((mapped & ((words & np.uint64(_PM_FILE)) == 0)).any())


def open_pagemap() -> int | None:
    """This process's page map (which of its pages are private copies), or None where unreadable."""
    try:
        return os.open(_PAGEMAP, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


# --------------------------------------------------------------------------- the sweep's view


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """An in-use slot of an arena as a sweep reads it from the file."""

    slot: int
    expiry_ms: int
    info: codec.FrameInfo | None       # None: no readable frame (written half-way)


def scan(path: str) -> list[SlotInfo] | None:
    """The in-use slots of an arena file, read without mapping it; None if it is not an arena."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER.size, 0)
        if len(head) < HEADER.size:
            return None
        magic, version, slots, _res, data_at, declared, _frees = HEADER.unpack(head)
        if magic != ARENA_MAGIC or version != ARENA_VERSION or declared != size or slots > (1 << 20):
            return None
        table = np.frombuffer(os.pread(fd, slots * SLOT.itemsize, TABLE_AT), dtype=SLOT)
        out = []
        for slot in np.nonzero((table["gen"] != 0) & (table["gen"] != table["freed"]))[0].tolist():
            _gen, _freed, offset, _nbytes, expiry = table[slot].tolist()
            info = None
            if data_at <= offset < size:
                prelude = os.pread(fd, codec.PRELUDE.size, offset)
                try:
                    header_len = codec.read_prelude(prelude)[1]
                    info = codec.frame_info(prelude + os.pread(fd, header_len, offset + codec.PRELUDE.size))
                except UndecodablePayload:
                    info = None
            out.append(SlotInfo(slot, int(expiry), info))
        return out
    finally:
        os.close(fd)


def now_ms() -> int:
    return int(time.time() * 1000)
