"""The schema of what omniflow keeps in Redis: the field names of a workflow's stage hash
(`StageField`) and the decoding every reader of records, stage hashes and stream entries shares
(replies are bytes; lists are comma-separated; times are epoch ms).

The Lua scripts write the same names (`omniflow/storage/lua/`); nothing else in Python spells them.
"""
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


class StageField:
    """Field names of a workflow's stage hash (`Keys.stages`): one group per stage, named after it.

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
