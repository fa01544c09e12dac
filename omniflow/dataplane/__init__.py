"""The tensor data plane: how chunk payloads travel from a producing stage to its consumer.

Transports behind one interface (`base.Transport`): inline in the stream entry (`inline`), a
Redis key with a TTL referenced by the entry (`rediskey`), a shared-memory segment on the same
host referenced by the entry (`shm`). `plane.DataPlane` picks one per chunk (`policy`), resolves
references on the consumer side and owns release and sweep. `codec` is the payload encoding
(numpy arrays and torch tensors by dtype and shape; never pickle).
"""
from __future__ import annotations

from omniflow.dataplane.base import (
    BadReference, ChecksumMismatch, DataPlaneError, ForeignReference, InputLost, PayloadMissing, PayloadTruncated,
    PutContext, Ref, SharedMemoryRefused, SizeMismatch, Transport, TransportKind, UndecodablePayload, WrongHost,
)
from omniflow.dataplane.plane import DataPlane, ref_field

__all__ = [
    "BadReference", "ChecksumMismatch", "DataPlane", "DataPlaneError", "ForeignReference", "InputLost",
    "PayloadMissing", "PayloadTruncated", "PutContext", "Ref", "SharedMemoryRefused", "SizeMismatch", "Transport",
    "TransportKind", "UndecodablePayload", "WrongHost", "ref_field",
]
