"""A session's input stream: first the catch-up the claim returned, then the chunks forwarded to
the worker's inbox; de-duplicated on `(stage, seq)`, ending at every upstream's end-of-stream;
payload references resolved through the data plane, the read position reported for backpressure."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator
from typing import Any

from omniflow import tracing
from omniflow.dataplane import codec
from omniflow.dataplane.base import InputLost, PayloadMissing, Ref, TransportKind, WrongHost
from omniflow.executor import Chunk
from omniflow.engine.compute import run_on, start_on
from omniflow.engine.session.outputs import SessionOutputs
from omniflow.errors import NonRetryableError
from omniflow.models import SessionState, StageStatus
from omniflow.storage.schema import StageField

# a compute thread's session that started running and wrote nothing since: its status is written alone
# (else it rides on its first emit; under load a session may wait longer than this for its thread)
STATUS_ALONE_AFTER_S = 0.1
INPUT_BATCH = 256       # raw chunks one hop from a compute thread to the worker's loop may bring back
READY_WAIT_S = 0.05     # how long a compute thread blocks for chunks already in before it yields instead


class SessionInputs(SessionOutputs):
    """What a session reads (and, below it, what it writes)."""

    async def inputs(self) -> AsyncIterator[Chunk]:
        """Chunks from every upstream edge, in order, until all have ended.

        First what the edge logs held when the session was claimed (the catch-up the claim
        returned), then what the producers forward to this worker's inbox.
        """
        open_srcs = set(self.upstream)
        taken = self._taken
        remote = self._remote()
        while open_srcs:
            if taken:       # taken from the queue in an earlier batch (a compute thread's)
                src, fields = taken.popleft()
            elif remote:    # one hop to the worker's loop brings every chunk that is there
                taken.extend(await self._remote_batch(open_srcs))
                continue
            else:           # what is already here is taken without a coroutine (the common case under load)
                ready = self._next_ready()
                src, fields = ready if ready is not None else await self._next_raw(open_srcs)
            if fields.get(b"eos"):
                open_srcs.discard(src)
                continue
            seq = self._seq_of(src, fields)
            if seq <= self._last_in.get(src, 0):
                continue   # replayed or duplicated: consumers are idempotent on (stage, seq)
            chunk = self._decode_inline(src, seq, fields) or await self._decode(src, seq, fields)
            self._last_in[src] = chunk.seq
            self._note_read(src, chunk.seq, fields)
            if self._span is not None:
                tracing.chunk_event(self._span, "in", src, chunk.seq)
            yield chunk

    async def _remote_batch(self, open_srcs: set[str]) -> list[tuple[str, dict[bytes, bytes]]]:
        """`_next_batch`, from a compute thread. When chunks already wait on the worker's loop (this
        session alone takes them, so they are still there when the loop runs it), the thread blocks
        for the hop instead of yielding to the other sessions on its loop: a session whose next
        chunk, or end of stream, is in keeps running, as on the worker's loop (`_next_ready`) or
        with a local queue. Yielding sent it behind every other session's turn on the thread (a
        vocoder's sessions: a whole step each), so its end waited for theirs (bench/notes.md,
        round 13). With nothing there yet, it yields as before."""
        assert self._home is not None
        if self._catchup_pos >= len(self._catchup) and self._queue.empty():   # read across threads: a hint
            return await run_on(self._home, self._next_batch(open_srcs))
        fut = start_on(self._home, self._next_batch(open_srcs))
        try:
            return fut.result(timeout=READY_WAIT_S)
        except concurrent.futures.TimeoutError:     # the worker's loop is busy: wait without blocking the thread
            return await asyncio.wrap_future(fut)
        except concurrent.futures.CancelledError:   # cancelled there (the worker stopping): as `run_on` says it
            raise asyncio.CancelledError from None

    def _next_ready(self) -> tuple[str, dict[bytes, bytes]] | None:
        """The next raw chunk if one is here already (catch-up first, then the inbox queue), else
        None; runs on the worker's loop."""
        if self._catchup_pos < len(self._catchup):
            src, fields = self._catchup[self._catchup_pos]
            self._catchup_pos += 1
        elif not self._queue.empty():
            src, fields = self._queue.get_nowait()
        else:
            return None
        return self._took(src, fields)

    async def _next_batch(self, open_srcs: set[str]) -> list[tuple[str, dict[bytes, bytes]]]:
        """The next raw chunk (waiting for it if none is here yet) and every one already here after it,
        up to `INPUT_BATCH`; runs on the worker's loop, for a session read from a compute thread."""
        batch = [await self._next_raw(open_srcs)]
        while len(batch) < INPUT_BATCH and (ready := self._next_ready()) is not None:
            batch.append(ready)
        return batch

    def _took(self, src: str, fields: dict[bytes, bytes]) -> tuple[str, dict[bytes, bytes]]:
        if self.state is SessionState.WAITING_INPUT and not fields.get(b"eos"):
            self.state, self._status = SessionState.RUNNING, StageStatus.RUNNING.value
            if self._home is None:
                self._schedule()
            else:
                # read by a compute thread: the status rides on its first emit (or its finish), as on
                # this loop when the executor emits before it yields; written alone if neither comes soon
                self._home.call_later(STATUS_ALONE_AFTER_S, self._schedule_pending)
        return src, fields

    async def _next_raw(self, open_srcs: set[str]) -> tuple[str, dict[bytes, bytes]]:
        """The next raw chunk, waiting for it if none is here yet; runs on the worker's loop."""
        ready = self._next_ready()
        if ready is not None:
            return ready
        # the worker's watchdog cancels this wait if it outlasts the input timeout
        self.waiting_since = time.monotonic()
        self._waiter = asyncio.current_task()
        try:
            src, fields = await self._queue.get()
        except asyncio.CancelledError:
            if self.input_timed_out:
                raise NonRetryableError(
                    f"stage {self.stage}: no input from {sorted(open_srcs)} within {self._input_timeout_s:g}s"
                ) from None
            raise
        finally:
            self.input_wait_s += time.monotonic() - self.waiting_since
            self.waiting_since = 0.0
            self._waiter = None
        return self._took(src, fields)

    def _seq_of(self, src: str, fields: dict[bytes, bytes]) -> int:
        try:
            return int(fields[b"seq"])
        except (KeyError, ValueError, TypeError) as exc:
            raise NonRetryableError(f"stage {self.stage}: malformed chunk from {src}: {exc!r}") from exc

    def _decode_inline(self, src: str, seq: int, fields: dict[bytes, bytes]) -> Chunk | None:
        """The chunk, when its payload is inline (no reference to resolve); else None."""
        inline = fields.get(b"d")
        a = fields.get(b"a")
        if inline is None or a is None:
            return None
        try:
            return Chunk(src=src, seq=seq, attempt=int(a), data=codec.loads(inline))
        except (ValueError, TypeError) as exc:
            raise NonRetryableError(f"stage {self.stage}: malformed chunk from {src}: {exc!r}") from exc

    async def _decode(self, src: str, seq: int, fields: dict[bytes, bytes]) -> Chunk:
        """The chunk with its payload: inline (`d`), or resolved from its reference (`r`); a reference
        that cannot be honoured fails the session with a `DataPlaneError` saying why (`InputLost` for
        a payload that is gone or on another host: the worker has its producer run again)."""
        try:
            attempt = int(fields[b"a"])
            inline = fields.get(b"d")
            if inline is not None or self._plane is None or b"r" not in fields:
                return Chunk(src=src, seq=seq, attempt=attempt, data=codec.loads(fields[b"d"]))
            ref = Ref.unpack(fields[b"r"])
        except (KeyError, ValueError, TypeError) as exc:
            raise NonRetryableError(f"stage {self.stage}: malformed chunk from {src}: {exc!r}") from exc
        plane = self._plane
        try:
            if ref.kind is TransportKind.SHM and plane.shm is not None:
                data = plane.shm.get_sync(ref, wf_id=self.wf_id)       # a mapping: cheap on any thread
            else:
                data = await self._on_home(plane.get(ref, wf_id=self.wf_id))
        except (PayloadMissing, WrongHost) as exc:
            raise InputLost(f"stage {self.stage}: chunk {seq} from {src} cannot be read here: {exc}",
                            src=src, seq=seq) from exc
        self.held.append(ref)
        return Chunk(src=src, seq=seq, attempt=attempt, data=data)

    def _note_read(self, src: str, seq: int, fields: dict[bytes, bytes]) -> None:
        """Report how far this session has read `src`'s edge, every quarter of its producer's bound."""
        if self._plane is None:
            return
        every_chunks, every_bytes = self._plane.read_report_every
        if not every_chunks and not every_bytes:
            return
        raw = fields.get(b"d") or fields.get(b"r") or b""
        nbytes = len(raw) if b"d" in fields else (self.held[-1].nbytes if self.held else len(raw))
        chunks, size = self._unreported.get(src, (0, 0))
        chunks, size = chunks + 1, size + nbytes
        if (every_chunks and chunks >= every_chunks) or (every_bytes and size >= every_bytes):
            self._send_home("HSET", self._keys.stages(self.wf_id), StageField.read_pos(self.stage, src), seq)
            chunks, size = 0, 0
        self._unreported[src] = (chunks, size)

    def _send_home(self, *command: Any) -> None:
        """Queue a write on the worker's batcher without waiting for it (from any thread)."""
        self._call_home(self._batcher.send, *command)
