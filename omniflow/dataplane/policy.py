"""Which transport carries one chunk: a pure function of its size and where its consumer is."""
from __future__ import annotations

from omniflow.config import DataPlaneMode
from omniflow.dataplane.base import TransportKind


def choose_transport(nbytes: int, *, mode: DataPlaneMode, inline_max_bytes: int, shm_min_bytes: int,
                     same_host: bool, shm_available: bool) -> TransportKind:
    """The transport for a payload of about `nbytes`.

    auto: inline up to `inline_max_bytes`; above it shared memory when the consuming replica is on
    this host (and the payload is at least `shm_min_bytes`), else a Redis key (every cross-host case).
    A forced mode applies to every chunk, except that shared memory falls back to a Redis key when
    the consumer is not on this host (or this host has no shared memory): it could not read it.
    """
    can_shm = same_host and shm_available
    if mode is DataPlaneMode.INLINE:
        return TransportKind.INLINE
    if mode is DataPlaneMode.REDIS:
        return TransportKind.REDIS
    if mode is DataPlaneMode.SHM:
        return TransportKind.SHM if can_shm else TransportKind.REDIS
    if nbytes <= inline_max_bytes:
        return TransportKind.INLINE
    if can_shm and nbytes >= shm_min_bytes:
        return TransportKind.SHM
    return TransportKind.REDIS
