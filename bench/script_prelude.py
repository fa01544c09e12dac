"""What a script's helpers cost per call: sent by EVALSHA (the whole text runs on every call) against
a function of a loaded library (`omniflow/storage/scripts.py`: the helpers are built at the first call).

For each script, the helpers it includes from `_lib.lua` followed by `return 1` (so only the prelude
runs, no command), both ways, and a bare `return 1` by EVALSHA as the floor; Valkey's own time per call
(INFO commandstats `usec_per_call`), back to back and with a 5 ms pause between calls (an idle server:
every call cold). Rounds interleave the three ways.

    .venv/bin/python bench/script_prelude.py [--calls 400] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import redis_client, start_server
from omniflow.storage import scripts

SCRIPTS = ("emit", "claim", "submit")


def prelude_only(name: str) -> tuple[str, str]:
    """(EVAL text, library text) of `name`'s helpers followed by `return 1`."""
    body = "\n".join(line for line in (scripts.LUA_DIR / f"{name}.lua").read_text().splitlines()
                     if not line.startswith(("--@include ", "#!")))
    helpers = scripts._shaken(scripts._read("_lib.lua"), body)
    once, per_call = scripts._split_helpers(helpers)      # as the library builds it (scripts.function_text)
    library = (f"#!lua name=prelude_{name}\nlocal KEYS, ARGV\n"
               + scripts.function_text(name, f"prelude_{name}", once, [*per_call, "return 1"], []))
    return helpers + "\nreturn 1\n", library


def per_call_us(r: object, command: list[object], calls: int, pause_s: float) -> float:
    r.config_resetstat()
    for _ in range(calls):
        r.execute_command(*command)
        if pause_s:
            time.sleep(pause_s)
    stats = r.info("commandstats")
    return float(stats[f"cmdstat_{str(command[0]).lower()}"]["usec_per_call"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with start_server() as server:
        r = redis_client(server.url)
        floor = r.script_load("return 1\n")
        ways: dict[str, list[object]] = {}
        for name in SCRIPTS:
            text, library = prelude_only(name)
            r.function_load(library, replace=True)
            ways[f"{name}: EVALSHA"] = ["EVALSHA", r.script_load(text), 1, "k"]
            ways[f"{name}: FCALL"] = ["FCALL", f"prelude_{name}", 1, "k"]
        ways["return 1: EVALSHA"] = ["EVALSHA", floor, 1, "k"]
        hot: dict[str, list[float]] = {way: [] for way in ways}
        cold: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.rounds):
            for way, command in ways.items():
                hot[way].append(per_call_us(r, command, args.calls, 0))
                cold[way].append(per_call_us(r, command, args.calls // 4, 0.005))
        print(f"{'µs per call (Valkey)':<24} {'back to back':>14} {'5 ms apart':>12}   (median of {args.rounds} rounds)")
        for way in ways:
            print(f"{way:<24} {statistics.median(hot[way]):>14.1f} {statistics.median(cold[way]):>12.1f}")


if __name__ == "__main__":
    main()
