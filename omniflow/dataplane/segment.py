"""A segment of its own: one payload in one shared-memory file (what an arena cannot hold).

Used for a payload larger than half an arena, or when a producer's arenas are full. The producer
writes the frame with one `writev` (the copy into new pages the kernel allocates); the consumer maps
the file copy-on-write (tensor views are writable, a write stays private) and the file is unlinked
when the consumer is done. A segment starts with a control block the frame's checksum does not
cover: magic, a state word, and a flag that was 1 when producers recycled segments (arenas do now).

A segment shorter than its payload was cut short (truncated under its reference, or replaced while
being read): `PayloadTruncated`, retryable like a missing one (its producer can write it again). Only
a frame header that is all there, matches the reference's checksum and gives another size than the
reference proves the reference wrong (`SizeMismatch`). A write that fails (a full /dev/shm: ENOSPC)
leaves no file behind.
"""
from __future__ import annotations

import mmap
import os
import struct
import zlib
from collections.abc import Sequence
from typing import Any

from omniflow.dataplane import codec
from omniflow.dataplane.base import PayloadMissing, PayloadTruncated, SizeMismatch, UndecodablePayload

CONTROL = struct.Struct("<4sII")
CONTROL_BYTES = 64
SEG_MAGIC = b"OFSG"
STATE_IN_USE, STATE_FREE = 0, 1
_IOV_MAX = 1024


def _writev_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def write(path: str, frame: codec.Frame) -> None:
    """Create the segment at `path` holding `frame` (mode 0600). A segment of the same name (this very
    step of this attempt, put again) is replaced; a reader of the old one keeps its mapping."""
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, 0o600)
    control = CONTROL.pack(SEG_MAGIC, STATE_IN_USE, 0).ljust(CONTROL_BYTES, b"\0")
    try:
        _writev_all(fd, [control, *frame.parts()])
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def read(path: str, name: str, nbytes: int, checksum: int) -> tuple[Any, mmap.mmap]:
    """The payload of the segment at `path` (views of a private mapping), and the mapping."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise PayloadMissing(f"segment {name} is gone (released, expired or swept)") from None
    try:
        size = os.fstat(fd).st_size
        if size < CONTROL_BYTES + nbytes:
            own = _own_nbytes(fd, checksum)
            if own is None or own == nbytes:
                raise PayloadTruncated(f"segment {name} is {size} bytes: cut short of the {nbytes}-byte payload "
                                       f"it held")
            raise SizeMismatch(f"segment {name} is {size} bytes, too small for the {nbytes}-byte payload the "
                               f"reference says")
        # copy-on-write: tensor views are writable; a write stays private to this process
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    if mm[:4] != SEG_MAGIC:
        raise UndecodablePayload(f"segment {name} is not an omniflow segment")
    payload = codec.decode_frame(memoryview(mm)[CONTROL_BYTES:CONTROL_BYTES + nbytes], nbytes=nbytes,
                                 checksum=checksum, what=f"segment {name}")
    return payload, mm


def _head(fd: int) -> bytes | None:
    """The prelude and header of the frame in the segment open at `fd`; None when the file ends
    before them (or holds no frame)."""
    prelude = os.pread(fd, codec.PRELUDE.size, CONTROL_BYTES)
    try:
        header_len = codec.read_prelude(prelude)[1]
    except UndecodablePayload:
        return None
    header = os.pread(fd, header_len, CONTROL_BYTES + codec.PRELUDE.size)
    return prelude + header if len(header) == header_len else None


def _own_nbytes(fd: int, checksum: int) -> int | None:
    """The size of the segment's frame by its own header when that header is all there and is the one
    `checksum` names (-1 when it is another); None when the file ends before the header does."""
    head = _head(fd)
    if head is None:
        return None
    if zlib.crc32(head) != checksum:
        return -1
    try:
        return codec.frame_info(head).nbytes
    except UndecodablePayload:
        return -1


def read_header(path: str) -> codec.FrameInfo | None:
    """A segment's owner and expiry from its header; None if it has none readable (half-written)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        head = _head(fd)
        return codec.frame_info(head) if head is not None else None
    except UndecodablePayload:
        return None
    finally:
        os.close(fd)


def is_short(path: str, info: codec.FrameInfo | None) -> bool:
    """True when the segment is shorter than the frame its header describes: half-written (its
    producer died in the write, or is still in it) or cut short."""
    if info is None:
        return False
    try:
        return os.stat(path).st_size < CONTROL_BYTES + info.nbytes
    except FileNotFoundError:
        return False


def is_free(path: str) -> bool:
    """True when a segment's consumer handed it back (state FREE) and it only waits to be unlinked."""
    try:
        with open(path, "rb") as f:
            raw = f.read(CONTROL.size)
    except FileNotFoundError:
        return False
    return len(raw) == CONTROL.size and CONTROL.unpack(raw)[0] == SEG_MAGIC and CONTROL.unpack(raw)[1] == STATE_FREE
