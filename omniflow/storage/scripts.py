"""The Lua script registry: every multi-key transition, in one function library, called by name.

Scripts live in `omniflow/storage/lua/*.lua`, each with a header listing KEYS, ARGV and
returns. A line `--@include NAME.lua` splices a shared helper file in (only the helpers the
script uses: `_shaken`). Each script's call (KEYS from `Keys`, ARGV, return codes) is one
function of `omniflow.storage.transitions`; running them (loading the library when the server
does not have it, error translation) is `omniflow.storage.runner`'s job.

All scripts are functions of ONE library (`FUNCTION LOAD`, Redis and Valkey 7 and newer), called
with `FCALL`. A script sent with EVALSHA runs its whole text on every call, its helpers included
(emit's: 8-10 µs of every call back to back, ~40 µs of a cold one on this machine: bench/notes.md,
round 7); a library runs each script's helpers once, at the first call after it is loaded:

    local KEYS, ARGV                  -- each call sets them
    local emit_impl
    local function emit_build()
      local type, tonumber, ... = type, tonumber, ...      -- GLOBALS: the globals the scripts use
      <emit's helpers: each `local function` as written; every other top-level statement of the
       helper file (a table, a constant, the DECLARED set) only declared here>
      return function()
        <those statements, as assignments: they run on every call, as they did in a script>
        <emit.lua's own text>
      end
    end
    redis.register_function{function_name = 'emit_<version>', callback = ..., flags = {...}}

So what a call sees is what a script saw: KEYS, ARGV and every table of the helper file are made
fresh by each call; only code lives on between calls (a helper may keep no state of its own in an
upvalue: `test_lua.py` checks a second call sees none of the first). A script's `#!lua flags=...`
line becomes its function's flags (`list_scan`'s `no-writes`, `heartbeat`'s `allow-oom`); a script
without one gets none (a function that writes is refused as a whole under OOM, before it writes
anything: a script without flags was let run and failed at its first write that could grow memory).
The library's name and its functions' names carry a hash of its text (`omniflow_<version>`,
`emit_<version>`), so two versions of omniflow on one server (a rolling upgrade) each call their
own; an old version's library stays loaded until an operator deletes it (`omniflow scripts
--prune`, docs/operations.md).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LUA_DIR = Path(__file__).resolve().parent / "lua"
SCRIPT_NAMES = ("submit", "claim", "emit", "finish", "stage_event", "abort", "retry_due", "restart", "list_scan",
                "heartbeat", "dead_letter", "reap_consumer", "realtime_save", "lease", "purge", "append_input",
                "trim_tasks")


@dataclass(frozen=True)
class Script:
    name: str
    source: str          # its part of the library: the builder and the registration
    function: str        # its function name in the library (`<name>_<version>`)

    def fcall(self, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
        return ("FCALL", self.function, len(keys), *keys, *args)


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
_LOCAL_VARS = re.compile(r"^local\s+([A-Za-z_][A-Za-z0-9_,\s]*?)\s*(=|$)")    # `local a, b = ...` or `local a`
_FLAGS = re.compile(r"^#!lua\s+flags=([a-z,-]+)\s*$")


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


#: a comment line that makes the statement after it a constant: built once per library load, like a
#: `local function` (a table of names nothing ever writes to; `_check_const` refuses one a script writes)
CONST_MARK = "--@const"


def _const_names(text: str) -> set[str]:
    """The locals a `--@const` statement of `text` defines."""
    out: set[str] = set()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == CONST_MARK:
            m = _LOCAL_VARS.match(next(x for x in lines[i + 1:] if x.strip() and not x.startswith("--")))
            if m is None:
                raise ValueError(f"{CONST_MARK} must precede a `local NAME = ...` statement")
            out |= {v.strip() for v in m.group(1).split(",")}
    return out


def _check_const(names: set[str], code: str) -> None:
    """No statement writes into a constant (`NAME[...] =`, `NAME.x =`, `NAME =` other than where it is
    defined, `table.insert(NAME, ...)`): it is shared by every call."""
    lines = [line for line in _COMMENT.sub("", code).splitlines() if not re.match(r"\s*local\s", line)]
    stripped = "\n".join(lines)
    for name in names:
        if re.search(rf"(?<![\w.]){name}\s*(\[[^\]]*\]|\.\w+)?\s*=(?!=)", stripped) or \
                re.search(rf"table\.(insert|remove|sort)\(\s*{name}\b", stripped):
            raise ValueError(f"{name} is a {CONST_MARK} table and is written to")


def _split_helpers(lib: str) -> tuple[list[str], list[str]]:
    """A helper text's statements: those that run once per library load (each `local function`, each
    `--@const` statement, and a declaration of every other local) and those that run on every call
    (every other statement, its `local` dropped: `local T = {}` becomes `T = {}`)."""
    once: list[str] = []
    per_call: list[str] = []
    for _, text in _chunks(lib):
        lines = text.split("\n")
        code = [i for i, line in enumerate(lines) if line.strip() and not line.startswith("--")]
        if not code:
            once.append(text)
            continue
        head = lines[code[0]]
        if any(line.strip() == CONST_MARK for line in lines[:code[0]]):
            once.append(text)
            continue
        if _LOCAL_FN.match(head):
            if any(lines[i].startswith("for ") for i in code[1:]):
                raise ValueError(f"a loop at column 0 after `{head}`: it would run once per load, not per call")
            once.append(text)
            continue
        decl = _LOCAL_VARS.match(head)
        if decl:
            once.append(f"local {decl.group(1)}")
            lines[code[0]] = re.sub(r"^local\s+", "", head) if decl.group(2) == "=" else f"{decl.group(1)} = nil"
        per_call.append("\n".join(lines))
    return once, per_call


def _indent(text: str, by: str) -> str:
    return "\n".join(by + line if line.strip() else line for line in text.split("\n"))


def _builder(name: str) -> str:
    """The library text of one script: its builder and its registration (`{V}` stands for the
    library's version)."""
    raw = (LUA_DIR / f"{name}.lua").read_text()
    lines = raw.splitlines()
    flags: list[str] = []
    if lines and lines[0].startswith("#!"):
        m = _FLAGS.match(lines[0])
        if not m:
            raise ValueError(f"{name}.lua: a first line `#!lua flags=...` is the only shebang understood")
        flags = m.group(1).split(",")
        lines = lines[1:]
    body = [line for line in lines if not line.startswith("--@include ")]
    once: list[str] = []
    per_call: list[str] = []
    consts = _const_names("\n".join(body))
    const_next = False         # the script's own `--@const` statement (one line) goes to `once`
    for line in lines:
        if line.startswith("--@include "):
            text = _shaken(_read(line.split(maxsplit=1)[1].strip()), "\n".join(body))
            consts |= _const_names(text)
            o, p = _split_helpers(text)
            once += o
            per_call += p
        elif line.strip() == CONST_MARK:
            const_next = True
        elif const_next and line.strip() and not line.startswith("--"):
            once.append(line)
            const_next = False
        else:
            per_call.append(line)
    _check_const(consts, "\n".join([*per_call, *once]))
    return function_text(name, f"{name}_{{V}}", once, per_call, flags)


#: the globals the scripts use, made locals of each builder (it runs at a function's first call: at
#: load time a library sees none of them). A global is a lookup in the function's environment table on
#: every use, an upvalue is none: ~2 % of Valkey's instructions per workflow (bench/notes.md, round 19)
GLOBALS = "type, tonumber, tostring, unpack, pairs, ipairs, select, error, pcall, string, table, math, cmsgpack, cjson, redis"


def function_text(name: str, function: str, once: list[str], per_call: list[str], flags: list[str]) -> str:
    """One function of a library: `once` runs at its first call after the load, `per_call` (ending
    in what the call returns) on every call, with KEYS and ARGV set (the library declares them)."""
    flag_list = ", ".join(f"'{f}'" for f in flags)
    return "\n".join([
        f"-- ================================================================ {name}",
        f"local {name}_impl",
        f"local function {name}_build()",
        f"  local {GLOBALS} = {GLOBALS}",
        _indent("\n".join(once), "  "),
        "  return function()",
        _indent("\n".join(per_call), "    "),
        "  end",
        "end",
        f"redis.register_function{{function_name = '{function}', flags = {{{flag_list}}}, callback = function(keys, args)",
        "  KEYS, ARGV = keys, args",
        f"  if {name}_impl == nil then {name}_impl = {name}_build() end",
        f"  return {name}_impl()",
        "end}",
        "",
    ])


#: every omniflow library's name starts so (`omniflow scripts` lists them)
LIBRARY_PREFIX = "omniflow_"


def _library() -> tuple[str, str, dict[str, Script]]:
    parts = {name: _builder(name) for name in SCRIPT_NAMES}
    unversioned = "local KEYS, ARGV\n\n" + "\n".join(parts.values())
    version = hashlib.sha1(unversioned.encode()).hexdigest()[:12]
    lib_name = f"{LIBRARY_PREFIX}{version}"
    code = f"#!lua name={lib_name}\n" + unversioned.replace("{V}", version)
    scripts = {name: Script(name=name, source=parts[name].replace("{V}", version), function=f"{name}_{version}")
               for name in SCRIPT_NAMES}
    return lib_name, code, scripts


#: the library's name (`omniflow_<version>`) and its whole text (what FUNCTION LOAD is sent)
LIBRARY_NAME, LIBRARY, SCRIPTS = _library()


def script_args(name: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
    """The raw FCALL command for one script call (for pipelines and batchers): used by
    `omniflow.storage.transitions` only, which builds every script's KEYS."""
    return SCRIPTS[name].fcall(keys, args)
