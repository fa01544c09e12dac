"""Backpressure on one edge: a slow consumer bounds what its producer may have outstanding.

The producer counts the chunks (and their bytes) it wrote on an edge; the consumer reports how
far it has read (`<dst>:rd:<src>` in the workflow's stages hash: written with its own emits, or
every `report_every` chunks). When the next chunk would exceed the bound, the producer's emit
waits — on its event loop, polling the consumer's position with a growing interval — and the
time it waited is counted (worker stats, `/metrics`).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

DEFAULT_POLL_MIN_S = 0.002
DEFAULT_POLL_MAX_S = 0.05


@dataclass(slots=True)
class WaitStats:
    """How often and how long producers waited for their consumers."""

    waits: int = 0
    wait_s: float = 0.0
    peak_chunks: int = 0          # the most one producer had unread on one edge (as far as it knew)
    peak_bytes: int = 0

    def saw(self, window: EdgeWindow) -> None:
        chunks = window.chunks          # (comparisons, not max(): once per chunk on every bounded edge)
        if chunks > self.peak_chunks:
            self.peak_chunks = chunks
        if window.bytes > self.peak_bytes:
            self.peak_bytes = window.bytes


class EdgeWindow:
    """What one producer has outstanding on one edge: chunks written, not yet read by the consumer."""

    def __init__(self, *, max_chunks: int, max_bytes: int) -> None:
        self.max_chunks = max_chunks
        self.max_bytes = max_bytes
        self._sent: deque[tuple[int, int]] = deque()
        self.bytes = 0
        self.read_seq = 0
        self.peak_chunks = 0
        self.peak_bytes = 0

    @property
    def chunks(self) -> int:
        return len(self._sent)

    def enabled(self) -> bool:
        return self.max_chunks > 0 or self.max_bytes > 0

    def has_room(self, nbytes: int) -> bool:
        """True if one more chunk of `nbytes` stays within the bound (a chunk larger than the byte
        bound on its own goes through when nothing else is outstanding)."""
        chunks = len(self._sent)
        if self.max_chunks > 0 and chunks >= self.max_chunks:
            return False
        if self.max_bytes > 0 and chunks and self.bytes + nbytes > self.max_bytes:
            return False
        return True

    def sent(self, seq: int, nbytes: int) -> None:
        if seq <= self.read_seq:
            return
        self._sent.append((seq, nbytes))
        self.bytes += nbytes
        if len(self._sent) > self.peak_chunks:
            self.peak_chunks = len(self._sent)
        if self.bytes > self.peak_bytes:
            self.peak_bytes = self.bytes

    def read_up_to(self, seq: int) -> None:
        """The consumer has read every chunk up to `seq`."""
        if seq <= self.read_seq:
            return
        self.read_seq = seq
        while self._sent and self._sent[0][0] <= seq:
            self.bytes -= self._sent.popleft()[1]


async def wait_for_room(window: EdgeWindow, nbytes: int, read_position: Callable[[], Awaitable[int]],
                        stats: WaitStats, *, poll_min_s: float = DEFAULT_POLL_MIN_S,
                        poll_max_s: float = DEFAULT_POLL_MAX_S) -> float:
    """Wait until `window` has room for a chunk of `nbytes`, asking `read_position()` for the
    consumer's progress; returns the seconds waited (0.0 without a wait)."""
    if window.has_room(nbytes):
        return 0.0
    t0 = time.monotonic()
    delay = poll_min_s
    stats.waits += 1
    try:
        while True:
            window.read_up_to(await read_position())
            if window.has_room(nbytes):
                return time.monotonic() - t0
            await asyncio.sleep(delay)
            delay = min(poll_max_s, delay * 2)
    finally:
        stats.wait_s += time.monotonic() - t0
