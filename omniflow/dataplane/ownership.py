"""Who owns a file of ours in /dev/shm, and when the sweep may free it.

Every shared-memory file omniflow creates is named after its owner, so any process on the host
can release or sweep it without asking anyone:

- an arena (`omniflow.dataplane.arena`): `of-<prefix>-<worker>-arena-<n>`; each slot's frame header
  names the workflow, stages, attempt and step of the payload in it;
- a segment of its own (a payload too large for an arena): `of-<prefix>-<worker>-<wf>-<src>.<dst>-<attempt>.<seq>`.

Each part is reduced to `[A-Za-z0-9_]` (the frame header keeps the exact owner). `sweep_verdict`
is the pure rule the sweep applies to one payload.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from omniflow.dataplane import codec
from omniflow.dataplane.base import PutContext

DEFAULT_SHM_DIR = Path("/dev/shm")
NAMESPACE = "of"                 # every file name starts with "of-<prefix>-"
_PART = re.compile(r"[^A-Za-z0-9_]")
_NAME = re.compile(r"^of-(?P<prefix>\w+)-(?P<worker>\w+)-(?P<wf>\w+)-(?P<src>\w+)\.(?P<dst>\w+)"
                   r"-(?P<attempt>\d{1,9})\.(?P<seq>\d{1,12})$", re.ASCII)
_ARENA = re.compile(r"^of-(?P<prefix>\w+)-(?P<worker>\w+)-arena-(?P<index>\d{1,9})$", re.ASCII)


def name_part(value: str) -> str:
    """One part of a file name: `[A-Za-z0-9_]`, at most 64 characters, never empty."""
    return _PART.sub("_", value)[:64] or "_"


def segment_name(ctx: PutContext) -> str:
    return (f"{NAMESPACE}-{name_part(ctx.prefix)}-{name_part(ctx.worker_id)}-{name_part(ctx.wf_id)}-"
            f"{name_part(ctx.src)}.{name_part(ctx.dst)}-{int(ctx.attempt)}.{int(ctx.seq)}")


def arena_name(prefix: str, worker_id: str, index: int) -> str:
    return f"{NAMESPACE}-{name_part(prefix)}-{name_part(worker_id)}-arena-{int(index)}"


@dataclass(frozen=True, slots=True)
class Segment:
    """A payload of ours in the shared-memory directory, as its name (and, in an arena, its slot's
    header) attributes it. For an arena slot `name` is the arena's file."""

    name: str
    prefix: str
    worker: str
    wf_id: str
    src: str
    dst: str
    attempt: int
    seq: int


@dataclass(frozen=True, slots=True)
class ArenaFile:
    """An arena of ours in the shared-memory directory: its producer, and its number."""

    name: str
    prefix: str
    worker: str
    index: int


def parse_name(name: str) -> Segment | None:
    """The owner parts of a segment name, or None if it is not one of ours."""
    m = _NAME.match(name)
    if m is None:
        return None
    return Segment(name, m["prefix"], m["worker"], m["wf"], m["src"], m["dst"], int(m["attempt"]), int(m["seq"]))


def parse_arena(name: str) -> ArenaFile | None:
    """The owner parts of an arena's name, or None if it is not one of ours."""
    m = _ARENA.match(name)
    return None if m is None else ArenaFile(name, m["prefix"], m["worker"], int(m["index"]))


def shm_domain(directory: Path = DEFAULT_SHM_DIR, host_id: str | None = None) -> str:
    """Who can read this host's segments: the host id (`OMNIFLOW_HOST_ID`, default the host name),
    boot id and the device of the shm mount (two containers on one machine with their own /dev/shm
    get different domains; two "hosts" given different ids never share memory)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "noboot"
    try:
        dev = os.stat(directory).st_dev
    except OSError:
        dev = 0
    return f"{host_id or socket.gethostname()}:{boot}:{dev}"


def shm_available(directory: Path = DEFAULT_SHM_DIR) -> bool:
    """True where segments can be created (a writable tmpfs directory, e.g. Linux /dev/shm)."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK)


class SweepReason(str, Enum):
    """Why the sweep freed a payload."""

    EXPIRED = "expired"          # past its TTL (from its header)
    ENDED = "ended"              # its workflow is terminal or gone
    ORPHAN = "orphan"            # half-written (or an empty arena), and its worker is dead


@dataclass(frozen=True, slots=True)
class Found:
    """A payload of ours and what its header says (None: no readable header, e.g. half-written).

    `slot` is its slot when it lives in an arena (`segment.name` is then the arena), -1 for a
    segment of its own; an arena with nothing in use is listed once with slot -1 and no header."""

    segment: Segment
    info: codec.FrameInfo | None
    free: bool = False           # a segment handed back by its consumer (written by older versions)
    slot: int = -1
    arena: bool = False
    short: bool = False          # a segment shorter than the frame its header describes (half-written)

    @property
    def wf_id(self) -> str:
        """The exact workflow id (from the header; the name holds a reduced form)."""
        owner = self.info.owner if self.info else []
        return str(owner[0]) if owner else self.segment.wf_id


def sweep_verdict(found: Found, *, now_ms: int, live_wfs: set[str] | None,
                  live_workers: set[str] | None) -> SweepReason | None:
    """Whether the sweep frees one payload (a pure function). `live_wfs` None: unknown (not tested);
    `live_workers` None: unknown. A live workflow's payload stays even when its producer died: the
    consumer, or its retry, replays it from the edge log."""
    if found.info is not None and found.info.expiry_ms <= now_ms:
        return SweepReason.EXPIRED
    if live_wfs is not None and found.wf_id not in live_wfs and not (found.arena and found.info is None):
        return SweepReason.ENDED
    # half-written, or handed back, by a producer that is gone: nobody will finish or reuse it (and no
    # reference to a half-written one exists: a reference is written once its payload is)
    if (found.info is None or found.free or found.short) and live_workers is not None and \
            found.segment.worker not in {name_part(w) for w in live_workers}:
        return SweepReason.ORPHAN
    return None
