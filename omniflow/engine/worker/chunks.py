"""Decoding what a worker reads for its sessions: edge-log and inbox entries, and what it writes
back about them (an executor's usage, bounded)."""
from __future__ import annotations

import json
import logging
from typing import Any

import msgpack

from omniflow.engine.session import Session

logger = logging.getLogger(__name__)

MAX_DETAIL_CHARS = 4096     # an executor's error message, as the workflow record keeps it
MAX_USAGE_CHARS = 16_384    # an executor's usage document (the reconciler refuses reports over 64 KiB)

CHUNK_DECODE_ERRORS = (ValueError, TypeError, msgpack.UnpackException)


def fields_dict(flat: list[bytes]) -> dict[bytes, bytes]:
    """A stream entry's fields as Lua returns them (flat list) -> dict."""
    return dict(zip(flat[::2], flat[1::2]))


def decode_chunks(packed: bytes) -> list[dict[bytes, bytes]]:
    """The chunks of one edge or inbox entry's `m` field (a msgpack array of flat field lists);
    raises one of `CHUNK_DECODE_ERRORS` when it does not decode."""
    return [fields_dict(flat) for flat in msgpack.unpackb(packed, raw=True)]


def chunk_fields(fields: dict[bytes, bytes]) -> list[dict[bytes, bytes]]:
    """The chunks of one edge-log entry (as the claim's catch-up returns it).

    An entry that does not decode yields one malformed chunk: the consuming session fails with a
    clear error (`Session._decode`), the worker does not."""
    packed = fields.get(b"m")
    if packed is None:
        return [fields]
    try:
        return decode_chunks(packed)
    except CHUNK_DECODE_ERRORS:
        return [{b"malformed": b"1"}]


def usage_json(usage: Any, session: Session) -> str:
    """An executor's usage as the record keeps it (bounded: the reconciler refuses huge reports)."""
    text = json.dumps(dict(usage or {}))
    if len(text) > MAX_USAGE_CHARS:
        logger.warning("executor %s returned %d characters of usage on %s; kept only its size",
                       session.stage, len(text), session.wf_id)
        text = json.dumps({"truncated": True, "chars": len(text)})
    return text
