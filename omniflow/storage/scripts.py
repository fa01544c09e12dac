"""The Lua script registry: every multi-key transition, loaded once, called by SHA.

Scripts live in `omniflow/lua/*.lua`, each with a header listing KEYS, ARGV and
returns. A line `--@include NAME.lua` splices a shared helper file in. Running
them (NOSCRIPT reload, error translation) is `omniflow.storage.redisio`'s job.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

LUA_DIR = Path(__file__).resolve().parent / "lua"
SCRIPT_NAMES = ("submit", "claim", "emit", "finish", "stage_event", "abort", "retry_due", "restart", "list_scan",
                "heartbeat", "dead_letter", "reap_consumer", "realtime_save", "append_input")


class SubmitResult(str, Enum):
    OK = "ok"
    EXISTING = "existing"
    RETIRED = "retired"
    EXISTS = "exists"
    BUSY = "busy"


class EmitResult(str, Enum):
    OK = "ok"
    DUP = "dup"
    FENCED = "fenced"
    GAP = "gap"             # steps after a lost write were refused; with a finish: the attempt closed as failed


class EventResult(str, Enum):
    IGNORED = "ignored"
    ADVANCED = "advanced"
    COMPLETED = "completed"
    RETRY = "retry"
    FAILED = "failed"


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str


def _read(name: str, seen: frozenset[str] = frozenset()) -> str:
    if name in seen:
        raise ValueError(f"lua include cycle at {name}")
    lines = []
    for line in (LUA_DIR / name).read_text().splitlines():
        if line.startswith("--@include "):
            lines.append(_read(line.split(maxsplit=1)[1].strip(), seen | {name}))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _load(name: str) -> Script:
    source = _read(f"{name}.lua")
    return Script(name=name, source=source, sha=hashlib.sha1(source.encode()).hexdigest())


SCRIPTS: dict[str, Script] = {name: _load(name) for name in SCRIPT_NAMES}


def evalsha_args(name: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
    """The raw EVALSHA command for one script call (for pipelines and batchers)."""
    return ("EVALSHA", SCRIPTS[name].sha, len(keys), *keys, *args)


async def load_all(redis: Redis) -> None:
    """SCRIPT LOAD every script (see `omniflow.storage.redisio.load_scripts`)."""
    from omniflow.storage import redisio

    await redisio.load_scripts(redis)


async def call(redis: Redis, name: str, keys: list[str], args: list[Any]) -> Any:
    """Call one script by SHA (see `omniflow.storage.redisio.script`: NOSCRIPT handled, errors translated)."""
    from omniflow.storage import redisio

    return await redisio.script(redis, name, keys, args)
