"""The Lua script registry: every multi-key transition, loaded once, called by SHA.

Scripts live in `omniflow/storage/lua/*.lua`, each with a header listing KEYS, ARGV and
returns. A line `--@include NAME.lua` splices a shared helper file in. Each script's call
(KEYS from `Keys`, ARGV, return codes) is one function of `omniflow.storage.transitions`;
running them (NOSCRIPT reload, error translation) is `omniflow.storage.redisio`'s job.
"""
from __future__ import annotations

import hashlib
import re
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


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_COMMENT = re.compile(r"--.*$", re.M)       # (no string in these scripts holds a `--`)
_LOCAL_FN = re.compile(r"^local\s+function\s+([A-Za-z_][A-Za-z0-9_]*)")
_LOCAL_VARS = re.compile(r"^local\s+([A-Za-z_][A-Za-z0-9_,\s]*?)\s*=")


def _chunks(lib: str) -> list[tuple[set[str], str]]:
    """The top-level statements of a helper file, each with the comment lines before it, and the
    local names each defines. A statement starts at column 0; an indented line, an `end` or a `for`
    at column 0 continues the one before (a `for` fills the table defined before it: `DECLARED`)."""
    out: list[tuple[set[str], list[str]]] = []
    pending: list[str] = []            # comment and blank lines at column 0: they go with the next statement
    for line in lib.splitlines():
        if not line.strip() or line.startswith("--"):
            pending.append(line)
            continue
        if out and (line[0].isspace() or line.startswith(("end", "for "))):
            out[-1][1].extend([*pending, line])
        else:
            fn, var = _LOCAL_FN.match(line), _LOCAL_VARS.match(line)
            names = {fn.group(1)} if fn else ({v.strip() for v in var.group(1).split(",")} if var else set())
            out.append((names, [*pending, line]))
        pending = []
    if pending and out:
        out[-1][1].extend(pending)
    return [(names, "\n".join(lines)) for names, lines in out]


def _names(code: str) -> set[str]:
    return set(_NAME.findall(_COMMENT.sub("", code)))


def _shaken(lib: str, body: str) -> str:
    """`lib` with only the statements `body` uses, directly or through another kept statement.
    Every script runs its whole text on each call, and on this machine a cold call pays for every
    line of it (bench/notes.md, round 6): a script does not carry the helpers it never calls.
    A statement that defines no name (a bare loop, an assignment to a global) is always kept."""
    chunks = _chunks(lib)
    wanted = _names(body)
    keep = [False] * len(chunks)
    changed = True
    while changed:
        changed = False
        for i in range(len(chunks) - 1, -1, -1):
            names, text = chunks[i]
            if not keep[i] and (not names or names & wanted):
                keep[i] = changed = True
                wanted |= _names(text)
    return "\n".join(text for (names, text), k in zip(chunks, keep) if k) + "\n"


def _load(name: str) -> Script:
    raw = (LUA_DIR / f"{name}.lua").read_text()
    parts, body = [], []
    for line in raw.splitlines():
        if line.startswith("--@include "):
            parts.append(("lib", line.split(maxsplit=1)[1].strip()))
        else:
            parts.append(("line", line))
            body.append(line)
    text = "\n".join(body)
    source = "\n".join(_shaken(_read(x), text).rstrip("\n") if kind == "lib" else x for kind, x in parts) + "\n"
    return Script(name=name, source=source, sha=hashlib.sha1(source.encode()).hexdigest())


SCRIPTS: dict[str, Script] = {name: _load(name) for name in SCRIPT_NAMES}


def evalsha_args(name: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
    """The raw EVALSHA command for one script call (for pipelines and batchers): used by
    `omniflow.storage.transitions` only, which builds every script's KEYS."""
    return SCRIPTS[name].evalsha(keys, args)


