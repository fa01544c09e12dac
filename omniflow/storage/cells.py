"""Cells: how workflows are spread over the primaries of a Redis Cluster.

A *cell* is a group of workflows whose keys — records, logs, edge logs, outputs, task streams,
the event stream, the in-flight and retry sets, tombstones, idempotency keys, inboxes — share
one hash tag, so every Lua transition touches one slot. A deployment has `cells` of them (one on
a single Redis by default, `DEFAULT_CLUSTER_CELLS` on a cluster); a workflow id carries its cell
(`<cell>-<hex>`; a plain hex id is in cell 0), so any process finds a workflow's keys from its id.

Each cell's hash tag is chosen so that its slot lands at an even spot of the slot space: cell `c`
sits near slot `16384 * r(c)`, where `r` is the base-2 radical inverse (0, 1/2, 1/4, 3/4, 1/8,
…). Any power-of-two number of cells is then spread exactly evenly over the slot space (and any
other count nearly so), whatever the number of primaries, and a cell's tag never depends on how
many cells there are: adding cells later leaves the existing ones where they are.
"""
from __future__ import annotations

import binascii
import itertools
import math
import os
import random
from functools import lru_cache

CLUSTER_SLOTS = 16384
DEFAULT_CLUSTER_CELLS = 16
MAX_CELLS = 1024
# a tag's slot must fall in [target, target + window): a few hundred tries per cell, once
TAG_SLOT_WINDOW = 16


def key_slot(tag: str) -> int:
    """The cluster slot of a hash tag's content (Redis's CRC16-XMODEM mod 16384)."""
    return binascii.crc_hqx(tag.encode(), 0) % CLUSTER_SLOTS


def radical_inverse(n: int) -> float:
    """n's binary digits mirrored behind the point: 0, 1/2, 1/4, 3/4, 1/8, 5/8, …"""
    out, scale = 0.0, 0.5
    while n:
        if n & 1:
            out += scale
        n >>= 1
        scale /= 2
    return out


@lru_cache(maxsize=MAX_CELLS)
def cell_tag(cell: int) -> str:
    """The hash tag content of a cell (`c<cell>.<n>`), its slot near the cell's even spot."""
    if not 0 <= cell < MAX_CELLS:
        raise ValueError(f"cell {cell} out of range 0..{MAX_CELLS - 1}")
    target = math.floor(radical_inverse(cell) * CLUSTER_SLOTS)
    for n in itertools.count():
        tag = f"c{cell}.{n}"
        if 0 <= key_slot(tag) - target < TAG_SLOT_WINDOW:
            return tag
    raise AssertionError("unreachable")


def cell_of(wf_id: str) -> int:
    """The cell a workflow id carries (`<cell>-<hex>`), 0 for an id without one."""
    head, sep, _ = wf_id.partition("-")
    if sep and head.isdigit() and len(head) <= 4:
        return int(head)
    return 0


#: random bits of a new workflow id: 80, as 20 hex digits. An id is in every key of its workflow
#: and in most arguments of its transitions (about 55 times in the bytes a toy workflow sends to
#: Redis): 12 digits fewer than a uuid4's 32 are ~650 bytes per workflow (bench/notes.md, round 9).
#: Two ids drawn alike need ~10^12 workflows for even odds, and a submit refuses an id that is
#: taken or retired (`SubmitResult.EXISTS`/`RETIRED`, never an overwrite); ids of before (32 hex)
#: stay valid: an id is opaque past its cell.
ID_BYTES = 10


def new_id(cell: int) -> str:
    """A fresh workflow id in `cell` (plain hex in cell 0, as ids were before cells)."""
    h = os.urandom(ID_BYTES).hex()
    return f"{cell}-{h}" if cell else h


def cell_for_key(*parts: str, cells: int) -> int:
    """The cell of an idempotency key: fixed by the key, so a repeated request finds its workflow."""
    return binascii.crc32("\x00".join(parts).encode()) % cells


def pick_cell(cells: int, rng: random.Random | None = None) -> int:
    """A cell for a new workflow without an idempotency key: uniform, so cells fill evenly."""
    return (rng or random).randrange(cells)


def cell_limit(max_in_flight: int, cells: int, cell: int) -> int:
    """Admission limit of one cell: the global limit split so that the cells' limits add up to it
    exactly (the first `max_in_flight % cells` cells take one more). The total in flight never
    exceeds `max_in_flight`; a submit may be refused while another cell still has room."""
    return max_in_flight // cells + (1 if cell < max_in_flight % cells else 0)
