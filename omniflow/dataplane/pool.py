"""A producer's arenas: the slots its shared-memory payloads are copied into.

Up to `pool_bytes` of arenas (`omniflow.dataplane.arena`), made as they are first needed and kept
mapped for the producer's life; a payload takes a slot of the first arena with room for it. An
arena unlinked or cut short under its live producer (a sweep that took it for dead, a truncation)
is never written again. An arena that finds no room in the directory for its pages (a full
/dev/shm) ends the search, so no new arena is made in a full directory, and goes if it holds
nothing: a full /dev/shm keeps no empty arena of ours.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from omniflow.dataplane import arena as arenas
from omniflow.dataplane import codec
from omniflow.dataplane.ownership import arena_name

logger = logging.getLogger(__name__)


class ArenaPool:
    """The arenas of one producer, and the slot a payload goes to."""

    def __init__(self, directory: Path, prefix: str, worker_id: str, *, pool_bytes: int, arena_bytes: int,
                 on_refusal: Callable[[str], None]) -> None:
        self.directory, self.prefix, self.worker_id = directory, prefix, worker_id
        self.pool_bytes = pool_bytes                  # what the arenas may hold in all
        self.arena_bytes = min(arena_bytes, pool_bytes)
        self.arenas: list[arenas.Arena] = []
        self.lock = threading.Lock()
        self._index = 0
        self._on_refusal = on_refusal                 # an arena the directory could not take (why)

    def put(self, frame: codec.Frame, wf_id: str, expiry_ms: int) -> tuple[str, int, int] | None:
        """Copy `frame` into a slot: (arena, slot, generation); None when no arena can take it (too
        large to share one, every arena full, or no room in the directory)."""
        if self.arena_bytes <= 0 or frame.nbytes > self.arena_bytes // 2:
            return None                  # none, or too large to share one: a segment of its own
        for arena in self._arenas_for():
            with arena.lock:
                spot = arena.reserve(frame.nbytes, wf_id, expiry_ms)
                starved = arena.starved
                if spot is None and starved is not None and not arena.held:
                    arena.retired = True
            if spot is None:
                if starved is None:
                    continue             # full of payloads: the next arena
                if arena.retired:
                    self._drop(arena)
                return None
            slot, offset, gen = spot
            try:
                arena.write(offset, frame)
            except BaseException:
                with arena.lock:
                    arena.forget(slot)
                raise
            with arena.lock:
                arena.publish(slot, gen, offset, frame.nbytes, expiry_ms)
            return arena.name, slot, gen
        return None

    def _drop(self, arena: arenas.Arena) -> None:
        """Take an arena out of use and unlink it (unmapped once no thread uses it any more: not closed)."""
        with self.lock:
            if arena in self.arenas:
                self.arenas.remove(arena)
        try:
            os.unlink(arena.path)
        except FileNotFoundError:
            pass

    def _arenas_for(self) -> Iterator[arenas.Arena]:
        """Our arenas, then a new one while the pool has room for it."""
        with self.lock:
            gone = [a for a in self.arenas if not a.linked()]
            current = [a for a in self.arenas if a not in gone]
        for arena in gone:               # unlinked or cut short under us: never write there again
            logger.warning("arena %s was removed or cut short under its live producer; starting another", arena.name)
            self._drop(arena)            # cut short: what it held is lost (its consumers regenerate it)
        yield from current
        with self.lock:
            if sum(a.size for a in self.arenas) + self.arena_bytes > self.pool_bytes:
                return
            new = self._new_arena()
        if new is not None:
            yield new

    def _new_arena(self) -> arenas.Arena | None:
        while True:
            self._index += 1
            name = arena_name(self.prefix, self.worker_id, self._index)
            try:
                arena = arenas.Arena(os.path.join(self.directory, name), name, self.arena_bytes)
            except FileExistsError:
                continue                 # left by an earlier process of the same id: not ours to reuse
            except OSError as exc:       # /dev/shm full or too small: segments of their own (or Redis) then
                self._on_refusal(f"cannot create a {self.arena_bytes}-byte arena in {self.directory}: {exc}")
                return None
            self.arenas.append(arena)
            return arena

    def close(self) -> int:
        """Unmap every arena; unlink those nothing in use is left in (the others stay for their
        consumers). Returns how many went."""
        with self.lock:
            mine, self.arenas = self.arenas, []
        gone = 0
        for arena in mine:
            with arena.lock:
                arena.reclaim(force=True)
                empty = not arena.held
                arena.close(unlink=empty)
            gone += int(empty)
        return gone
