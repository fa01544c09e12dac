"""The backpressure window on its own: a fast producer held to the bound by a slow consumer."""
from __future__ import annotations

import asyncio

from omniflow.dataplane.backpressure import EdgeWindow, WaitStats, wait_for_room


def test_window_counts_chunks_and_bytes() -> None:
    w = EdgeWindow(max_chunks=3, max_bytes=1000)
    for seq in (1, 2):
        assert w.has_room(100)
        w.sent(seq, 100)
    assert w.has_room(100) and not w.has_room(900)       # bytes bound
    w.sent(3, 100)
    assert not w.has_room(1)                             # chunks bound
    w.read_up_to(2)
    assert w.chunks == 1 and w.bytes == 100 and w.has_room(100)
    w.read_up_to(1)                                      # a position never goes back
    assert w.read_seq == 2
    w.sent(2, 50)                                        # a replayed step already read: not outstanding
    assert w.chunks == 1


def test_one_chunk_larger_than_the_byte_bound_goes_through_alone() -> None:
    w = EdgeWindow(max_chunks=0, max_bytes=1000)
    assert w.has_room(5000)
    w.sent(1, 5000)
    assert not w.has_room(1)
    assert not EdgeWindow(max_chunks=0, max_bytes=0).enabled()


async def test_a_fast_producer_is_held_to_the_bound_by_a_slow_consumer() -> None:
    w, stats = EdgeWindow(max_chunks=4, max_bytes=10_000), WaitStats()
    read = 0
    outstanding_seen = []

    async def consumer() -> None:
        nonlocal read
        while read < 40:
            await asyncio.sleep(0.001)      # the slow consumer's pace (simulated)
            read += 1

    async def position() -> int:
        return read

    task = asyncio.create_task(consumer())
    for seq in range(1, 41):
        await wait_for_room(w, 1000, position, stats)
        w.sent(seq, 1000)
        outstanding_seen.append(seq - read)
    await task
    assert max(outstanding_seen) <= 4 and w.peak_chunks <= 4 and w.peak_bytes <= 4000
    assert stats.waits > 0 and stats.wait_s > 0
