"""Each transport against the real thing: a Valkey server and this host's /dev/shm."""
from __future__ import annotations

import gc
import mmap
import os
import resource
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omniflow.config import ChecksumMode, DataPlaneMode, Settings
from omniflow.dataplane import (
    ChecksumMismatch, DataPlane, ForeignReference, PayloadMissing, Ref, SizeMismatch, TransportKind,
    UndecodablePayload, WrongHost, ref_field,
)
from omniflow.dataplane import arena as arenas
from omniflow.dataplane.shm import CONTROL, CONTROL_BYTES, DEFAULT_SHM_DIR, shm_available
from omniflow.client.store import connect

from dataplane_forge import ext, forge_frame

pytestmark = pytest.mark.skipif(not shm_available(DEFAULT_SHM_DIR), reason="no /dev/shm on this host")

KINDS = [TransportKind.INLINE, TransportKind.REDIS, TransportKind.SHM]
NUMPY_DTYPES = ["<f4", "<f2", "<f8", "<i8", "<i4", "|i1", "|u1", "|b1", "<c8"]
TENSOR_DTYPES = ["float32", "float16", "bfloat16", "int64"]


@pytest.fixture
def plane(plane_of: Callable[..., DataPlane]) -> DataPlane:
    return plane_of("thinker-host-1-abc")


@pytest.fixture
def plain(plane_of: Callable[..., DataPlane]) -> DataPlane:
    """A data plane without arenas: every shared-memory payload gets a segment of its own."""
    return plane_of("thinker-host-1-abc", dataplane_shm_pool_bytes=0)


def seg_path(ref: Ref) -> Path:
    return DEFAULT_SHM_DIR / ref.location


def slot_row(ref: Ref) -> tuple[int, int, int, int, int]:
    """(gen, freed, offset, nbytes, expiry ms) of an arena slot, read from the file."""
    raw = os.pread(fd := os.open(seg_path(ref), os.O_RDONLY), arenas.SLOT.itemsize,
                   arenas.TABLE_AT + ref.slot * arenas.SLOT.itemsize)
    os.close(fd)
    gen, freed, offset, nbytes, expiry = np.frombuffer(raw, dtype=arenas.SLOT)[0].tolist()
    return gen, freed, offset, nbytes, expiry


def in_use(ref: Ref) -> bool:
    gen, freed, *_ = slot_row(ref)
    return gen == ref.gen and freed != gen


async def put(plane: DataPlane, payload: Any, kind: TransportKind, *, wf: str = "wf1", seq: int = 1) -> Ref:
    return await plane.put(payload, plane.context(wf, "thinker", "talker", 1, seq), kind=kind)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
async def test_numpy_round_trip(plane: DataPlane, kind: TransportKind, dtype: str) -> None:
    arr = (np.random.default_rng(1).standard_normal((16, 33)) * 100).astype(dtype)
    ref = await put(plane, {"h": arr, "seq": 1}, kind)
    assert ref.kind is kind
    out = await plane.get(Ref.unpack(ref.pack()) if kind is not TransportKind.INLINE else ref, wf_id="wf1")
    assert out["seq"] == 1 and out["h"].dtype == arr.dtype and out["h"].shape == arr.shape
    assert out["h"].tobytes() == arr.tobytes()
    await plane.release([ref])


@pytest.mark.parametrize("name", TENSOR_DTYPES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
async def test_tensor_round_trip(plane: DataPlane, kind: TransportKind, name: str) -> None:
    torch = pytest.importorskip("torch")
    t = (torch.randn(8, 12) * 100).to(getattr(torch, name))
    ref = await put(plane, [t, b"\x00" * 2048], kind)
    out, raw = await plane.get(ref, wf_id="wf1")
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
    assert raw == b"\x00" * 2048
    out.add_(1)                     # consumers may work in place: the view is private to them
    again, _ = await plane.get(ref, wf_id="wf1")
    assert torch.equal(again, t)
    await plane.release([ref])


async def test_entry_fields_resolve_to_the_payload(plane: DataPlane) -> None:
    arr = np.arange(100_000, dtype=np.float32)
    for kind in KINDS:
        ref = await put(plane, arr, kind, seq=7)
        name, value = ref_field(ref)
        assert name == ("d" if kind is TransportKind.INLINE else "r")
        out, held = await plane.resolve({name.encode(): value}, wf_id="wf1")
        assert np.array_equal(out, arr)
        assert (held is None) == (kind is TransportKind.INLINE)
        await plane.release([held] if held else [])
    with pytest.raises(UndecodablePayload):
        await plane.resolve({b"seq": b"1"})


async def test_the_policy_picks_per_chunk_by_size_and_consumer_host(plane: DataPlane) -> None:
    small, large = np.zeros(100, np.float32), np.zeros(1 << 20, np.uint8)
    assert plane.choose(small, consumer_domain=plane.domain) is TransportKind.INLINE
    assert plane.choose(large, consumer_domain=plane.domain) is TransportKind.SHM
    assert plane.choose(large, consumer_domain="other-host:1:2") is TransportKind.REDIS
    assert plane.choose(large, consumer_domain=None) is TransportKind.REDIS
    ref = await plane.put(large, plane.context("wf1", "thinker", "talker", 1, 1), consumer_domain=plane.domain)
    assert ref.kind is TransportKind.SHM and ref.slot >= 0 and in_use(ref)
    await plane.release([ref])
    assert not in_use(ref)


async def test_a_released_slot_is_reused_by_its_producer_once_no_view_is_left(plane: DataPlane) -> None:
    """Release hands a slot back once the consumer holds no view of it; the producer's next payload
    reuses its memory (same arena file, same offset, a new generation): nothing is created, mapped or
    freed for it. A reference to the payload it held before is refused, never read as the new one."""
    arr = np.arange(300_000, dtype=np.float32)
    first = await put(plane, arr, TransportKind.SHM, seq=1)
    inode = os.stat(seg_path(first)).st_ino
    view = await plane.get(first, wf_id="wf1")
    await plane.release([first])
    assert in_use(first)                             # a view of it is still alive here: not yet
    second = await put(plane, arr * 2, TransportKind.SHM, seq=2)
    assert second.slot != first.slot and slot_row(second)[2] != slot_row(first)[2]
    assert np.array_equal(view, arr)                 # untouched
    del view
    assert not in_use(first)
    third = await put(plane, arr * 3, TransportKind.SHM, seq=3)
    assert (third.location, third.slot) == (first.location, first.slot) and third.gen != first.gen
    assert slot_row(third)[2] == slot_row(first)[2] and os.stat(seg_path(third)).st_ino == inode
    assert np.array_equal(await plane.get(third, wf_id="wf1"), arr * 3)
    with pytest.raises(PayloadMissing):
        await plane.get(first, wf_id="wf1")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
async def test_numpy_views_are_read_only_on_every_transport(plane: DataPlane, kind: TransportKind) -> None:
    ref = await put(plane, {"h": np.arange(100_000, dtype=np.float32)}, kind)
    out = (await plane.get(ref, wf_id="wf1"))["h"]
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0] = 1.0
    with pytest.raises(ValueError):
        out.setflags(write=True)                     # nobody can turn a view of the arena writable
    await plane.release([ref])


@pytest.mark.parametrize("pagemap", [True, False], ids=["pagemap", "no-pagemap"])
async def test_what_a_consumer_wrote_never_shows_in_the_slots_next_payload(plane: DataPlane, pagemap: bool) -> None:
    """Tensor views are writable and private: a write stays in the consumer's pages. Once its views are
    gone those pages are dropped (found in /proc/self/pagemap; without it, always), so the slot's next
    payload, or a second read of the same one, is what the producer wrote."""
    torch = pytest.importorskip("torch")
    assert plane.shm is not None
    if not pagemap:
        plane.shm._pagemap = None
    t = torch.arange(300_000, dtype=torch.float32)
    first = await put(plane, t, TransportKind.SHM, seq=1)
    view = await plane.get(first, wf_id="wf1")
    view[:1000] = -1.0                               # the consumer works in place
    again = await plane.get(first, wf_id="wf1")      # read twice while the first views live
    assert torch.equal(again, t)
    del view, again
    assert torch.equal(await plane.get(first, wf_id="wf1"), t)
    await plane.release([first])
    gc.collect()
    second = await put(plane, t * 2, TransportKind.SHM, seq=2)
    assert second.slot == first.slot
    assert torch.equal(await plane.get(second, wf_id="wf1"), t * 2)


async def test_steady_state_creates_no_file_and_faults_no_page(plane: DataPlane) -> None:
    """Put, read every page of, and release 1 MiB payloads: after the first round the arena and the
    consumer's mapping are reused, so there is one file, one mapping, and (almost) no page fault per
    payload (a fresh 1 MiB mapping faults 256 pages on each side)."""
    assert plane.shm is not None
    arr = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
    for seq in range(1, 4):                          # warm up: the arena and the mapping are made here
        ref = await put(plane, arr, TransportKind.SHM, seq=seq)
        assert int((await plane.get(ref, wf_id="wf1"))[::4096].sum()) >= 0
        await plane.release([ref])
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for seq in range(10, 30):
        ref = await put(plane, arr, TransportKind.SHM, seq=seq)
        out = await plane.get(ref, wf_id="wf1")
        assert int(out[::4096].sum()) == int(arr[::4096].sum())
        del out
        await plane.release([ref])
    per_payload = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 20
    assert per_payload < 32, per_payload
    assert len(list(plane.shm.arena_files())) == 1 and len(plane.shm._maps) == 1
    assert not list(plane.shm.segments())


async def test_mode_setting_forces_one_transport(valkey_url: str, shm_prefix: str) -> None:
    redis = connect(valkey_url)
    try:
        dp = DataPlane(redis, Settings(redis_url=valkey_url, prefix=shm_prefix, dataplane_mode=DataPlaneMode.REDIS))
        assert dp.choose(b"x", consumer_domain=dp.domain) is TransportKind.REDIS
    finally:
        await redis.aclose()


async def test_arena_and_slot_attribute_the_owner_and_the_consumer_gets_a_view(plane: DataPlane) -> None:
    arr = np.random.default_rng(3).standard_normal((1024, 1024)).astype(np.float32)     # 4 MiB
    ref = await put(plane, {"h": arr}, TransportKind.SHM, seq=12)
    assert ref.location == f"of-{plane.settings.prefix}-thinker_host_1_abc-arena-1" and ref.slot == 0
    assert os.stat(seg_path(ref)).st_mode & 0o777 == 0o600
    (found,) = arenas.scan(str(seg_path(ref))) or []
    assert found.info is not None
    assert found.info.owner == ["wf1", "thinker", "talker", 1, 12, "thinker-host-1-abc"]
    out = (await plane.get(ref, wf_id="wf1"))["h"]
    assert plane.shm is not None
    mapping = plane.shm._maps[ref.location]
    start = out.__array_interface__["data"][0]
    assert mapping.address <= start < start + out.nbytes <= mapping.address + mapping.size    # a view of it
    assert np.array_equal(out, arr)
    await plane.release([ref])


async def test_segment_name_attributes_the_owner_and_the_consumer_gets_a_view(plain: DataPlane) -> None:
    arr = np.random.default_rng(3).standard_normal((1024, 1024)).astype(np.float32)     # 4 MiB
    ref = await put(plain, {"h": arr}, TransportKind.SHM, seq=12)
    assert ref.location == f"of-{plain.settings.prefix}-thinker_host_1_abc-wf1-thinker.talker-1.12"
    assert ref.slot == -1 and os.stat(seg_path(ref)).st_mode & 0o777 == 0o600
    out = (await plain.get(ref, wf_id="wf1"))["h"]
    base: Any = out
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)   # a view of the segment
    assert np.array_equal(out, arr)
    await plain.release([ref])
    assert seg_path(ref).exists()                    # a view of it is alive here
    del out, base
    assert not seg_path(ref).exists()                # the last one went: unlinked


async def test_shared_memory_path_makes_no_copy_beyond_the_segment(plane: DataPlane) -> None:
    """put: the only copy is the kernel's, into the segment; get: a view. Python-side allocations
    (numpy's are traced) stay far below the payload size on both sides."""
    arr = np.ones(16 << 20, dtype=np.uint8)
    tracemalloc.start()
    try:
        ref = await put(plane, {"h": arr}, TransportKind.SHM)
        _, put_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out = await plane.get(ref, wf_id="wf1")
        _, get_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out["h"].nbytes == arr.nbytes and int(out["h"][-1]) == 1
    assert put_peak < arr.nbytes // 16, put_peak
    assert get_peak < arr.nbytes // 16, get_peak
    await plane.release([ref])


async def test_redis_payload_has_a_ttl_and_is_listed_for_the_terminal(plane: DataPlane) -> None:
    ref = await put(plane, np.zeros(1000, np.float64), TransportKind.REDIS)
    assert ref.location == plane.keys.blob("wf1", "thinker", "talker", 1, 1)
    ttl_ms = await plane.redis.pttl(ref.location)
    assert 0 < ttl_ms <= plane.ttl_s * 1000 and ttl_ms > (plane.settings.max_deadline_s * 1000)
    assert await plane.redis.sismember(plane.keys.blobs("wf1"), ref.location)
    assert await plane.redis.pttl(plane.keys.blobs("wf1")) > 0
    assert await plane.release([ref]) == 1
    assert not await plane.redis.exists(ref.location)
    assert not await plane.redis.sismember(plane.keys.blobs("wf1"), ref.location)
    with pytest.raises(PayloadMissing, match="gone"):
        await plane.get(ref, wf_id="wf1")


# --------------------------------------------------------------------------- hostile references


@pytest.mark.parametrize("location", [
    "../../etc/passwd", "/etc/passwd", "of-otherprefix-w-wf1-thinker.talker-1.1", "of-PREFIX-w-wf1-a.b-1.1/../../x",
    "of-PREFIX-w-wf1-thinker.talker-1.1.tmp",
])
async def test_shm_reference_outside_our_namespace_is_refused(plane: DataPlane, tmp_path: Path,
                                                              location: str) -> None:
    location = location.replace("PREFIX", plane.settings.prefix)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    for loc in (location, os.path.relpath(victim, DEFAULT_SHM_DIR)):
        ref = Ref(TransportKind.SHM, loc, 7, 0, plane.domain)
        with pytest.raises(ForeignReference):
            await plane.get(ref, wf_id="wf1")
        with pytest.raises(ForeignReference):
            await plane.release([ref])              # never unlinks a path a reference smuggled in
    assert victim.read_bytes() == b"keep me"


async def test_shm_reference_to_another_workflow_is_refused(plane: DataPlane) -> None:
    ref = await put(plane, np.zeros(10), TransportKind.SHM, wf="wf2")
    with pytest.raises(ForeignReference, match="another workflow"):
        await plane.get(ref, wf_id="wf1")
    assert (await plane.get(ref, wf_id="wf2")).shape == (10,)
    await plane.release([ref])


async def test_shm_reference_of_wrong_size_or_checksum_or_host_is_refused(plain: DataPlane) -> None:
    ref = await put(plain, {"h": np.arange(4096, dtype=np.int64)}, TransportKind.SHM)
    with pytest.raises(SizeMismatch):
        await plain.get(Ref(ref.kind, ref.location, ref.nbytes + 8, ref.checksum, ref.host), wf_id="wf1")
    with pytest.raises(ChecksumMismatch):
        await plain.get(Ref(ref.kind, ref.location, ref.nbytes, ref.checksum ^ 0x10, ref.host), wf_id="wf1")
    with pytest.raises(WrongHost, match="shared memory of"):
        await plain.get(Ref(ref.kind, ref.location, ref.nbytes, ref.checksum, "elsewhere:1:2"), wf_id="wf1")
    with open(seg_path(ref), "r+b") as f:          # a segment changed under its reference
        f.seek(CONTROL_BYTES + 40)
        byte = f.read(1)
        f.seek(CONTROL_BYTES + 40)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatch):
        await plain.get(ref, wf_id="wf1")
    os.truncate(seg_path(ref), CONTROL_BYTES + ref.nbytes - 100)
    with pytest.raises(SizeMismatch):
        await plain.get(ref, wf_id="wf1")
    assert await plain.release_workflow("wf1") == 1
    with pytest.raises(PayloadMissing):
        await plain.get(ref, wf_id="wf1")


async def test_arena_reference_of_wrong_slot_generation_size_checksum_or_host_is_refused(plane: DataPlane) -> None:
    ref = await put(plane, {"h": np.arange(4096, dtype=np.int64)}, TransportKind.SHM)
    assert ref.slot >= 0

    def variant(**kw: Any) -> Ref:
        fields = {"kind": ref.kind, "location": ref.location, "nbytes": ref.nbytes, "checksum": ref.checksum,
                  "host": ref.host, "slot": ref.slot, "gen": ref.gen} | kw
        return Ref(**fields)

    with pytest.raises(PayloadMissing):                              # another payload's generation
        await plane.get(variant(gen=ref.gen + 7), wf_id="wf1")
    with pytest.raises(UndecodablePayload, match="no slot"):
        await plane.get(variant(slot=10**6), wf_id="wf1")
    with pytest.raises(SizeMismatch):
        await plane.get(variant(nbytes=ref.nbytes + 8), wf_id="wf1")
    with pytest.raises(ChecksumMismatch):
        await plane.get(variant(checksum=ref.checksum ^ 0x10), wf_id="wf1")
    with pytest.raises(WrongHost, match="shared memory of"):
        await plane.get(variant(host="elsewhere:1:2"), wf_id="wf1")
    with pytest.raises(ForeignReference):                            # an arena name outside our namespace
        await plane.get(variant(location=ref.location.replace(plane.settings.prefix, "other")), wf_id="wf1")
    with pytest.raises(ForeignReference):                            # a segment name passed off as an arena
        await plane.get(variant(location=f"of-{plane.settings.prefix}-w-wf1-thinker.talker-1.1"), wf_id="wf1")
    offset = slot_row(ref)[2]
    fd = os.open(seg_path(ref), os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset + 40)                          # the payload changed under its reference
        os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset + 40)
        with pytest.raises(ChecksumMismatch):
            await plane.get(ref, wf_id="wf1")
        os.pwrite(fd, byte, offset + 40)
        assert (await plane.get(ref, wf_id="wf1"))["h"][-1] == 4095
        # a table entry that points outside the arena's data (a bug, or a hostile writer)
        at = arenas.TABLE_AT + ref.slot * arenas.SLOT.itemsize + 8
        os.pwrite(fd, (os.fstat(fd).st_size - 4096).to_bytes(8, "little"), at)
        with pytest.raises(UndecodablePayload, match="outside"):
            await plane.get(ref, wf_id="wf1")
    finally:
        os.close(fd)
    assert await plane.release_workflow("wf1") == 1
    with pytest.raises(PayloadMissing):
        await plane.get(ref, wf_id="wf1")


async def test_a_file_named_like_an_arena_that_is_not_one_is_refused(plane: DataPlane) -> None:
    name = f"of-{plane.settings.prefix}-w-arena-7"
    (DEFAULT_SHM_DIR / name).write_bytes(b"OFSG" + bytes(8188))
    with pytest.raises(UndecodablePayload, match="not an omniflow arena"):
        await plane.get(Ref(TransportKind.SHM, name, 64, 0, plane.domain, slot=0, gen=1), wf_id="wf1")
    with pytest.raises(PayloadMissing):
        await plane.get(Ref(TransportKind.SHM, name.replace("-7", "-8"), 64, 0, plane.domain, slot=0, gen=1))


async def test_full_checksum_mode_catches_a_changed_segment_byte(valkey_url: str, shm_prefix: str) -> None:
    redis = connect(valkey_url)
    dp = DataPlane(redis, Settings(redis_url=valkey_url, prefix=shm_prefix, dataplane_checksum=ChecksumMode.FULL,
                                   dataplane_shm_pool_bytes=0))
    try:
        ref = await put(dp, np.arange(100_000, dtype=np.float32), TransportKind.SHM)
        with open(seg_path(ref), "r+b") as f:
            f.seek(CONTROL_BYTES + ref.nbytes - 1)
            f.write(b"\x7f")
        with pytest.raises(ChecksumMismatch, match="data checksum"):
            await dp.get(ref, wf_id="wf1")
        assert dp.shm is not None
        dp.shm.release_all()
    finally:
        await redis.aclose()


async def test_shm_segment_with_undecodable_dtype_is_refused(plane: DataPlane) -> None:
    raw, crc = forge_frame({"h": ext(10, "|O", [2], 0)}, [bytes(16)])
    name = f"of-{plane.settings.prefix}-w-wf1-thinker.talker-1.1"
    (DEFAULT_SHM_DIR / name).write_bytes(CONTROL.pack(b"OFSG", 0, 0).ljust(CONTROL_BYTES, b"\0") + raw)
    ref = Ref(TransportKind.SHM, name, len(raw), crc, plane.domain)
    with pytest.raises(UndecodablePayload, match="not accepted"):
        await plane.get(ref, wf_id="wf1")
    await plane.release([ref])


async def test_redis_reference_outside_our_namespace_missing_or_unsound_is_refused(plane: DataPlane) -> None:
    for key in ("other:key", plane.keys.blob("wf2", "a", "b", 1, 1), plane.keys.workers,
                "x" + plane.keys.blob("wf1", "a", "b", 1, 1)):
        with pytest.raises(ForeignReference):
            await plane.get(Ref(TransportKind.REDIS, key, 10, 0), wf_id="wf1")
    with pytest.raises(PayloadMissing):
        await plane.get(Ref(TransportKind.REDIS, plane.keys.blob("wf1", "a", "b", 1, 1), 10, 0), wf_id="wf1")
    ref = await put(plane, np.arange(1000, dtype=np.int32), TransportKind.REDIS)
    with pytest.raises(SizeMismatch):
        await plane.get(Ref(ref.kind, ref.location, ref.nbytes - 1, ref.checksum), wf_id="wf1")
    with pytest.raises(ChecksumMismatch):
        await plane.get(Ref(ref.kind, ref.location, ref.nbytes, ref.checksum + 1), wf_id="wf1")
    raw, crc = forge_frame(ext(10, "<f4", [3], 0), [bytes(16)])
    await plane.redis.set(ref.location, raw)
    with pytest.raises(UndecodablePayload, match="needs 12 bytes"):
        await plane.get(Ref(ref.kind, ref.location, len(raw), crc), wf_id="wf1")
    await plane.release([ref])


def test_data_plane_errors_fail_the_session_not_the_worker() -> None:
    """They are StageErrors: the worker's executor wrapper turns them into a session failure with this
    message, retried when `retryable` (a missing payload may be a retry's to fix; a bad one is not)."""
    from omniflow.errors import StageError

    for cls in (PayloadMissing, WrongHost, ForeignReference, SizeMismatch, ChecksumMismatch, UndecodablePayload):
        assert issubclass(cls, StageError)
    assert PayloadMissing.retryable and WrongHost.retryable
    assert not (ForeignReference.retryable or SizeMismatch.retryable or UndecodablePayload.retryable)
