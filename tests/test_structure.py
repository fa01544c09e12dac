"""The shape of the package, checked from its source (no Redis): no import cycle, the layers
import only downward, every Lua script's KEYS come from `Keys` and its return codes match its
enum, and no engine module grows past the size a reader can hold."""
from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omniflow.models import WorkflowState
from omniflow.storage import transitions
from omniflow.storage.keys import FinalizePlan, Keys
from omniflow.storage.scripts import LUA_DIR, SCRIPT_NAMES
from omniflow.storage.transitions import (admission, emit, housekeeping, inputs, listing, realtime, reconcile,
                                          sessions)

ROOT = Path(__file__).resolve().parent.parent
#: the source folders of the installed package `omniflow` (api/ and workers/ install as omniflow.api, .workers)
SOURCES = {"omniflow": ROOT / "omniflow", "omniflow.api": ROOT / "api", "omniflow.workers": ROOT / "workers"}
ENGINE_MODULE_MAX_LINES = 450

#: layer -> the layers it must never import (DESIGN: storage is the bottom, the engine sits on it,
#: the client beside the engine, the API and the operator tools on top)
FORBIDDEN = {
    "omniflow.storage": ("omniflow.engine", "omniflow.api", "omniflow.client", "omniflow.jobs", "omniflow.ops",
                         "omniflow.cli", "omniflow.workers"),
    "omniflow.engine": ("omniflow.api", "omniflow.client", "omniflow.cli", "omniflow.ops", "omniflow.jobs"),
    "omniflow.dataplane": ("omniflow.engine", "omniflow.api", "omniflow.client", "omniflow.cli"),
    "omniflow.executor": ("omniflow.engine", "omniflow.api", "omniflow.client", "omniflow.storage"),
}


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((prefix, *parts)) if parts else prefix] = path
    return found


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports, anywhere in it (inside functions too), except under
    `if TYPE_CHECKING:` (never executed). `from a import b` is module `a.b` when there is one, else `a`."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        out |= {t for t in targets if t in known and t != name}
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle_through_an_import_inside_a_function(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import omniflow.b\n")
    (tmp_path / "b.py").write_text("def f():\n    from omniflow import a\n")
    known = {"omniflow.a": tmp_path / "a.py", "omniflow.b": tmp_path / "b.py"}
    edges = {name: imports_of(name, path, known) for name, path in known.items()}
    assert cycles(edges) == [["omniflow.a", "omniflow.b"]]


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles (imports inside functions included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_layers_import_only_downward() -> None:
    wrong = [f"{name} imports {dep}" for name, deps in graph().items() for layer, banned in FORBIDDEN.items()
             if name == layer or name.startswith(layer + ".") for dep in deps
             if any(dep == b or dep.startswith(b + ".") for b in banned)]
    assert not wrong, "\n".join(sorted(wrong))


def test_redis_py_is_imported_by_five_modules_at_most() -> None:
    importers = sorted(name for name, path in modules().items()
                       if re.search(r"^\s*(from redis(\.| )|import redis\b)", path.read_text(), re.M))
    assert importers == ["omniflow.ops.embedded", "omniflow.ops.embedded_ha", "omniflow.storage.client",
                         "omniflow.storage.resp", "omniflow.storage.topology"]


def test_no_engine_module_is_over_the_limit() -> None:
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "omniflow" / "engine").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > ENGINE_MODULE_MAX_LINES}
    assert not long, f"engine modules over {ENGINE_MODULE_MAX_LINES} lines: {long}"


# ---------------------------------------------------------------- scripts: KEYS and return codes
def test_only_the_transitions_build_script_calls() -> None:
    """KEYS lists are built in `omniflow.storage.transitions` only: nothing else names the raw builders."""
    builders = {"script_args", "script_call", "fcall"}
    allowed = ("omniflow.storage.transitions", "omniflow.storage.scripts", "omniflow.storage.client", "omniflow.storage.runner",
               "omniflow.storage.redisio")
    wrong = []
    for name, path in modules().items():
        if name.startswith(allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Name, ast.Attribute)) and (getattr(node, "id", None) or getattr(node, "attr", None)) in builders:
                wrong.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value in ("FCALL", "EVALSHA"):
                wrong.append(f"{name}:{node.lineno}")
    assert not wrong, wrong


#: writes the engine's daemons send with RedisClient's own methods (or a pipeline of it) instead of
#: the runner (`redisio.execute` / `call`, the batcher): they skip `require_replicas`' WAIT, so each
#: must be one a later sweep or audit does again if a failover loses it (docs/reliability.md)
DIRECT_WRITES_ALLOWED = {
    # the orphan audit finds them again; a drain's hand-back left pending here is re-queued at the stop
    "omniflow.engine.worker.intake": {"xclaim", "xack", "xadd", "xdel"},
    "omniflow.engine.worker.liveness": {"zrem"},               # leaving the loading set: swept when it lapses
    "omniflow.engine.worker.worker": {"zadd", "delete"},      # deregistering at the stop: else the lease lapses
    # the sweeps (the next one does them again) and the events' XAUTOCLAIM (a reconciler's own pending list)
    "omniflow.engine.reconciler.sweeps": {"xack", "zrem", "delete", "xadd", "xautoclaim"},
}
WRITE_METHODS = {"xadd", "xack", "xclaim", "xautoclaim", "xdel", "xtrim", "zadd", "zrem", "hset", "hsetnx", "hdel",
                 "hincrby", "set", "delete", "unlink", "expire", "pexpire", "sadd", "srem", "lpush", "rpush", "incr",
                 "incrby", "execute_command"}


def test_the_daemons_write_through_the_runner() -> None:
    """A write the engine sends outside the runner skips the replication WAIT: only the listed ones may."""
    wrong = []
    for name, path in modules().items():
        if not name.startswith("omniflow.engine"):
            continue
        tree = ast.parse(path.read_text())
        pipes = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                 and isinstance(node.value.func, ast.Attribute) and node.value.func.attr == "pipeline"
                 and ast.unparse(node.value.func.value).endswith("redis")
                 for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in WRITE_METHODS:
                target = ast.unparse(node.func.value)
                if (target.endswith("redis") or target in pipes) and \
                        node.func.attr not in DIRECT_WRITES_ALLOWED.get(name, set()):
                    wrong.append(f"{name}:{node.lineno} {target}.{node.func.attr}")
    assert not wrong, wrong


KEY_PARTS = re.compile(r":(wf|stages|log|done|edge|out|blob|blobs|inbox|tasks|tomb|idem|idx|rd|ckpt|attempt|replica)\b")


def test_key_names_are_built_in_keys_only() -> None:
    """No f-string outside `Keys` (and the stage-hash field names outside `schema`) spells a piece of
    the key layout."""
    allowed = {"omniflow.storage.keys", "omniflow.storage.schema"}
    wrong = []
    for name, path in modules().items():
        if name in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
                if KEY_PARTS.search(text):
                    wrong.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not wrong, "\n".join(wrong)


class RecordingKeys(Keys):
    """`Keys` that remembers every name it made."""

    made: set[str]

    def __getattribute__(self, attr: str) -> Any:
        value = super().__getattribute__(attr)
        if attr.startswith("_") or attr in ("made", "prefix", "cells"):
            return value
        made = object.__getattribute__(self, "made")

        def remember(result: Any) -> Any:
            if isinstance(result, str):
                made.add(result)
            elif isinstance(result, list):
                made.update(r for r in result if isinstance(r, str))
            return result

        if callable(value):
            return lambda *a, **kw: remember(value(*a, **kw))
        return remember(value)


def recording_keys() -> RecordingKeys:
    keys = RecordingKeys("t", 4)
    object.__setattr__(keys, "made", set())
    return keys


WF = "0a1b2c3d"       # any id: its cell is its first hex digit modulo the cells
PLAN = FinalizePlan(finals=("talker",), edges=(("thinker", "talker"),))


def script_calls(keys: Keys) -> Iterator[tuple[str, tuple[Any, ...]]]:
    """One call of every transition that builds a script call, with plausible arguments."""
    yield "submit", admission.submit(keys, WF, tenant="acme", request_id="r1", admit=("thinker", "talker"), now_ms=1,
                                     deadline_ms=2, cell_limit=3, idempotency_ttl_s=4, stages_csv="thinker,talker",
                                     admit_csv="thinker,talker", record=["tenant", "acme"])
    yield "abort", admission.abort(keys, PLAN, WF, now_ms=1, state=WorkflowState.ABORTED, reason="x", stage="",
                                   tombstone_ttl_s=1, result_ttl_s=1)
    yield "claim", sessions.claim(keys, "talker", ("thinker",), 0, [("1-0", WF, 1)], worker_id="w", now_ms=1)
    yield "claim", sessions.claim_groups(keys, [sessions.ClaimGroup("thinker", (), 0, [("1-0", WF, 1)]),
                                                sessions.ClaimGroup("talker", ("thinker",), 0, [("1-1", WF, 1)])],
                                         worker_id="w", now_ms=1, legacy={WF})
    yield "restart", sessions.restart(keys, WF, "thinker", attempt=1, below=("talker",), edges=[("thinker", "talker")],
                                      requeued=("talker",), now_ms=1, regenerate=("talker", 1, 3, "why"))
    yield "heartbeat", sessions.heartbeat(keys, "w", loading=False, expiry_ms=1, info_ttl_s=1, info={"a": 1})
    base = emit.emit_keys(keys, WF, "thinker", ("talker",))
    blob = keys.blob(WF, "thinker", "talker", 1, 1)
    yield "emit", emit.emit(base, WF, "thinker", 1, status="", now_ms=1, steps=[[1, "B", blob, [b"x", 10]]],
                            finish=([keys.tasks("thinker", 0), keys.events(0), keys.usage(0, 1)], b""))
    yield "finish", emit.finish(keys, WF, "thinker", 1, entry_id="1-0", outcome="done", detail="{}", retryable=True,
                                now_ms=1, seq=0, downstream=("talker",))
    yield "stage_event", reconcile.stage_event(keys, PLAN, ("thinker", "talker"), WF, "thinker", "done", 1, now_ms=1,
                                               detail="", retryable=True, max_attempts=3, due_ms=1, tombstone_ttl_s=1,
                                               result_ttl_s=1, dlq_max_len=10)
    yield "retry_due", reconcile.retry_due(keys, WF, "thinker", 2, f"{WF}|thinker|2")
    yield "dead_letter", reconcile.dead_letter(keys.dlq("thinker", 0), keys.tasks("thinker", 0), "workers", "1-0",
                                               None, "why", max_len=10)
    yield "reap_consumer", housekeeping.reap_consumer(keys.events(0), "reconciler", "c")
    yield "lease", housekeeping.leader_lease(keys, "r", ttl_ms=1)
    yield "trim_tasks", housekeeping.trim_tasks(keys.task_streams("thinker", 0))
    yield "purge", housekeeping.purge(keys, WF, tenant="acme", request_id="r1", finals=("talker",))
    yield "list_scan", listing.list_scan(keys, [WF], want=1, state="", tenant=None, stage="", request_id="")
    yield "append_input", inputs.append_input(keys, WF, "asr", final=True, payloads=[b"x"], inboxes=("w",))
    yield "realtime_save", realtime.realtime_save(keys, "s1", mode="create", owner="c", state="{}", ttl_s=1,
                                                  tenant="acme")


def test_every_script_has_a_transition_and_its_keys_come_from_keys() -> None:
    keys = recording_keys()
    seen = set()
    for name, call in script_calls(keys):
        seen.add(name)
        assert call[0] == "FCALL"
        nkeys = call[2]
        declared = call[3:3 + nkeys]
        foreign = [k for k in declared if k not in keys.made]
        assert not foreign, f"{name}: KEYS not made by Keys: {foreign}"
    assert seen == set(SCRIPT_NAMES)


def test_every_transition_function_is_exercised() -> None:
    """A new transition function that builds a call must join `script_calls` (and so the KEYS check)."""
    src = inspect.getsource(script_calls)
    for module in (admission, sessions, emit, reconcile, housekeeping, listing, realtime):
        for fname, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ == module.__name__ and "script_call(" in inspect.getsource(fn):
                assert f"{module.__name__.rsplit('.', 1)[1]}.{fname}(" in src, f"{module.__name__}.{fname}"


def _header(name: str) -> list[str]:
    lines = []
    for line in (LUA_DIR / f"{name}.lua").read_text().splitlines():
        if line.startswith("#!"):
            continue
        if not line.startswith("--") or line.startswith("--@include"):
            break
        lines.append(line)
    return lines


def declared_codes(name: str) -> set[str]:
    """The codes a script's header says it returns (from its `Returns` line to the end of the header)."""
    header = _header(name)
    start = next(i for i, line in enumerate(header) if "Returns" in line)
    text = "\n".join(header[start:])
    if re.search(r"Returns \d", text):        # an integer reply
        return {n for pair in re.findall(r"Returns (\d+)|(\d+) when", text) for n in pair if n}
    return set(re.findall(r"'([a-z_]+)'", text))


def returned_codes(name: str) -> set[str]:
    """The code literals the script's own body returns (`return 'x'`, `return {'x', ...}`, `return 1`)."""
    body = (LUA_DIR / f"{name}.lua").read_text()
    return set(re.findall(r"return \{?'([a-z_]+)'", body)) | set(re.findall(r"return (\d+)\s*$", body, re.M))


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_each_scripts_return_codes_match_its_enum(name: str) -> None:
    enum = transitions.RETURN_CODES[name]
    if enum is None:            # answers data (heartbeat: the drain flag; list_scan: positions)
        assert not set(re.findall(r"return \{?'([a-z_]+)'", (LUA_DIR / f"{name}.lua").read_text()))
        return
    values = {str(m.value) for m in enum}
    assert declared_codes(name) == values, f"{name}.lua's header declares {declared_codes(name)}, its enum {values}"
    assert returned_codes(name) <= values, f"{name}.lua returns {returned_codes(name) - values}, not in its enum"
