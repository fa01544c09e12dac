"""Executors that stop in the middle of a shared-memory transfer, for a test to SIGKILL them there.

A worker *process* serving one of these, started with `OMNIFLOW_TEST_KILLPOINT=<where>:<seq>:<mark>`,
writes (or reads) chunk `seq` half-way, creates the file `mark` and blocks until it is killed:

- `arena`, `segment`: the producer's copy of chunk `seq`'s frame into its arena slot / its segment of
  its own stops after half of the data (the half-copied bytes are real, in the real file);
- `read`: the consumer has chunk `seq` mapped and has digested half of its array when it stops.

Without the variable (a replacement worker in the test process) they behave as `BigProducer` and
`DigestConsumer`. The kill is the test's, the processes and files are real: only *where* the process
is when it dies is chosen, instead of raced for.
"""
from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dataplane_fixtures import BigProducer, DigestConsumer
from omniflow.dataplane import arena, codec, segment
from omniflow.workers.base import Session

ENV = "OMNIFLOW_TEST_KILLPOINT"


def killpoint() -> tuple[str, int, Path] | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    where, seq, mark = raw.split(":", 2)
    return where, int(seq), Path(mark)


def _stop_here(mark: Path) -> None:
    mark.touch()
    while True:                 # blocks the process (its loop too) until the test's SIGKILL
        time.sleep(3600)


def _half(frame: codec.Frame) -> codec.Frame:
    """The frame's head and the first half of its first buffer: what a copy cut off half-way wrote."""
    first = frame.buffers[0]
    return codec.Frame(frame.head, [first[:first.nbytes // 2]], frame.offsets[:1], frame.nbytes, frame.checksum)


def _seq_of(frame: codec.Frame) -> int:
    return int(codec.frame_info(frame.head).owner[4])         # owner: wf, src, dst, attempt, seq, worker


class StallingProducer(BigProducer):
    """`BigProducer`; with a kill point `arena`/`segment`, its copy of chunk `seq` stops half-way."""

    async def setup(self) -> None:
        point = killpoint()
        if point is None or point[0] not in ("arena", "segment"):
            return
        where, seq, mark = point
        if where == "arena":
            write = arena.Arena.write

            def arena_write(self: arena.Arena, offset: int, frame: codec.Frame) -> None:
                if _seq_of(frame) != seq:
                    return write(self, offset, frame)
                write(self, offset, _half(frame))
                _stop_here(mark)

            arena.Arena.write = arena_write         # type: ignore[method-assign]
        else:
            writev = segment._writev_all

            def segment_writev(fd: int, parts: Sequence[bytes | memoryview]) -> None:
                try:                        # [control block, frame head, the array's bytes]
                    ours = int(codec.frame_info(bytes(parts[1])).owner[4]) == seq
                except Exception:  # noqa: BLE001 - not a frame head: someone else's write
                    ours = False
                if not ours:
                    return writev(fd, parts)
                data = memoryview(parts[-1]).cast("B")
                writev(fd, [*parts[:-1], data[:data.nbytes // 2]])
                _stop_here(mark)

            segment._writev_all = segment_writev


class StallingConsumer(DigestConsumer):
    """`DigestConsumer`; with a kill point `read`, it stops half-way through digesting chunk `seq`
    (its views of the shared memory alive, nothing released)."""

    async def run(self, session: Session) -> Mapping[str, Any]:
        point = killpoint()
        if point is None or point[0] != "read":
            return await super().run(session)
        _, seq, mark = point
        digest = hashlib.sha256()
        async for chunk in session.inputs():
            h = chunk.data["h"]
            if chunk.seq == seq:
                digest.update(h[: h.size // 2].tobytes())          # half of it read from the mapping
                _stop_here(mark)
            digest.update(h.tobytes())
        return {"chunks": 0}
