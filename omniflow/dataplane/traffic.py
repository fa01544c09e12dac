"""What a process's data plane sent, per producing stage and transport: chunk payloads and their
bytes. Workers publish it with their heartbeat (field `serving`); `/metrics` exposes it as
`omniflow_dataplane_chunks_total` / `omniflow_dataplane_bytes_total{stage,transport}`.

Counting costs two integer additions per payload, on the thread that encodes it: a stage's payloads
are all encoded on one thread (its compute thread, or the worker's loop), so each stage's counters
have one writer and need no lock.
"""
from __future__ import annotations

from omniflow.dataplane.base import TransportKind

#: each kind's name as the counters store it (`kind.value` is a descriptor call per payload; a str
#: enum hashes as its str, so this lookup is one dict probe)
_NAME = {kind: kind.value for kind in TransportKind}


class Traffic:
    """Chunk payloads sent and their bytes, by stage and transport (monotonic counters)."""

    def __init__(self) -> None:
        self._counts: dict[str, dict[str, list[int]]] = {}     # stage -> transport -> [chunks, bytes]

    def sent(self, stage: str, kind: TransportKind, nbytes: int) -> None:
        """One payload of `nbytes` went out through `kind` (inline: its encoded size in the entry)."""
        per_stage = self._counts.get(stage)
        if per_stage is None:
            per_stage = self._counts.setdefault(stage, {})
        name = _NAME[kind]
        counts = per_stage.get(name)
        if counts is None:
            counts = per_stage.setdefault(name, [0, 0])
        counts[0] += 1
        counts[1] += nbytes

    def snapshot(self) -> dict[str, dict[str, list[int]]]:
        """stage -> transport -> [chunks, bytes] (a copy, JSON-ready)."""
        return {stage: {kind: list(counts) for kind, counts in list(per.items())}
                for stage, per in list(self._counts.items())}
