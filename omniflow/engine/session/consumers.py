"""Which replicas consume which stage: what a producer declares so its emits may forward chunks to
the consuming sessions' inboxes (every key a script touches is in its KEYS, the inbox included).

A worker keeps one book for all its sessions. It learns a replica when an `emit.lua` call is
refused because the stage it forwards to is bound to a replica whose inbox the call did not
declare (the call wrote nothing and is sent again, declaring it); from then on every session of
the worker declares that inbox for that stage and cell, so in steady state no call is refused. The
book keeps the last few replicas per stage and cell: declaring a gone replica's inbox costs a few
bytes, nothing else (a key is written only when the stage is bound to it).
"""
from __future__ import annotations

from collections.abc import Sequence

DEFAULT_PER_STAGE = 8


class Consumers:
    """(stage, cell) -> the replicas seen consuming it, most recent last."""

    def __init__(self, *, per_stage: int = DEFAULT_PER_STAGE) -> None:
        self._seen: dict[tuple[str, int], list[str]] = {}
        self._per_stage = per_stage
        self.version = 0            # bumped on every change: sessions rebuild their KEYS

    def learn(self, stage: str, cell: int, replica: str) -> None:
        seen = self._seen.setdefault((stage, cell), [])
        if replica in seen:
            return
        seen.append(replica)
        del seen[:-self._per_stage]
        self.version += 1

    def of(self, stages: Sequence[str], cell: int) -> dict[str, tuple[str, ...]]:
        """The replicas known to consume each of `stages` in `cell`."""
        return {st: tuple(self._seen.get((st, cell), ())) for st in stages}
