"""Who owns a payload and when it goes: release after use, a workflow's release, the sweep."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import numpy as np
import pytest

from omniflow.dataplane import DataPlane, Ref, TransportKind
from omniflow.dataplane.codec import FrameInfo
from omniflow.dataplane.shm import DEFAULT_SHM_DIR, Found, Segment, SweepReason, shm_available, sweep_verdict

pytestmark = pytest.mark.skipif(not shm_available(DEFAULT_SHM_DIR), reason="no /dev/shm on this host")


@pytest.fixture
def plane(plane_of: Callable[..., DataPlane]) -> DataPlane:
    return plane_of("w-live")


def ours(plane: DataPlane) -> set[str]:
    """Payloads of this prefix in shared memory: segments by name, arena slots in use as `<arena>#<slot>`."""
    assert plane.shm is not None
    return set(plane.shm.payloads())


def owners(plane: DataPlane) -> list[str]:
    """The workflow of each payload held (arena slots and segments)."""
    assert plane.shm is not None
    return sorted(f.wf_id for f in plane.shm.inventory() if f.slot >= 0 or not f.arena)


def pid(ref: Ref) -> str:
    return f"{ref.location}#{ref.slot}" if ref.slot >= 0 else ref.location


def files(plane: DataPlane) -> list[str]:
    return sorted(n for n in os.listdir(DEFAULT_SHM_DIR) if n.startswith(f"of-{plane.settings.prefix}-"))


async def set_state(plane: DataPlane, wf: str, state: str) -> None:
    await plane.redis.hset(plane.keys.wf(wf), "state", state)


async def test_release_workflow_frees_its_keys_and_segments_only(plane: DataPlane) -> None:
    refs = {}
    for wf in ("wfa", "wfb"):
        for seq, kind in enumerate((TransportKind.SHM, TransportKind.SHM, TransportKind.REDIS), 1):
            refs[(wf, seq)] = await plane.put(np.zeros(2048), plane.context(wf, "thinker", "talker", 1, seq), kind=kind)
    assert len(ours(plane)) == 4
    assert await plane.release_workflow("wfa") == 3
    assert owners(plane) == ["wfb", "wfb"] and len(ours(plane)) == 2
    assert not await plane.redis.exists(refs[("wfa", 3)].location, plane.keys.blobs("wfa"))
    assert await plane.redis.exists(refs[("wfb", 3)].location)
    assert (await plane.get(refs[("wfb", 1)], wf_id="wfb")).shape == (2048,)
    assert await plane.release_workflow("wfb") == 3
    assert not ours(plane)


def found(worker: str = "w1", wf: str = "wf1", expiry_ms: int | None = 10_000, free: bool = False,
          short: bool = False) -> Found:
    seg = Segment(f"of-p-{worker}-{wf}-a.b-1.1", "p", worker, wf, "a", "b", 1, 1)
    info = None if expiry_ms is None else FrameInfo(10, 10, expiry_ms, [wf, "a", "b", 1, 1, worker])
    return Found(seg, info, free, short=short)


@pytest.mark.parametrize(("item", "live_wfs", "live_workers", "expected"), [
    (found(), {"wf1"}, {"w1"}, None),                                   # live: keep
    (found(), {"wf1"}, set(), None),                     # producer died, workflow lives: a retry replays it
    (found(), set(), {"w1"}, SweepReason.ENDED),                         # workflow ended
    (found(expiry_ms=500), {"wf1"}, {"w1"}, SweepReason.EXPIRED),
    (found(expiry_ms=None), {"wf1"}, set(), SweepReason.ORPHAN),         # half-written by a dead worker
    (found(expiry_ms=None), {"wf1"}, {"w1"}, None),                      # maybe being written right now
    (found(), None, None, None),                                         # nothing known: keep
    (found(free=True), {"wf1"}, {"w1"}, None),                           # its producer will recycle it
    (found(free=True), {"wf1"}, set(), SweepReason.ORPHAN),              # ... but it is gone
    (found(short=True), {"wf1"}, set(), SweepReason.ORPHAN),     # its header there, its data half-written
    (found(short=True), {"wf1"}, {"w1"}, None),                          # ... being written right now
])
def test_sweep_verdict(item: Found, live_wfs: set[str] | None, live_workers: set[str] | None,
                       expected: SweepReason | None) -> None:
    assert sweep_verdict(item, now_ms=1000, live_wfs=live_wfs, live_workers=live_workers) is expected


async def test_sweep_frees_ended_expired_and_orphaned_segments_and_keeps_live_ones(plane: DataPlane) -> None:
    assert plane.shm is not None
    await set_state(plane, "wflive", "running")
    await set_state(plane, "wfdone", "completed")
    await plane.redis.zadd(plane.keys.workers, {"w-live": int(time.time() * 1000) + 60_000})
    live = await plane.put(np.ones(100), plane.context("wflive", "thinker", "talker", 1, 1), kind=TransportKind.SHM)
    done = await plane.put(np.ones(100), plane.context("wfdone", "thinker", "talker", 1, 1), kind=TransportKind.SHM)
    gone = await plane.put(np.ones(100), plane.context("wfgone", "thinker", "talker", 1, 1), kind=TransportKind.SHM)
    ctx = plane.context("wflive", "thinker", "talker", 1, 2)
    expired = await plane.shm.put(np.ones(100), dataclasses.replace(ctx, ttl_s=-1.0))
    half_dead = f"of-{plane.settings.prefix}-w_dead-wflive-thinker.talker-1.3"
    half_live = f"of-{plane.settings.prefix}-w_live-wflive-thinker.talker-1.4"
    for name in (half_dead, half_live):
        (DEFAULT_SHM_DIR / name).write_bytes(b"OF")          # a producer died (or is) mid-write
    freed = await plane.sweep()
    assert freed == {SweepReason.ENDED: 2, SweepReason.EXPIRED: 1, SweepReason.ORPHAN: 1}
    assert ours(plane) == {pid(live), half_live}
    assert {pid(done), pid(gone), pid(expired), half_dead}.isdisjoint(ours(plane))
    await set_state(plane, "wflive", "aborted")
    await plane.sweep()
    assert not ours(plane)


async def test_sweep_of_one_worker_leaves_the_others(plane: DataPlane) -> None:
    a = DataPlane(plane.redis, plane.settings, worker_id="w-a")
    b = DataPlane(plane.redis, plane.settings, worker_id="w-b")
    ra = await a.put(np.ones(10), a.context("wfx", "thinker", "talker", 1, 1), kind=TransportKind.SHM)
    rb = await b.put(np.ones(10), b.context("wfx", "thinker", "talker", 1, 2), kind=TransportKind.SHM)
    assert await plane.sweep(worker="w-a") == {SweepReason.ENDED: 1, SweepReason.EXPIRED: 0, SweepReason.ORPHAN: 0}
    assert ours(plane) == {pid(rb)} and not os.path.exists(DEFAULT_SHM_DIR / ra.location)   # w-a's arena went
    for dp in (a, b):
        assert dp.shm is not None
        dp.shm.close()


async def test_an_arena_goes_only_when_its_producer_is_dead_and_nothing_in_it_lives(plane: DataPlane) -> None:
    """Another producer's arena: kept while its producer lives (it takes back its own slots), and while
    a slot of a live workflow is in it; unlinked once neither holds."""
    await set_state(plane, "wfl", "running")
    other = DataPlane(plane.redis, plane.settings, worker_id="w-other")
    lease = {"w-other": int(time.time() * 1000) + 60_000}
    await plane.redis.zadd(plane.keys.workers, lease)
    ref = await other.put(np.ones(100), other.context("wfl", "thinker", "talker", 1, 1), kind=TransportKind.SHM)
    gone = await other.put(np.ones(100), other.context("wfx", "thinker", "talker", 1, 1), kind=TransportKind.SHM)
    assert ours(plane) == {pid(ref), pid(gone)}
    await plane.sweep()                                  # its producer lives: its own sweep decides
    assert ours(plane) == {pid(ref), pid(gone)}
    assert await other.sweep() == {SweepReason.ENDED: 1, SweepReason.EXPIRED: 0, SweepReason.ORPHAN: 0}
    assert ours(plane) == {pid(ref)}
    await plane.redis.zrem(plane.keys.workers, "w-other")      # it died
    await plane.sweep()
    assert ours(plane) == {pid(ref)}                     # the consumer (or its retry) may still read it
    assert (await plane.get(ref, wf_id="wfl")).shape == (100,)
    await set_state(plane, "wfl", "completed")
    assert sum((await plane.sweep()).values()) == 1
    assert not files(plane)
    assert other.shm is not None
    other.shm.close()


PRODUCER = textwrap.dedent("""
    import asyncio, sys
    import numpy as np
    from omniflow.config import Settings
    from omniflow.dataplane import DataPlane, Ref, TransportKind
    from omniflow.client.store import connect

    async def main():
        url, prefix = sys.argv[1], sys.argv[2]
        dp = DataPlane(connect(url), Settings(redis_url=url, prefix=prefix), worker_id="w-doomed")
        big = np.ones(8 << 20, np.uint8)
        seq = 0
        while True:
            seq += 1
            await dp.put(big, dp.context("wfk", "thinker", "talker", 1, seq), kind=TransportKind.SHM)
            if seq == 3:
                print("ready", flush=True)

    asyncio.run(main())
""")


@pytest.mark.slow
async def test_segments_of_a_producer_killed_mid_stream_are_swept(plane: DataPlane, valkey_url: str) -> None:
    """SIGKILL a process that writes 8 MiB payloads in a loop (into its arenas, then segments of their
    own once they are full); once its workflow has ended, the sweep leaves nothing of it behind."""
    await set_state(plane, "wfk", "running")
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, valkey_url, plane.settings.prefix],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    left = ours(plane)
    assert len(left) >= 3 and all("-w_doomed-" in name for name in left) and set(owners(plane)) == {"wfk"}
    await plane.sweep()                              # workflow still live: its chunks stay for the consumer
    assert {p for p in ours(plane) if "#" in p} == {p for p in left if "#" in p}
    await set_state(plane, "wfk", "failed")
    await plane.sweep()
    assert not ours(plane) and not files(plane)


async def test_a_producer_whose_arena_was_removed_under_it_starts_another(plane: DataPlane,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep that took a live producer for dead (its lease lapsed on a loaded box) may unlink its arena:
    the producer notices and writes its next payloads into a new one, never into the removed file."""
    from omniflow.dataplane import arena as arenas

    monkeypatch.setattr(arenas, "LINK_CHECK_S", 0.0)
    first = await plane.put(np.ones(1000), plane.context("wfa", "thinker", "talker", 1, 1), kind=TransportKind.SHM)
    os.unlink(DEFAULT_SHM_DIR / first.location)
    second = await plane.put(np.ones(1000) * 2, plane.context("wfa", "thinker", "talker", 1, 2), kind=TransportKind.SHM)
    assert second.location != first.location and os.path.exists(DEFAULT_SHM_DIR / second.location)
    assert float((await plane.get(second, wf_id="wfa"))[0]) == 2.0


async def test_a_clean_stop_frees_what_ended_and_keeps_a_live_workflow_for_this_host(
        plane_of: Callable[..., DataPlane]) -> None:
    """`aclose`, a worker's clean stop: its payloads of workflows that ended go now (not at a sweep up to
    30 s later, or never: it is the last process here); a live workflow's stay, in the arena file, for
    the next processes on this host, until a sweep there sees the workflow end."""
    stopping = plane_of("w-stopping")
    await set_state(stopping, "wflive", "running")
    await set_state(stopping, "wfdone", "completed")
    live = await stopping.put(np.ones(50_000), stopping.context("wflive", "thinker", "talker", 1, 1),
                              kind=TransportKind.SHM)
    done = await stopping.put(np.ones(50_000), stopping.context("wfdone", "thinker", "talker", 1, 1),
                              kind=TransportKind.SHM)
    assert live.slot >= 0 and done.location == live.location
    assert (await stopping.aclose())[SweepReason.ENDED] == 1
    nxt = plane_of("w-next")                              # this host's next process
    assert ours(nxt) == {pid(live)} and files(nxt) == [live.location]
    assert float((await nxt.get(live, wf_id="wflive"))[0]) == 1.0        # a consumer's retry reads it
    await set_state(nxt, "wflive", "completed")
    await nxt.sweep()
    assert not ours(nxt) and not files(nxt)
    # a producer whose payloads all ended leaves nothing at its stop
    gone = plane_of("w-gone")
    await gone.put(np.ones(50_000), gone.context("wfdone", "thinker", "talker", 1, 2), kind=TransportKind.SHM)
    await gone.aclose()
    assert not files(gone)
