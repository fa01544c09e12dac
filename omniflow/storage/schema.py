"""Field values as Redis returns them: the decoding every reader of records, stage hashes and
stream entries shares (replies are bytes; lists are comma-separated; times are epoch ms)."""
from __future__ import annotations

import time
from typing import Any


def now_ms() -> int:
    """The wall clock in epoch milliseconds, as every record and log entry keeps time."""
    return int(time.time() * 1000)


def s(value: Any) -> str:
    """bytes -> str (replies are bytes); None -> ''."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def csv(value: Any) -> list[str]:
    """A comma-separated field (stage sets, finals) -> its items."""
    return [x for x in s(value).split(",") if x]


def decode_fields(fields: dict[bytes, bytes]) -> dict[str, str]:
    """A log entry's fields as text (binary payload fields left out)."""
    return {s(k): s(v) for k, v in fields.items() if k not in (b"pcm", b"d")}
