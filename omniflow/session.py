"""One stage's work on one workflow, as an executor sees it.

An executor reads `inputs()` (chunks from upstream edges, de-duplicated on
`(stage, seq)`, ending at every upstream's end-of-stream) and calls `emit()`
for each output step. Every emit is one fenced, seq-idempotent Lua call
(`emit.lua`) queued on the worker's group-commit batcher; it returns without
waiting for the round trip unless too many are in flight.

Resume: a retried session starts with `resume_seq` = how many steps earlier
attempts already wrote. Steps up to it are suppressed without touching Redis,
so a deterministic executor that starts over produces no duplicate; an
autoregressive one calls `fast_forward()` and continues from the text it gets
back (prefill prompt + emitted tokens).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from omniflow import codec
from omniflow.errors import Fenced, NonRetryableError
from omniflow.scripts import EmitResult

if TYPE_CHECKING:
    from omniflow.batcher import Batcher
    from omniflow.keys import Keys

logger = logging.getLogger(__name__)

MAX_EMITS_IN_FLIGHT = 64


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
    _queues: dict[str, asyncio.Queue[Any]] = field(default_factory=dict)
    _input_timeout_s: float = 120.0
    seq: int = 0
    waiting_input: bool = False
    fenced: bool = False
    aborted: bool = False
    _inflight: set[asyncio.Future[Any]] = field(default_factory=set)
    _last_in: dict[str, int] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return str(self.input.get("text", ""))

    @property
    def is_final(self) -> bool:
        return self.stage in self.finals

    # ------------------------------------------------------------ inputs
    async def inputs(self) -> AsyncIterator[Chunk]:
        """Chunks from every upstream edge, in arrival order, until all have ended."""
        if not self._queues:
            return
        merged: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(src, q, merged)) for src, q in self._queues.items()]
        open_srcs = set(self._queues)
        try:
            while open_srcs:
                try:
                    src, entry = await asyncio.wait_for(merged.get(), self._input_timeout_s)
                except asyncio.TimeoutError:
                    raise NonRetryableError(
                        f"stage {self.stage}: no input from {sorted(open_srcs)} within {self._input_timeout_s:g}s"
                    ) from None
                chunk = self._decode(src, entry)
                if chunk is None:
                    open_srcs.discard(src)
                    continue
                if chunk.seq <= self._last_in.get(src, 0):
                    continue   # replayed or duplicated: consumers are idempotent on (stage, seq)
                self._last_in[src] = chunk.seq
                if self.waiting_input:
                    self.waiting_input = False
                    self._track(self._batcher.send(*self._emit_command(0, "running", [])))
                yield chunk
        finally:
            for pump in pumps:
                pump.cancel()

    @staticmethod
    async def _pump(src: str, queue: asyncio.Queue[Any], merged: asyncio.Queue[tuple[str, Any]]) -> None:
        while True:
            merged.put_nowait((src, await queue.get()))

    def _decode(self, src: str, entry: Any) -> Chunk | None:
        _eid, fields = entry
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
                   to: Mapping[str, Any] | None = None) -> None:
        """Write one output step: a text delta, an audio chunk and/or a chunk for downstream stages.

        `data` goes to every downstream stage of this workflow; `to` maps a stage to its own payload.
        """
        if self.fenced:
            raise Fenced(f"stage {self.stage} attempt {self.attempt} of {self.wf_id} no longer owns the session")
        self.seq += 1
        if self.seq <= self.resume_seq:
            return
        seq = str(self.seq)
        ops: list[Any] = []
        if self.is_final and text:
            ops += ["A", f":out:{self.stage}", text,
                    "X", ":log", 4, "t", "text", "stage", self.stage, "seq", seq, "delta", text]
        if self.is_final and audio is not None:
            pcm = np.asarray(audio)
            if pcm.dtype != np.int16:
                pcm = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2")
            sr = int(sample_rate or 0)
            if sr <= 0:
                raise NonRetryableError(f"stage {self.stage}: audio needs a positive sample_rate")
            ops += ["X", f":out:{self.stage}", 3, "seq", seq, "pcm", pcm.astype("<i2").tobytes(), "sr", sr,
                    "I", f"{self.stage}:samples", int(pcm.size), "H", f"{self.stage}:sr", sr,
                    "X", ":log", 5, "t", "audio", "stage", self.stage, "seq", seq, "samples", int(pcm.size),
                    "sr", sr]
        payloads = dict(to or {})
        if data is not None:
            payloads.update({dst: data for dst in self.downstream if dst not in payloads})
        for dst, payload in payloads.items():
            if dst not in self.downstream:
                continue
            ops += ["X", f":edge:{self.stage}:{dst}", 3, "seq", seq, "a", self.attempt, "d", codec.dumps(payload)]
        status = ""
        if self.waiting_input:
            self.waiting_input, status = False, "running"
        self._track(self._batcher.send(*self._emit_command(self.seq, status, ops)))
        if len(self._inflight) >= MAX_EMITS_IN_FLIGHT:
            await self.flush()

    def _emit_command(self, seq: int, status: str, ops: list[Any]) -> tuple[Any, ...]:
        from omniflow.scripts import evalsha_args

        return evalsha_args("emit", [self._keys.wf(self.wf_id)],
                            [self.stage, self.attempt, seq, status, int(time.time() * 1000), *ops])

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
            return
        result = fut.result()
        if (result.decode() if isinstance(result, bytes) else result) == EmitResult.FENCED:
            self.fenced = True

    async def flush(self) -> None:
        """Wait until every emit so far is written; raise `Fenced` if one was refused."""
        if self._inflight:
            done = await asyncio.gather(*list(self._inflight), return_exceptions=True)
            for result in done:
                if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                    raise result
        if self.fenced:
            raise Fenced(f"stage {self.stage} attempt {self.attempt} of {self.wf_id} was fenced off")
