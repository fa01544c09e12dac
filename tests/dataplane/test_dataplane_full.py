"""A full shared-memory directory, for real: a tmpfs of the test's own, filled until the kernel
answers ENOSPC (`dataplane_tmpfs`). Large payloads go through Redis keys then, and nothing is left."""
from __future__ import annotations

import errno
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataplane_tmpfs import fill, free_bytes, ours, small_tmpfs
from omniflow.dataplane import DataPlane, DataPlaneError, SharedMemoryRefused, TransportKind
from omniflow.dataplane import shm as shm_module
from omniflow.dataplane.shm import DEFAULT_SHM_DIR, shm_available

pytestmark = pytest.mark.skipif(not shm_available(DEFAULT_SHM_DIR), reason="no /dev/shm on this host")

MIB = 1 << 20
TMPFS_BYTES = 8 * MIB


@pytest.fixture
def tiny_shm() -> Iterator[Path]:
    with small_tmpfs(TMPFS_BYTES) as where:
        yield where


def payload(nbytes: int = MIB, value: float = 1.0) -> dict[str, Any]:
    return {"h": np.full(nbytes // 4, value, dtype=np.float32)}


def context(plane: DataPlane, seq: int = 1) -> Any:
    return plane.context("wf1", "thinker", "talker", 1, seq)


async def stored(plane: DataPlane, commands: list[tuple[Any, ...]]) -> None:
    for command in commands:
        await plane.redis.execute_command(*command)


@pytest.mark.parametrize("leave_bytes", [0, 64 << 10], ids=["nothing-left", "room-for-an-arena-table"])
async def test_a_full_shared_memory_directory_sends_large_payloads_to_redis(
        tiny_shm: Path, plane_of: Callable[..., DataPlane], leave_bytes: int) -> None:
    """Every put of a large chunk used to raise a bare OSError (ENOSPC) out of `prepare`; now it goes
    to a Redis key, and nothing of it (no segment, no empty arena) is left in the directory."""
    plane = plane_of("w-full", dataplane_shm_dir=tiny_shm)
    assert plane.shm is not None
    fill(tiny_shm, leave_bytes=leave_bytes)
    ref, commands = plane.prepare(payload(), context(plane), kind=TransportKind.SHM)
    assert ref.kind is TransportKind.REDIS and commands
    await stored(plane, commands)
    assert float((await plane.get(ref, wf_id="wf1"))["h"][0]) == 1.0
    ref2, op = plane.put_op(payload(), context(plane, 2), TransportKind.SHM)       # a session's emit
    assert ref2.kind is TransportKind.REDIS and op[0] == "B"
    assert (await plane.put(payload(), context(plane, 3), kind=TransportKind.SHM)).kind is TransportKind.REDIS
    assert not ours(tiny_shm, plane.settings.prefix)
    assert plane.shm.refused == 3
    await plane.release([ref])


async def test_shared_memory_refuses_with_a_data_plane_error_and_leaves_nothing(
        tiny_shm: Path, plane_of: Callable[..., DataPlane], monkeypatch: pytest.MonkeyPatch) -> None:
    plane = plane_of("w-full", dataplane_shm_dir=tiny_shm)
    assert plane.shm is not None
    fill(tiny_shm, leave_bytes=2 * MIB)
    with pytest.raises(SharedMemoryRefused, match="full") as refused:          # too large for what is left
        plane.shm.put_sync(payload(3 * MIB), context(plane))
    assert isinstance(refused.value, DataPlaneError) and refused.value.errno == errno.ENOSPC
    assert not ours(tiny_shm, plane.settings.prefix)
    # without the free-space check, the copy itself runs into the kernel's ENOSPC part-way through:
    # the part written is unlinked
    monkeypatch.setattr(shm_module, "_room", lambda _directory: None)
    with pytest.raises(SharedMemoryRefused, match="No space left") as refused:
        plane.shm.put_sync(payload(3 * MIB), context(plane, 2))
    assert refused.value.errno == errno.ENOSPC
    assert not ours(tiny_shm, plane.settings.prefix)
    assert free_bytes(tiny_shm) >= 2 * MIB - (64 << 10)       # nor the pages it had taken


async def test_a_directory_out_of_files_refuses_the_same_way(plane_of: Callable[..., DataPlane]) -> None:
    with small_tmpfs(TMPFS_BYTES, inodes=4) as where:
        plane = plane_of("w-full", dataplane_shm_dir=where, dataplane_shm_pool_bytes=0)
        with pytest.raises(OSError) as full:                   # every inode taken: bytes are left, files not
            for i in range(8):
                (where / f"f{i}").write_bytes(b"x")
        assert full.value.errno == errno.ENOSPC and free_bytes(where) > 4 * MIB
        with pytest.raises(SharedMemoryRefused):            # open(O_CREAT): ENOSPC, no inode left
            assert plane.shm is not None
            plane.shm.put_sync(payload(), context(plane))
        ref, _ = plane.prepare(payload(), context(plane), kind=TransportKind.SHM)
        assert ref.kind is TransportKind.REDIS
        assert not ours(where, plane.settings.prefix)


async def test_shared_memory_takes_payloads_again_once_there_is_room(
        tiny_shm: Path, plane_of: Callable[..., DataPlane]) -> None:
    plane = plane_of("w-full", dataplane_shm_dir=tiny_shm)
    filler = fill(tiny_shm)
    assert plane.prepare(payload(), context(plane), kind=TransportKind.SHM)[0].kind is TransportKind.REDIS
    filler.unlink()
    ref, commands = plane.prepare(payload(value=2.0), context(plane, 2), kind=TransportKind.SHM)
    assert ref.kind is TransportKind.SHM and ref.slot >= 0 and not commands          # an arena again
    assert float((await plane.get(ref, wf_id="wf1"))["h"][0]) == 2.0
    await plane.release([ref])
