"""Inline transport: the payload travels inside the stream entry itself (small chunks).

The fast path: one msgpack encoding, nothing else to create, release or sweep.
"""
from __future__ import annotations

from typing import Any

from omniflow.dataplane import codec
from omniflow.dataplane.base import PutContext, Ref, Transport, TransportKind


class InlineTransport(Transport):
    """Payloads by value in the entry: `Ref.data` is the encoded payload."""

    kind = TransportKind.INLINE

    async def put(self, payload: Any, ctx: PutContext) -> Ref:
        return self.encode(payload)

    @staticmethod
    def encode(payload: Any) -> Ref:
        data = codec.dumps(payload)
        return Ref(TransportKind.INLINE, nbytes=len(data), data=data)

    async def get(self, ref: Ref, *, wf_id: str | None = None) -> Any:
        return codec.loads(ref.data)
