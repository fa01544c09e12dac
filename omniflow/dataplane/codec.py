"""Payload encoding for the data plane: msgpack, never pickle.

Two forms of the same payload (any msgpack-able value; numpy arrays, torch tensors and bytes
anywhere inside it):

- **inline** (`dumps`/`loads`): one msgpack document, arrays as an extension type
  (dtype, shape, bytes). A superset of `omniflow.dataplane.codec`: what that module writes, `loads`
  reads, so `omniflow.dataplane.codec` can delegate here. Tensors are a second extension type.
- **frame** (`encode_frame`/`decode_frame`): for payloads that live in a Redis key or a
  shared-memory segment. A fixed prelude, a small msgpack header (structure, dtypes, shapes,
  buffer offsets, owner, nonce) and the raw buffers, each 64-byte aligned, so the consumer
  maps them as views without copying (`np.frombuffer` on the segment). The reference carries
  the CRC32 of prelude + header: a stale, foreign or truncated payload is refused.

torch is never imported here unless a tensor is decoded: a tensor can only be encoded by a
process that imported torch already (`omniflow.dataplane.tensors`).
"""
from __future__ import annotations

import itertools
import math
import os
import struct
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from omniflow.dataplane import tensors
from omniflow.dataplane.base import ChecksumMismatch, ForeignReference, SizeMismatch, UndecodablePayload
from omniflow.storage.schema import ThreadPacker

_NDARRAY = 1              # inline ndarray: packb((dtype.str, shape, raw)) -- omniflow.dataplane.codec's format
_TENSOR = 2               # inline tensor: packb((torch dtype name, shape, raw))
_F_NDARRAY = 10           # frame ndarray: packb((dtype.str, shape, buffer index))
_F_TENSOR = 11            # frame tensor: packb((torch dtype name, shape, buffer index))
_F_BYTES = 12             # frame bytes: packb(buffer index)

MAGIC = b"OFDP"
FRAME_VERSION = 1
FLAG_DATA_CRC = 1
# magic, version, flags, reserved, header length, data length, expiry (ms since epoch), data CRC32
PRELUDE = struct.Struct("<4sBBHIQQI")
ALIGN = 64
FRAME_BYTES_MIN = 1024    # bytes values at least this long become buffers of a frame
ALLOWED_KINDS = frozenset("biufc")      # bool, int, uint, float, complex: nothing that runs code


def _contiguous(arr: np.ndarray) -> np.ndarray:
    # np.ascontiguousarray turns a 0-d array into a 1-d one
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


_NONCE_BASE = int.from_bytes(os.urandom(8), "little")
_nonces = itertools.count(1)


def _nonce() -> bytes:
    """8 bytes no other frame of this process (and, but for chance, of any other) carries."""
    return ((_NONCE_BASE + next(_nonces)) & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little")


# --------------------------------------------------------------------------- inline


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = _contiguous(obj)
        return msgpack.ExtType(_NDARRAY, msgpack.packb((arr.dtype.str, list(arr.shape), arr.tobytes())))
    if isinstance(obj, np.generic):
        return obj.item()
    if tensors.is_tensor(obj):
        name, arr = tensors.to_array(obj)
        return msgpack.ExtType(_TENSOR, msgpack.packb((name, list(arr.shape), arr.tobytes())))
    raise TypeError(f"cannot encode {type(obj).__name__} for Redis (use numpy arrays, torch tensors, bytes, "
                    "str, numbers)")


def _inline_hook(code: int, data: bytes) -> Any:
    if code == _NDARRAY:
        dtype_str, shape, raw = msgpack.unpackb(data)
        dtype, shape = _check_array(dtype_str, shape, len(raw))
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    if code == _TENSOR:
        name, shape, raw = msgpack.unpackb(data)
        dtype, shape = _check_tensor(name, shape, len(raw))
        # bytes are immutable and a tensor must be writable: one copy (inline payloads are small)
        return tensors.from_array(name, np.frombuffer(bytearray(raw), dtype=dtype).reshape(shape))
    return msgpack.ExtType(code, data)


_DUMPS = ThreadPacker(default=_default, use_bin_type=True)     # (`_default` packs with `msgpack.packb`)


def dumps(obj: Any) -> bytes:
    """`obj` as one msgpack document (arrays and tensors inside it by value)."""
    return _DUMPS.pack(obj)


def loads(data: bytes) -> Any:
    """Inverse of `dumps` (and of `omniflow.dataplane.codec.dumps`); refuses arrays that could hold objects."""
    try:
        return msgpack.unpackb(data, ext_hook=_inline_hook, raw=False, strict_map_key=False)
    except UndecodablePayload:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise UndecodablePayload(f"payload does not decode: {exc}") from exc


# --------------------------------------------------------------------------- validation


def _check_shape(shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise UndecodablePayload(f"bad shape {shape!r}")
    return tuple(shape)


def _check_array(dtype_str: Any, shape: Any, nbytes: int) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """A dtype a consumer may build an array of, and a shape that fits `nbytes` exactly."""
    try:
        if not isinstance(dtype_str, str):
            raise TypeError(f"dtype {dtype_str!r} is not a string")
        dtype = np.dtype(dtype_str)
    except (TypeError, ValueError) as exc:
        raise UndecodablePayload(f"undecodable dtype {dtype_str!r}: {exc}") from exc
    if dtype.hasobject or dtype.kind not in ALLOWED_KINDS or dtype.fields is not None or dtype.subdtype:
        raise UndecodablePayload(f"dtype {dtype_str!r} is not accepted (numbers and booleans only)")
    dims = _check_shape(shape)
    count = math.prod(dims)
    if count * dtype.itemsize != nbytes:
        raise UndecodablePayload(f"shape {list(dims)} of {dtype_str} needs {count * dtype.itemsize} bytes, "
                                 f"the payload has {nbytes}")
    return dtype, dims


def _check_tensor(name: Any, shape: Any, nbytes: int) -> tuple[np.dtype[Any], tuple[int, ...]]:
    words = tensors.TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if words is None:
        raise UndecodablePayload(f"undecodable tensor dtype {name!r} (known: {', '.join(tensors.TORCH_DTYPES)})")
    return _check_array(words, shape, nbytes)


# --------------------------------------------------------------------------- frames


@dataclass(slots=True)
class Frame:
    """An encoded payload: `head` (prelude + header + padding) then `buffers` at `offsets`."""

    head: bytes
    buffers: list[memoryview]
    offsets: list[int]          # absolute offsets of each buffer in the frame
    nbytes: int                 # total size of the frame
    checksum: int               # CRC32 of prelude + header (what the reference carries)

    def parts(self) -> list[bytes | memoryview]:
        """The frame as a list of pieces to write in order (padding included)."""
        out: list[bytes | memoryview] = [self.head]
        pos = len(self.head)
        for buf, off in zip(self.buffers, self.offsets, strict=True):
            if off > pos:
                out.append(bytes(off - pos))
            out.append(buf)
            pos = off + buf.nbytes
        return out

    def tobytes(self) -> bytes:
        """The frame in one bytes object (one copy of every buffer)."""
        return b"".join(self.parts())


class _Extractor:
    """Walks a payload, moving arrays, tensors and large bytes into buffers."""

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []

    def _buffer(self, view: memoryview) -> int:
        self.buffers.append(view)
        return len(self.buffers) - 1

    def walk(self, obj: Any) -> Any:
        if isinstance(obj, (str, int, float, bool)) or obj is None:
            return obj
        if isinstance(obj, dict):
            return {k: self.walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.walk(v) for v in obj]
        if isinstance(obj, np.ndarray):
            arr = _contiguous(obj)
            index = self._buffer(arr.data.cast("B") if arr.size else memoryview(b""))
            return msgpack.ExtType(_F_NDARRAY, msgpack.packb((arr.dtype.str, list(arr.shape), index)))
        if isinstance(obj, (bytes, bytearray, memoryview)):
            view = memoryview(obj).cast("B")
            if view.nbytes < FRAME_BYTES_MIN:
                return bytes(view)
            return msgpack.ExtType(_F_BYTES, msgpack.packb(self._buffer(view)))
        if isinstance(obj, np.generic):
            return obj.item()
        if tensors.is_tensor(obj):
            name, arr = tensors.to_array(obj)
            index = self._buffer(arr.data.cast("B") if arr.size else memoryview(b""))
            return msgpack.ExtType(_F_TENSOR, msgpack.packb((name, list(arr.shape), index)))
        raise TypeError(f"cannot encode {type(obj).__name__} for Redis (use numpy arrays, torch tensors, bytes, "
                        "str, numbers)")


def encode_frame(obj: Any, *, owner: Sequence[Any] = (), expiry_ms: int = 0, full_checksum: bool = False) -> Frame:
    """`obj` as a frame. Buffers are views of the caller's arrays: nothing is copied here."""
    ex = _Extractor()
    structure = msgpack.packb(ex.walk(obj), use_bin_type=True)
    offsets, pos = [], 0
    for buf in ex.buffers:
        offsets.append(pos)
        pos = _align(pos + buf.nbytes)
    data_len = (offsets[-1] + ex.buffers[-1].nbytes) if ex.buffers else 0
    header = msgpack.packb([[[off, buf.nbytes] for off, buf in zip(offsets, ex.buffers, strict=True)],
                            list(owner), _nonce(), structure], use_bin_type=True)
    data_crc = 0
    if full_checksum:
        for buf in ex.buffers:
            data_crc = zlib.crc32(buf, data_crc)
    prelude = PRELUDE.pack(MAGIC, FRAME_VERSION, FLAG_DATA_CRC if full_checksum else 0, 0, len(header),
                           data_len, expiry_ms, data_crc)
    checksum = zlib.crc32(header, zlib.crc32(prelude))
    start = _align(PRELUDE.size + len(header))
    head = prelude + header + bytes(start - PRELUDE.size - len(header))
    return Frame(head, ex.buffers, [start + off for off in offsets], start + data_len, checksum)


@dataclass(frozen=True, slots=True)
class FrameInfo:
    """What the prelude and header of a frame say (read without touching the data)."""

    header_len: int
    data_len: int
    expiry_ms: int
    owner: list[Any]

    @property
    def nbytes(self) -> int:
        """The size of the whole frame, as its header says."""
        return _align(PRELUDE.size + self.header_len) + self.data_len


def read_prelude(raw: bytes) -> tuple[int, int, int, int, int]:
    """(flags, header length, data length, expiry ms, data CRC) of a frame's first bytes."""
    if len(raw) < PRELUDE.size:
        raise UndecodablePayload("payload is shorter than a frame prelude")
    magic, version, flags, _res, header_len, data_len, expiry_ms, data_crc = PRELUDE.unpack_from(raw)
    if magic != MAGIC or version != FRAME_VERSION:
        raise UndecodablePayload(f"not an omniflow payload frame (magic {magic!r}, version {version})")
    return flags, header_len, data_len, expiry_ms, data_crc


def frame_info(head: bytes) -> FrameInfo:
    """Owner and expiry from the first bytes of a frame (prelude + header)."""
    _flags, header_len, data_len, expiry_ms, _crc = read_prelude(head)
    header = head[PRELUDE.size:PRELUDE.size + header_len]
    if len(header) != header_len:
        raise UndecodablePayload("frame header is truncated")
    try:
        owner = msgpack.unpackb(header, raw=False)[1]
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise UndecodablePayload(f"frame header does not decode: {exc}") from exc
    return FrameInfo(header_len, data_len, expiry_ms, list(owner) if isinstance(owner, list) else [])


def decode_frame(buf: Any, *, nbytes: int, checksum: int, what: str = "payload", wf_id: str | None = None) -> Any:
    """The payload of a frame held in `buf` (bytes, or a mapping: arrays come back as views of it).

    numpy arrays are read-only views (as an inline payload's are); torch tensors are writable views
    when `buf` is writable (a private mapping: a write stays in this process), else copies.
    Refuses a frame of another size than `nbytes`, one whose prelude + header CRC32 is not
    `checksum`, one whose header does not describe sound arrays inside the frame, and, with
    `wf_id`, one whose header names another owner workflow.
    """
    return decode_frame_views(buf, nbytes=nbytes, checksum=checksum, what=what, wf_id=wf_id)[0]


def decode_frame_views(buf: Any, *, nbytes: int, checksum: int, what: str = "payload",
                       wf_id: str | None = None) -> tuple[Any, bool]:
    """`decode_frame`, and whether the payload holds writable views of `buf` (tensors): only then
    can its consumer have written into `buf`."""
    size = len(buf)
    if size != nbytes:
        raise SizeMismatch(f"{what} is {size} bytes, the reference says {nbytes}")
    flags, header_len, data_len, _expiry, data_crc = read_prelude(bytes(buf[:PRELUDE.size]))
    if PRELUDE.size + header_len > size:
        raise SizeMismatch(f"{what}: header of {header_len} bytes does not fit in {size}")
    head = bytes(buf[:PRELUDE.size + header_len])
    if zlib.crc32(head) != checksum:
        raise ChecksumMismatch(f"{what}: header checksum {zlib.crc32(head):#010x}, the reference says {checksum:#010x}")
    start = _align(PRELUDE.size + header_len)
    if start + data_len != size:
        raise SizeMismatch(f"{what}: {start + data_len} bytes by its header, {size} in fact")
    try:
        spans, owner, _nonce, structure = msgpack.unpackb(head[PRELUDE.size:], raw=False)
        spans = [(int(off), int(n)) for off, n in spans]
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise UndecodablePayload(f"{what}: header does not decode: {exc}") from exc
    if wf_id is not None and not (isinstance(owner, list) and owner and str(owner[0]) == wf_id):
        raise ForeignReference(f"{what} belongs to another workflow than {wf_id}")
    for off, n in spans:
        if off < 0 or n < 0 or off + n > data_len:
            raise UndecodablePayload(f"{what}: buffer [{off}, {off + n}) lies outside the {data_len} data bytes")
    if flags & FLAG_DATA_CRC:
        crc = 0
        view = memoryview(buf)
        for off, n in spans:
            crc = zlib.crc32(view[start + off:start + off + n], crc)
        view.release()
        if crc != data_crc:
            raise ChecksumMismatch(f"{what}: data checksum {crc:#010x}, its header says {data_crc:#010x}")
    writable = not memoryview(buf).readonly
    readonly = memoryview(buf).toreadonly()     # numpy views: nobody can turn them writable
    wrote = False

    def hook(code: int, data: bytes) -> Any:
        nonlocal wrote
        if code == _F_BYTES:
            off, n = spans[msgpack.unpackb(data)]
            return bytes(buf[start + off:start + off + n])
        if code in (_F_NDARRAY, _F_TENSOR):
            kind, shape, index = msgpack.unpackb(data, raw=False)
            off, n = spans[index]
            if code == _F_NDARRAY:
                dtype, dims = _check_array(kind, shape, n)
            else:
                dtype, dims = _check_tensor(kind, shape, n)
            if n and (start + off) % dtype.alignment:
                raise UndecodablePayload(f"{what}: buffer at {start + off} is not aligned for {dtype}")
            count = n // dtype.itemsize
            if code == _F_NDARRAY:
                return np.frombuffer(readonly, dtype=dtype, count=count, offset=start + off).reshape(dims)
            # a tensor must be writable: a view of a private mapping is; one of immutable bytes is copied
            arr = np.frombuffer(buf, dtype=dtype, count=count, offset=start + off).reshape(dims)
            wrote = wrote or writable
            return tensors.from_array(kind, arr if writable else arr.copy())
        raise UndecodablePayload(f"{what}: unknown extension type {code}")

    try:
        return msgpack.unpackb(structure, ext_hook=hook, raw=False, strict_map_key=False), wrote
    except (UndecodablePayload, SizeMismatch, ChecksumMismatch, ForeignReference):
        raise
    except (ValueError, TypeError, IndexError, msgpack.UnpackException) as exc:
        raise UndecodablePayload(f"{what}: structure does not decode: {exc}") from exc


# --------------------------------------------------------------------------- sizing


def payload_nbytes(obj: Any, limit: int = sys.maxsize) -> int:
    """About how many bytes `obj` carries (array, tensor, bytes and str sizes); stops counting
    once past `limit` (callers only ask "is it above the inline threshold?")."""
    kind = type(obj)        # the exact common types first: once per payload, per downstream stage
    if kind is str or kind is bytes:
        return len(obj)
    if kind is int or kind is float:
        return 8
    if kind is list or isinstance(obj, (list, tuple)):     # (none of the types below is a list, a tuple or a dict)
        total = 0
        for v in obj:
            total += payload_nbytes(v, limit)
            if total > limit:
                break
        return total
    if kind is dict or isinstance(obj, dict):
        total = 0
        for k, v in obj.items():
            total += payload_nbytes(k, limit) + payload_nbytes(v, limit)
            if total > limit:
                break
        return total
    if isinstance(obj, (str, bytes, bytearray)):
        return len(obj)
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, (int, float, bool)) or obj is None:
        return 8
    if isinstance(obj, memoryview):
        return obj.nbytes
    if tensors.is_tensor(obj):
        return int(obj.numel() * obj.element_size())
    return 8
