"""One stage's work on one workflow, as an executor sees it.

An executor reads `inputs()` (first the catch-up the claim returned, then the
chunks forwarded to the worker's inbox; de-duplicated on `(stage, seq)`, ending
at every upstream's end-of-stream) and calls `emit()` for each output step.
Emits are queued on the worker's group-commit batcher as one lazily built
`emit.lua` call: steps emitted while the previous write is on the wire join the
next call, and the session's finish (`close()`) rides on its last one. `emit()`
returns without waiting for the round trip unless too many writes are in flight;
the first failed or refused write is sticky (no step is ever written past a hole).

Resume: a retried session starts with `resume_seq` = how many steps earlier
attempts already wrote. Steps up to it are suppressed without touching Redis,
so a deterministic executor that starts over produces no duplicate; an
autoregressive one calls `fast_forward()` and continues from the text it gets
back (prefill prompt + emitted tokens), or from `checkpoint`: what earlier
attempts checkpointed with their steps (`emit(checkpoint=...)`, written in the
same atomic step, so it always matches `resume_seq`).

Threads: an executor may run on its stage's compute thread (`omniflow.compute`).
The session belongs to the worker's event loop (`_home`); called from another
loop, `emit` encodes the step on the caller's thread and hands it over without
waiting, and `inputs`/`flush` run their Redis-facing part on the worker's loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgpack
import numpy as np

from omniflow import codec
from omniflow.errors import Fenced, NonRetryableError, RedisUnavailable
from omniflow.scripts import EmitResult, evalsha_args

if TYPE_CHECKING:
    from omniflow.batcher import Batcher
    from omniflow.keys import Keys

logger = logging.getLogger(__name__)

MAX_EMITS_IN_FLIGHT = 64

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One input chunk from an upstream stage."""

    src: str
    seq: int
    attempt: int
    data: Any


@dataclass
class Session:
    wf_id: str
    stage: str
    attempt: int
    input: dict[str, Any]
    params: dict[str, Any]
    finals: tuple[str, ...]
    downstream: tuple[str, ...]
    resume_seq: int
    _batcher: Batcher
    _keys: Keys
    upstream: tuple[str, ...] = ()
    required: tuple[str, ...] = ()        # every stage this workflow runs
    _queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    _catchup: list[tuple[str, dict[bytes, bytes]]] = field(default_factory=list)
    _catchup_pos: int = 0
    _input_timeout_s: float = 120.0
    seq: int = 0
    waiting_input: bool = False
    fenced: bool = False
    aborted: bool = False
    _inflight: set[asyncio.Future[Any]] = field(default_factory=set)
    waiting_since: float = 0.0          # monotonic time this session started waiting for input (0: not waiting)
    input_timed_out: bool = False
    _steps: list[list[Any]] = field(default_factory=list)
    _status: str = ""
    _finish: tuple[list[str], bytes] | None = None
    _open: asyncio.Future[Any] | None = None      # the queued write that is not built yet (takes more steps)
    _last_in: dict[str, int] = field(default_factory=dict)
    _write_error: BaseException | None = None
    checkpoint: str = ""                # what earlier attempts checkpointed (resume), see emit(checkpoint=)
    _home: asyncio.AbstractEventLoop | None = None   # the worker's loop (None: always called from it)
    _waiter: asyncio.Task[Any] | None = None         # the task waiting for input (the watchdog interrupts it)
    _closed: bool = False

    @property
    def text(self) -> str:
        return str(self.input.get("text", ""))

    @property
    def is_final(self) -> bool:
        return self.stage in self.finals

    # ------------------------------------------------------------ threads
    def _remote(self) -> bool:
        """True when called from a loop other than the worker's (the stage's compute thread)."""
        return self._home is not None and asyncio.get_running_loop() is not self._home

    async def _on_home(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the worker's loop and await it from wherever we are."""
        if not self._remote():
            return await coro
        assert self._home is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._home))

    # ------------------------------------------------------------ inputs
    async def inputs(self) -> AsyncIterator[Chunk]:
        """Chunks from every upstream edge, in order, until all have ended.

        First what the edge logs held when the session was claimed (the catch-up the claim
        returned), then what the producers forward to this worker's inbox.
        """
        open_srcs = set(self.upstream)
        while open_srcs:
            src, fields = await self._on_home(self._next_raw(open_srcs))
            chunk = self._decode(src, fields)
            if chunk is None:
                open_srcs.discard(src)
                continue
            if chunk.seq <= self._last_in.get(src, 0):
                continue   # replayed or duplicated: consumers are idempotent on (stage, seq)
            self._last_in[src] = chunk.seq
            yield chunk

    async def _next_raw(self, open_srcs: set[str]) -> tuple[str, dict[bytes, bytes]]:
        """The next raw chunk (catch-up first, then the inbox queue); runs on the worker's loop."""
        if self._catchup_pos < len(self._catchup):
            src, fields = self._catchup[self._catchup_pos]
            self._catchup_pos += 1
        elif self._queue.empty():
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
                self.waiting_since = 0.0
                self._waiter = None
        else:
            src, fields = self._queue.get_nowait()
        if self.waiting_input and not fields.get(b"eos"):
            self.waiting_input, self._status = False, "running"
            self._schedule()
        return src, fields

    def _decode(self, src: str, fields: dict[bytes, bytes]) -> Chunk | None:
        if fields.get(b"eos"):
            return None
        try:
            return Chunk(src=src, seq=int(fields[b"seq"]), attempt=int(fields[b"a"]), data=codec.loads(fields[b"d"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise NonRetryableError(f"stage {self.stage}: malformed chunk from {src}: {exc!r}") from exc

    # ------------------------------------------------------------ outputs
    def fast_forward(self) -> int:
        """Skip the steps earlier attempts already wrote; returns how many."""
        self.seq = max(self.seq, self.resume_seq)
        return self.seq

    async def emit(self, *, text: str | None = None, audio: np.ndarray | None = None,
                   sample_rate: int | None = None, data: Any = None,
                   to: Mapping[str, Any] | None = None, checkpoint: str | None = None) -> None:
        """Write one output step: a text delta, an audio chunk and/or a chunk for downstream stages.

        `data` goes to every downstream stage of this workflow; `to` maps a stage to its own payload.
        `checkpoint` is appended to the stage's durable resume state in the same atomic write as the
        step: a retried attempt finds everything checkpointed up to `resume_seq` in `self.checkpoint`.
        Steps queued while the previous write is on the wire go out together in one script call.
        """
        if self._write_error is not None:
            raise self._write_error
        if self.fenced or self._closed:
            raise Fenced(f"stage {self.stage} attempt {self.attempt} of {self.wf_id} no longer owns the session")
        self.seq += 1
        if self.seq <= self.resume_seq:
            return
        step = self._build_step(self.seq, text, audio, sample_rate, data, to, checkpoint)
        if self._remote():
            assert self._home is not None
            self._home.call_soon_threadsafe(self._push, step)
            if len(self._inflight) >= MAX_EMITS_IN_FLIGHT:
                await self.flush()
            return
        self._push(step)
        if len(self._inflight) >= MAX_EMITS_IN_FLIGHT:
            await self.flush()

    def _build_step(self, seq: int, text: str | None, audio: np.ndarray | None, sample_rate: int | None,
                    data: Any, to: Mapping[str, Any] | None, checkpoint: str | None) -> list[Any]:
        """One step's ops for `emit.lua` (payloads encoded here, on the caller's thread)."""
        step: list[Any] = [seq]
        if self.is_final and text:
            step += ["T", text, ""]
        if self.is_final and audio is not None:
            pcm = np.asarray(audio)
            if pcm.dtype != np.int16:
                pcm = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2")
            sr = int(sample_rate or 0)
            if sr <= 0:
                raise NonRetryableError(f"stage {self.stage}: audio needs a positive sample_rate")
            step += ["X", f":out:{self.stage}", ["seq", seq, "pcm", pcm.astype("<i2").tobytes(), "sr", sr],
                     "I", f"{self.stage}:samples", int(pcm.size), "H", f"{self.stage}:sr", sr,
                     "X", ":log", ["t", "audio", "stage", self.stage, "seq", seq, "samples", int(pcm.size), "sr", sr]]
        payloads = dict(to or {})
        if data is not None:
            payloads.update({dst: data for dst in self.downstream if dst not in payloads})
        for dst, payload in payloads.items():
            if dst in self.downstream:
                step += ["E", dst, ["seq", seq, "a", self.attempt, "d", codec.dumps(payload)]]
        if checkpoint:
            step += ["C", str(checkpoint), ""]
        return step

    def _push(self, step: list[Any]) -> None:
        """Queue one built step for the next `emit.lua` call (on the worker's loop)."""
        if self._closed:      # a compute thread emitting after its session was closed (abort, timeout)
            return
        if self.waiting_input:
            self.waiting_input, self._status = False, "running"
        self._steps.append(step)
        self._schedule()

    def _schedule(self) -> None:
        if self._open is None:
            self._open = self._batcher.send_lazy(self._emit_command)
            self._track(self._open)

    def _emit_command(self) -> tuple[Any, ...]:
        """Everything emitted since the last write, as one `emit.lua` call (built at flush time)."""
        steps, self._steps = self._steps, []
        status, self._status = self._status, ""
        self._open = None
        args = [self.stage, self.attempt, status, int(time.time() * 1000), self._keys.prefix, self.wf_id,
                msgpack.packb(steps, use_bin_type=False)]
        if self._finish is None:
            return evalsha_args("emit", [self._keys.wf(self.wf_id)], args)
        return evalsha_args("emit", [self._keys.wf(self.wf_id), *self._finish[0]], [*args, self._finish[1]])

    async def close(self, *, tasks_key: str, events_key: str, group: str, entry_id: str, outcome: str,
                    detail: str, retryable: bool) -> str:
        """Write what is left and end the session in the same script call (`emit.lua` + finish).

        The finish carries how many steps the session emitted; the script compares it with what is
        stored, so a session whose write was refused or lost is never closed as done: it is closed
        as a retryable failure instead ('gap'; the retry resumes from what was stored).
        Returns 'ok', 'fenced' or 'gap'; raises the error of the call itself (translated), after
        which calling `close` again is safe (the finish is fenced by status and by step count).
        """
        self._closed = True
        fin = [group, entry_id, outcome, detail, "1" if retryable else "0", self.seq, ",".join(self.downstream)]
        self._finish = ([tasks_key, events_key], msgpack.packb(fin, use_bin_type=False))
        if self._open is not None:
            last = self._open          # the pending write is still in the batcher's queue: the finish rides on it
        else:
            last = self._open = self._batcher.send_lazy(self._emit_command)
        earlier = [f for f in self._inflight if f is not last]
        if earlier:
            await asyncio.gather(*earlier, return_exceptions=True)
        result = await last
        code = result.decode() if isinstance(result, bytes) else str(result)
        return code if code in (EmitResult.FENCED, EmitResult.GAP) else EmitResult.OK.value

    def _track(self, fut: asyncio.Future[Any]) -> None:
        self._inflight.add(fut)
        fut.add_done_callback(self._settled)

    def _settled(self, fut: asyncio.Future[Any]) -> None:
        self._inflight.discard(fut)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            logger.warning("emit for %s/%s failed: %s", self.wf_id, self.stage, exc)
            # Sticky: later steps must not be written past the hole this one leaves (chaos suite).
            self._write_error = self._write_error or exc
            return
        result = fut.result()
        code = result.decode() if isinstance(result, bytes) else result
        if code == EmitResult.FENCED:
            self.fenced = True
        elif code == "gap":     # emit.lua refused steps after a lost write: end this attempt, retry resumes
            self._write_error = self._write_error or RedisUnavailable(
                f"stage {self.stage} attempt {self.attempt} of {self.wf_id}: an earlier write was lost")

    async def flush(self) -> None:
        """Wait until every emit so far is written; raise `Fenced` if one was refused."""
        await self._on_home(self._flush())

    async def _flush(self) -> None:
        if self._inflight:
            done = await asyncio.gather(*list(self._inflight), return_exceptions=True)
            for result in done:
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    raise result
        self.raise_if_broken()

    def raise_if_broken(self) -> None:
        """Raise the first lost write of this attempt, or `Fenced` if a write was refused."""
        if self._write_error is not None:
            raise self._write_error
        if self.fenced:
            raise Fenced(f"stage {self.stage} attempt {self.attempt} of {self.wf_id} was fenced off")

