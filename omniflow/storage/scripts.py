"""The Lua script registry: every multi-key transition, loaded once, called by SHA.

Scripts live in `omniflow/storage/lua/*.lua`, each with a header listing KEYS, ARGV and
returns. A line `--@include NAME.lua` splices a shared helper file in. Each script's call
(KEYS from `Keys`, ARGV, return codes) is one function of `omniflow.storage.transitions`;
running them (NOSCRIPT reload, error translation) is `omniflow.storage.redisio`'s job.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LUA_DIR = Path(__file__).resolve().parent / "lua"
SCRIPT_NAMES = ("submit", "claim", "emit", "finish", "stage_event", "abort", "retry_due", "restart", "list_scan",
                "heartbeat", "dead_letter", "reap_consumer", "realtime_save", "lease", "purge", "append_input")


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str

    def evalsha(self, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


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
    """The raw EVALSHA command for one script call (for pipelines and batchers): used by
    `omniflow.storage.transitions` only, which builds every script's KEYS."""
    return SCRIPTS[name].evalsha(keys, args)


