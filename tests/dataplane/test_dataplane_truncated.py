"""Payloads cut short under their references (a segment or an arena truncated): their bytes are lost
as if they were gone, so the consumer has its producer write them again, instead of failing for good."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from omniflow.dataplane import DataPlane, PayloadMissing, PayloadTruncated, Ref, SizeMismatch, TransportKind
from omniflow.dataplane import arena as arenas
from omniflow.dataplane.shm import CONTROL_BYTES, DEFAULT_SHM_DIR, shm_available

pytestmark = pytest.mark.skipif(not shm_available(DEFAULT_SHM_DIR), reason="no /dev/shm on this host")

MIB = 1 << 20


def payload(nbytes: int = MIB, value: float = 1.0) -> dict[str, Any]:
    return {"h": np.full(nbytes // 4, value, dtype=np.float32)}


def context(plane: DataPlane, seq: int = 1) -> Any:
    return plane.context("wf1", "thinker", "talker", 1, seq)


@pytest.fixture
def plane(plane_of: Callable[..., DataPlane]) -> DataPlane:
    return plane_of("thinker-host-1-abc")


@pytest.fixture
def plain(plane_of: Callable[..., DataPlane]) -> DataPlane:
    return plane_of("thinker-host-1-abc", dataplane_shm_pool_bytes=0)


async def test_a_segment_cut_short_is_a_missing_payload_not_a_bad_reference(plain: DataPlane) -> None:
    """Truncated under its reference, a segment's bytes are lost as if it were gone: `PayloadTruncated`,
    a `PayloadMissing` (the consumer has its producer write it again), where it used to be a
    `SizeMismatch` (not retryable: the workflow failed for good)."""
    ref = await plain.put(payload(), context(plain), kind=TransportKind.SHM)
    path = DEFAULT_SHM_DIR / ref.location
    lying = Ref(ref.kind, ref.location, ref.nbytes + 8, ref.checksum, ref.host)
    with pytest.raises(SizeMismatch):              # an intact segment, a reference that says another size
        await plain.get(lying, wf_id="wf1")
    for size in (CONTROL_BYTES + ref.nbytes - 100, CONTROL_BYTES + 20, 0):        # in the data, the header, all
        os.truncate(path, size)
        with pytest.raises(PayloadTruncated, match="cut short") as cut:
            await plain.get(ref, wf_id="wf1")
        assert isinstance(cut.value, PayloadMissing) and cut.value.retryable
    await plain.release([ref])
    assert not path.exists()


async def test_an_arena_cut_short_is_a_missing_payload(plane: DataPlane, plane_of: Callable[..., DataPlane]) -> None:
    """The same for an arena: a consumer that maps it after the cut, and one that mapped it before
    (its next read checks the file's size: a read past the end would be a SIGBUS)."""
    before = plane_of("talker-host-1-abc")
    ref = await plane.put(payload(), context(plane), kind=TransportKind.SHM)
    assert ref.slot >= 0
    del_first = await before.get(ref, wf_id="wf1")
    assert float(del_first["h"][0]) == 1.0
    del del_first                                      # never touch a view of the cut pages
    ref2 = await plane.put(payload(value=2.0), context(plane, 2), kind=TransportKind.SHM)
    assert plane.shm is not None
    data_at = plane.shm.pool.arenas[0].table.nbytes + arenas.TABLE_AT
    os.truncate(DEFAULT_SHM_DIR / ref.location, arenas._round_up(data_at, arenas.PAGE))
    for consumer in (before, plane_of("code2wav-host-1-abc")):
        with pytest.raises(PayloadTruncated, match="cut short"):
            await consumer.get(ref2, wf_id="wf1")
    # its producer stops writing there (a copy past the end would be a SIGBUS) and starts another
    plane.shm.pool.arenas[0]._checked = -arenas.LINK_CHECK_S
    ref3 = await plane.put(payload(value=3.0), context(plane, 3), kind=TransportKind.SHM)
    assert ref3.location != ref.location and not (DEFAULT_SHM_DIR / ref.location).exists()
    assert float((await before.get(ref3, wf_id="wf1"))["h"][0]) == 3.0
    await before.release([ref3])
