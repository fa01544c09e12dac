"""Shared-memory transport: the payload in this host's /dev/shm, the entry holds a reference.

For large payloads whose consumer runs on the producer's host. A producer copies each payload
frame into a free slot of one of its arenas (`omniflow.dataplane.arena`: files it keeps mapped for
its life: `omniflow.dataplane.pool`) — the one copy of this path; the consumer maps the arena once and gets numpy arrays
(read-only) and torch tensors (writable; a write never reaches the producer's memory) that are views
of it: no copy. A payload too large for an arena, or one that finds every arena full, gets a
segment of its own instead (`omniflow.dataplane.segment`).

Names attribute everything to its owner, so any process on the host can release or sweep it
(`omniflow.dataplane.ownership`).
A payload lives until its consumer's session is done, its workflow ends (terminal, abort) or its
TTL passes. A producer that dies leaves its arenas and segments to the sweep (`sweep`), which frees
those of ended workflows, expired ones and half-written ones of dead workers; an arena goes once
nothing in it is live. A live workflow's payloads stay even when their producer died: its
consumers (and their retries) replay them.

A reference names the host's shared-memory domain (`shm_domain`): a consumer elsewhere gets
`WrongHost` (retryable) instead of reading another host's file of the same name.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omniflow.dataplane import arena as arenas
from omniflow.dataplane import codec, segment
from omniflow.dataplane.base import (
    ForeignReference, PayloadMissing, PutContext, Ref, SharedMemoryRefused, Transport, TransportKind,
    UndecodablePayload, WrongHost,
)
from omniflow.dataplane.ownership import (
    DEFAULT_SHM_DIR, NAMESPACE, ArenaFile, Found, Segment, SweepReason, name_part, parse_arena, parse_name,
    segment_name, shm_available, shm_domain, sweep_verdict,
)
from omniflow.dataplane.pool import ArenaPool
from omniflow.dataplane.segment import CONTROL, CONTROL_BYTES, STATE_FREE, STATE_IN_USE

__all__ = [
    "CONTROL", "CONTROL_BYTES", "DEFAULT_SHM_DIR", "STATE_FREE", "STATE_IN_USE", "ArenaFile", "Found", "Segment",
    "ShmTransport", "SweepReason", "name_part", "parse_arena", "parse_name", "segment_name", "shm_available",
    "shm_domain", "sweep_verdict",
]

logger = logging.getLogger(__name__)

THREAD_MIN_BYTES = 4 << 20       # payloads this large are written off the event loop by `put`
REFUSAL_LOG_S = 60.0             # a full /dev/shm is logged at most this often (with how many it refused)
DEFAULT_POOL_BYTES = 256 << 20   # what one producer's arenas may hold in all (dataplane_shm_pool_bytes)


class ShmTransport(Transport):
    """Payload frames in this host's shared memory: arenas, and segments of their own."""

    kind = TransportKind.SHM

    def __init__(self, prefix: str, *, directory: Path = DEFAULT_SHM_DIR, full_checksum: bool = False,
                 domain: str | None = None, pool_bytes: int = DEFAULT_POOL_BYTES, worker_id: str = "",
                 arena_bytes: int = arenas.DEFAULT_ARENA_BYTES) -> None:
        self.prefix = prefix
        self.directory = Path(directory)
        self.full_checksum = full_checksum
        self.domain = domain or shm_domain(self.directory)
        self.worker_id = worker_id
        self._mine = f"{NAMESPACE}-{name_part(prefix)}-"
        # producer side: our arenas
        self.pool = ArenaPool(self.directory, prefix, worker_id, pool_bytes=pool_bytes, arena_bytes=arena_bytes,
                              on_refusal=functools.partial(self._refused, payload=False))
        # consumer side: arenas we map, how many live views each payload we read has, which we released
        self._maps: dict[str, arenas.Mapped] = {}
        self._mapped: dict[str, int] = {}
        self._released: dict[str, Ref] = {}
        self._writable: set[str] = set()             # payloads of which we handed out writable views
        self._known: dict[str, ArenaFile] = {}       # arena names we mapped (so: checked)
        self._lock = threading.RLock()      # view finalizers may run inside a locked section (GC)
        self._pagemap = arenas.open_pagemap()
        self.refused = 0                             # payloads (or arenas) shared memory could not take
        self._refusals_logged = 0
        self._refusal_logged = -REFUSAL_LOG_S
        self._refusal_lock = threading.Lock()       # (taken inside the pool's lock, never the other way)

    # ------------------------------------------------------------ put
    def put_sync(self, payload: Any, ctx: PutContext) -> Ref:
        """`put` without the event loop (for a compute thread). A payload this host's shared memory
        cannot take (the directory is full, or the write fails) raises `SharedMemoryRefused`, and
        leaves no file of it behind: the data plane then puts it in a Redis key."""
        expiry_ms = int((time.time() + ctx.ttl_s) * 1000)
        frame = codec.encode_frame(payload, owner=[ctx.wf_id, ctx.src, ctx.dst, ctx.attempt, ctx.seq, ctx.worker_id],
                                   expiry_ms=expiry_ms, full_checksum=self.full_checksum)
        slot = self.pool.put(frame, ctx.wf_id, expiry_ms)
        if slot is not None:
            name, index, gen = slot
            return Ref(TransportKind.SHM, name, frame.nbytes, frame.checksum, self.domain, slot=index, gen=gen)
        try:
            return self._put_in_segment(frame, ctx)
        except SharedMemoryRefused as exc:
            self._refused(str(exc))
            raise

    def _put_in_segment(self, frame: codec.Frame, ctx: PutContext) -> Ref:
        name = segment_name(ctx)
        need = CONTROL_BYTES + frame.nbytes
        room = _room(self.directory)
        if room is not None and room < need:      # would fail part-way through the copy: do not start it
            raise SharedMemoryRefused(f"{self.directory} is full: {room} bytes free, a {need}-byte segment "
                                      f"does not fit", errno=errno.ENOSPC)
        try:
            segment.write(os.path.join(self.directory, name), frame)     # nothing left of it if it fails
        except OSError as exc:
            raise SharedMemoryRefused(f"cannot write a {need}-byte segment in {self.directory}: {exc}",
                                      errno=exc.errno) from exc
        return Ref(TransportKind.SHM, name, frame.nbytes, frame.checksum, self.domain)

    def _refused(self, why: str, *, payload: bool = True) -> None:
        """Count a payload shared memory could not take (`payload`), and say why at most every
        `REFUSAL_LOG_S` (a full /dev/shm refuses every payload until room comes back)."""
        with self._refusal_lock:
            self.refused += int(payload)
            now = time.monotonic()
            if now - self._refusal_logged < REFUSAL_LOG_S:
                return
            self._refusal_logged, count, self._refusals_logged = now, self.refused - self._refusals_logged, self.refused
        logger.warning("shared memory: %s (%d payload(s) refused since the last report went through Redis keys "
                       "instead)", why, count)

    async def put(self, payload: Any, ctx: PutContext) -> Ref:
        if codec.payload_nbytes(payload, THREAD_MIN_BYTES) >= THREAD_MIN_BYTES:
            return await asyncio.to_thread(self.put_sync, payload, ctx)
        return self.put_sync(payload, ctx)

    # ------------------------------------------------------------ get
    def check(self, ref: Ref, wf_id: str | None) -> Segment | ArenaFile:
        """Refuse a name that is not an arena or segment of ours (prefix, and workflow `wf_id` if given:
        a slot's workflow is checked against its header when it is read)."""
        known = self._known.get(ref.location) if ref.slot >= 0 else None
        if known is not None:
            return known                                 # checked when it was first mapped
        if not ref.location.startswith(self._mine):
            raise ForeignReference(f"segment {ref.location!r} is outside our namespace {self._mine}*")
        if ref.slot >= 0:
            found = parse_arena(ref.location)
            if found is None:
                raise ForeignReference(f"arena {ref.location!r} is outside our namespace {self._mine}*-arena-*")
            return found
        seg = parse_name(ref.location)
        if seg is None:
            raise ForeignReference(f"segment {ref.location!r} is outside our namespace {self._mine}*")
        if wf_id is not None and seg.wf_id != name_part(wf_id):
            raise ForeignReference(f"segment {ref.location!r} belongs to another workflow than {wf_id}")
        return seg

    def get_sync(self, ref: Ref, *, wf_id: str | None = None) -> Any:
        """`get` without the event loop."""
        self.check(ref, wf_id)
        if ref.host != self.domain:
            raise WrongHost(f"segment {ref.location} is in the shared memory of {ref.host}, not of {self.domain}")
        if ref.slot >= 0:
            return self._get_slot(ref, wf_id)
        payload, mm = segment.read(os.path.join(self.directory, ref.location), ref.location, ref.nbytes, ref.checksum)
        self._watch(mm, ref.location)
        return payload

    def _get_slot(self, ref: Ref, wf_id: str | None) -> Any:
        mapped = self._map(ref.location)
        offset = mapped.entry(ref.slot, ref.gen, ref.nbytes)
        key = _slot_key(ref)
        with self._lock:
            first = key not in self._mapped
            self._mapped[key] = self._mapped.get(key, 0) + 1
        try:
            # the first reader gets views of our mapping of the arena; a second one while those live gets a
            # mapping of its own, so it never sees what the first wrote into its (private) pages
            holder = mapped.holder(offset, ref.nbytes) if first else mapped.private(offset, ref.nbytes)
            payload, wrote = codec.decode_frame_views(memoryview(holder)[:ref.nbytes], nbytes=ref.nbytes,
                                                      checksum=ref.checksum, wf_id=wf_id,
                                                      what=f"arena {ref.location} slot {ref.slot}")
        except BaseException:
            self._unmapped(key, None)
            raise
        if wrote and first:
            with self._lock:
                self._writable.add(key)
        weakref.finalize(holder, self._unmapped, key, ref)
        return payload

    def _map(self, name: str) -> arenas.Mapped:
        mapped = self._maps.get(name)
        if mapped is None:
            file = parse_arena(name)
            if file is None or not name.startswith(self._mine):
                raise ForeignReference(f"arena {name!r} is outside our namespace {self._mine}*-arena-*")
            opened = arenas.Mapped(os.path.join(self.directory, name), name)
            with self._lock:
                mapped = self._maps.setdefault(name, opened)
                self._known[name] = file
            if mapped is not opened:
                opened.close()
        return mapped

    def _watch(self, holder: Any, key: str) -> None:
        """Count a segment's live views: it is handed back once released and the last view is gone."""
        with self._lock:
            self._mapped[key] = self._mapped.get(key, 0) + 1
        weakref.finalize(holder, self._unmapped, key)

    async def get(self, ref: Ref, *, wf_id: str | None = None) -> Any:
        return self.get_sync(ref, wf_id=wf_id)

    # ------------------------------------------------------------ ownership
    def _unlink(self, name: str) -> bool:
        try:
            os.unlink(os.path.join(self.directory, name))
            return True
        except FileNotFoundError:
            return False

    async def release(self, refs: Sequence[Ref]) -> int:
        """The consumer is done with these payloads: each is handed back (an arena slot to its producer,
        a segment of its own unlinked) as soon as no view of it is left in this process."""
        freed = 0
        for ref in refs:
            if ref.kind is TransportKind.SHM and ref.host == self.domain:
                self.check(ref, None)          # never touch a path a reference smuggled in
                key = _slot_key(ref) if ref.slot >= 0 else ref.location
                with self._lock:
                    if key in self._released:
                        continue
                    self._released[key] = ref
                    mapped = self._mapped.get(key, 0)
                if not mapped:
                    freed += self._hand_back(key)
        return freed

    def _unmapped(self, key: str, ref: Ref | None = None) -> None:
        with self._lock:
            left = self._mapped.get(key, 1) - 1
            if left > 0:
                self._mapped[key] = left
                return
            self._mapped.pop(key, None)
            if ref is not None and key in self._writable:
                # no view of this payload is left here, and some (tensors) were writable: drop our private
                # copies of its pages (a later read here, a retry's, or the slot's next payload must see
                # the file, not what we wrote). numpy views are read-only: nothing to drop.
                self._writable.discard(key)
                mapped = self._maps.get(ref.location)
                if mapped is not None:
                    mapped.scrub(ref.slot, ref.gen, ref.nbytes, self._pagemap)
            if key not in self._released:
                return
        self._hand_back(key)

    def _hand_back(self, key: str) -> int:
        with self._lock:
            ref = self._released.pop(key, None)
        if ref is None:
            return 0
        if ref.slot < 0:
            return int(self._unlink(ref.location))
        try:
            return int(self._map(ref.location).hand_back(ref.slot, ref.gen))
        except (PayloadMissing, UndecodablePayload):
            return 0                     # the arena is gone, or is not one: nothing to hand back

    def segments(self) -> Iterator[Segment]:
        """Our segments of their own (this prefix) in the shared-memory directory."""
        for name in self._names():
            seg = parse_name(name)
            if seg is not None:
                yield seg

    def arena_files(self) -> Iterator[ArenaFile]:
        """Every arena of this prefix in the shared-memory directory (ours and other processes')."""
        for name in self._names():
            found = parse_arena(name)
            if found is not None:
                yield found

    def _names(self) -> list[str]:
        try:
            return [entry.name for entry in os.scandir(self.directory) if entry.name.startswith(self._mine)]
        except FileNotFoundError:
            return []

    def payloads(self) -> list[str]:
        """What of ours holds shared memory for a payload now: segments by name, arena slots in use as
        `<arena>#<slot>` (an arena that holds nothing is not listed)."""
        out = [seg.name for seg in self.segments()]
        for item in self.inventory():
            if item.arena and item.slot >= 0:
                out.append(f"{item.segment.name}#{item.slot}")
        return sorted(out)

    async def release_workflow(self, wf_id: str) -> int:
        """Free one workflow's payloads on this host: its segments, and the slots of our arenas (other
        producers free theirs when they hear of the abort, or at their sweep)."""
        part = name_part(wf_id)
        freed = sum(self._unlink(seg.name) for seg in self.segments() if seg.wf_id == part)
        for arena in list(self.pool.arenas):
            with arena.lock:
                freed += arena.take_back([s for s, held in arena.held.items() if held.wf_id == wf_id])
        return freed

    def release_all(self) -> int:
        """Free every arena and segment of this prefix (tests, `omniflow purge`)."""
        self.close()
        self._forget_maps(everything=True)
        return sum(self._unlink(name) for name in self._names()
                   if parse_name(name) is not None or parse_arena(name) is not None)

    def close(self) -> int:
        """At shutdown: unmap our arenas; unlink those nothing in use is left in (the others stay for
        their consumers, and go with the sweep once their workflows end). Returns how many went."""
        return self.pool.close()

    def _forget_maps(self, *, everything: bool = False) -> None:
        """Drop our mappings of arenas that were unlinked (or all): pages of a removed file stay
        allocated while anyone maps them."""
        with self._lock:
            drop = [name for name, m in self._maps.items() if everything or not m.linked()]
            for name in drop:
                self._maps.pop(name).close()
                self._known.pop(name, None)

    # ------------------------------------------------------------ sweep
    def inventory(self) -> list[Found]:
        """Every payload of this prefix on the host with its header: what `sweep` decides on. Slots of
        our own arenas come from our bookkeeping; other arenas are read from their files."""
        found = [Found(seg, info, segment.is_free(path), short=segment.is_short(path, info))
                 for seg in self.segments() for path in [os.path.join(self.directory, seg.name)]
                 for info in [segment.read_header(path)]]
        own = {a.name: a for a in self.pool.arenas}
        for af in self.arena_files():
            arena = own.get(af.name)
            slots: list[tuple[int, codec.FrameInfo | None]]
            if arena is not None:
                with arena.lock:
                    arena.reclaim(force=True)
                    slots = [(slot, codec.FrameInfo(0, 0, held.expiry_ms, [held.wf_id]))
                             for slot, held in arena.held.items()]
            else:
                scanned = arenas.scan(os.path.join(self.directory, af.name))
                slots = [(item.slot, item.info) for item in scanned or []]
            for slot, info in slots:
                owner = info.owner if info else []
                seg = Segment(af.name, af.prefix, af.worker, name_part(str(owner[0])) if owner else "",
                              "", "", 0, 0)
                found.append(Found(seg, info, slot=slot, arena=True))
            if not slots:
                found.append(Found(Segment(af.name, af.prefix, af.worker, "", "", "", 0, 0), None, arena=True))
        return found

    def sweep(self, found: Sequence[Found], *, live_wfs: set[str] | None, live_workers: set[str] | None,
              now_ms: int | None = None) -> dict[SweepReason, int]:
        """Free what of `found` `sweep_verdict` condemns; counts by reason. A slot of our own arena is
        taken back; another producer's arena goes when its producer is dead and nothing in it lives
        (a live producer takes back its own slots at its sweep)."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        freed = {reason: 0 for reason in SweepReason}
        by_arena: dict[str, list[tuple[Found, SweepReason | None]]] = {}
        for item in found:
            reason = sweep_verdict(item, now_ms=now, live_wfs=live_wfs, live_workers=live_workers)
            if item.arena:
                by_arena.setdefault(item.segment.name, []).append((item, reason))
            elif reason is not None and self._unlink(item.segment.name):
                freed[reason] += 1
                logger.info("swept segment %s (%s)", item.segment.name, reason.value)
        own = {a.name: a for a in self.pool.arenas}
        for name, items in by_arena.items():
            arena = own.get(name)
            if arena is not None:
                doomed = [(item.slot, reason) for item, reason in items if reason is not None and item.slot >= 0]
                with arena.lock:
                    arena.take_back([slot for slot, _ in doomed])
                for _slot, why in doomed:
                    if why is not None:
                        freed[why] += 1
                continue
            worker = items[0][0].segment.worker
            dead = live_workers is not None and worker not in {name_part(w) for w in live_workers}
            if dead and all(reason is not None for _, reason in items) and self._unlink(name):
                for item, reason in items:
                    if reason is not None and (item.slot >= 0 or len(items) == 1):
                        freed[reason] += 1
                logger.info("swept arena %s of dead worker %s", name, worker)
        self._forget_maps()
        return freed


def _room(directory: Path) -> int | None:
    """Bytes free in the shared-memory directory's filesystem (None: cannot tell)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _slot_key(ref: Ref) -> str:
    return f"{ref.location}#{ref.slot}.{ref.gen}"
