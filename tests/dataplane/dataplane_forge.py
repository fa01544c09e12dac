"""Frames and references the way a buggy or hostile producer could write them (valid checksum
around an arbitrary header), for the tests that make sure consumers refuse them."""
from __future__ import annotations

import zlib
from typing import Any

import msgpack

from omniflow.dataplane import codec


def ext(code: int, *fields: Any) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(fields if len(fields) != 1 else fields[0]))


def forge_frame(structure: Any, buffers: list[bytes], *, spans: list[list[int]] | None = None,
                expiry_ms: int = 2**62) -> tuple[bytes, int]:
    """(frame bytes, header checksum) around `structure` (msgpack-able, ExtTypes allowed)."""
    if spans is None:
        spans, pos = [], 0
        for buf in buffers:
            spans.append([pos, len(buf)])
            pos = (pos + len(buf) + 63) & ~63
    data_len = max((off + n for off, n in spans), default=0)
    header = msgpack.packb([spans, [], b"nonce123", msgpack.packb(structure, use_bin_type=True)], use_bin_type=True)
    prelude = codec.PRELUDE.pack(codec.MAGIC, codec.FRAME_VERSION, 0, 0, len(header), data_len, expiry_ms, 0)
    start = (codec.PRELUDE.size + len(header) + 63) & ~63
    body = bytearray(start + data_len)
    body[:codec.PRELUDE.size + len(header)] = prelude + header
    for (off, n), buf in zip(spans, buffers):
        body[start + off:start + off + min(n, len(buf))] = buf[:n]
    return bytes(body), zlib.crc32(prelude + header)
