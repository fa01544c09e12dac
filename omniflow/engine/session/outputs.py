"""A session's outputs: `emit` (one step, encoded on the caller's thread, queued on the worker's
group-commit batcher as one lazily built `emit.lua` call), `close` (the finish rides on the last
write), `flush`, and the data-plane side of a step (payload transport, backpressure)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from omniflow.dataplane import codec
from omniflow.dataplane.backpressure import EdgeWindow, WaitStats, wait_for_room
from omniflow.dataplane.base import TransportKind
from omniflow.dataplane.codec import payload_nbytes
from omniflow.engine.session.core import ACTIVE, SessionCore
from omniflow.errors import Fenced, NonRetryableError, RedisUnavailable
from omniflow.models import SessionState, StageStatus
from omniflow.storage.scripts import EmitResult, evalsha_args
from omniflow.storage.usage import Meter

logger = logging.getLogger(__name__)

MAX_EMITS_IN_FLIGHT = 64
DOMAIN_RECHECK_S = 0.5      # how often a producer asks again where a not-yet-claimed consumer runs
DOMAIN_REFRESH_S = 5.0      # ... and where a claimed one runs (a retry may have moved it to another host)


class SessionOutputs(SessionCore):
    """What a session writes."""

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
        if self.state not in ACTIVE:
            raise Fenced(f"stage {self.stage} attempt {self.attempt} of {self.wf_id} no longer owns the session")
        self.seq += 1
        if self.seq <= self.resume_seq:
            return
        sizes: dict[str, int] = {}
        if self._plane is not None and (data is not None or to):
            sizes, must_wait = self._sizes(data, to)
            if must_wait:
                await self._admit(sizes)
        step = self._build_step(self.seq, text, audio, sample_rate, data, to, checkpoint, sizes)
        for dst, nbytes in sizes.items():
            window = self._windows.get(dst)
            if window is not None:
                window.sent(self.seq, nbytes)
                if self._bp is not None:
                    self._bp.saw(window)
        if self._remote():
            assert self._home is not None
            self._home.call_soon_threadsafe(self._push, step)
            if len(self._inflight) >= MAX_EMITS_IN_FLIGHT:
                await self.flush()
            if self._slots is not None and self._slots_say_give_way():
                await self._on_home(self._slots.give_way(self.priority, self.tenant))
            return
        self._push(step)
        if len(self._inflight) >= MAX_EMITS_IN_FLIGHT:
            await self.flush()
        if self._slots is not None and self._slots.should_give_way(self.priority, self.tenant):
            await self._slots.give_way(self.priority, self.tenant)    # a chunk boundary: live traffic, fair turns

    def _slots_say_give_way(self) -> bool:
        """`should_give_way`, read from the compute thread (the slots live on the worker's loop: a read
        that races a change is only a hint, and `give_way` decides again on the loop)."""
        assert self._slots is not None
        try:
            return self._slots.should_give_way(self.priority, self.tenant)
        except RuntimeError:        # a dict changed under the read
            return False

    def _sizes(self, data: Any, to: Mapping[str, Any] | None) -> tuple[dict[str, int], bool]:
        """Each payload's size by stage, and whether `_admit` must run before the step is built (a
        `chunk` edge without room, or a large payload whose consumer's host is not known yet)."""
        assert self._plane is not None
        s = self._plane.settings
        sizes: dict[str, int] = {}
        must_wait = False
        bounded = s.dataplane_edge_max_chunks > 0 or s.dataplane_edge_max_bytes > 0
        for dst in self.downstream:
            payload = (to or {}).get(dst, data)
            if payload is None:
                continue
            nbytes = sizes[dst] = payload_nbytes(payload)
            if bounded and dst in self._chunk_dsts:
                window = self._windows.get(dst)
                if window is None:
                    window = self._windows[dst] = EdgeWindow(max_chunks=s.dataplane_edge_max_chunks,
                                                             max_bytes=s.dataplane_edge_max_bytes)
                must_wait = must_wait or not window.has_room(nbytes)
            if nbytes > s.dataplane_inline_max_bytes and self._domain_of is not None:
                domain, when = self._domains.get(dst, ("", 0.0))
                must_wait = must_wait or time.monotonic() - when > (DOMAIN_REFRESH_S if domain else DOMAIN_RECHECK_S)
        return sizes, must_wait

    async def _admit(self, sizes: dict[str, int]) -> None:
        """Before a step with payloads: wait while a `chunk` edge has too much unread (backpressure),
        and learn where a large payload's consumer runs."""
        assert self._plane is not None
        s = self._plane.settings
        for dst, nbytes in sizes.items():
            window = self._windows.get(dst)
            if window is not None and not window.has_room(nbytes):
                self.backpressure_wait_s += await wait_for_room(
                    window, nbytes, functools.partial(self._position_of, dst), self._bp or WaitStats())
            if nbytes > s.dataplane_inline_max_bytes and self._domain_of is not None:
                domain, when = self._domains.get(dst, ("", 0.0))
                if time.monotonic() - when > (DOMAIN_REFRESH_S if domain else DOMAIN_RECHECK_S):
                    # the consuming session's replica (once it is claimed); until then: a Redis key
                    domain = await self._on_home(self._domain_of(self.wf_id, dst))
                    self._domains[dst] = (domain, time.monotonic())

    async def _position_of(self, dst: str) -> int:
        return await self._on_home(self._read_position(dst))

    async def _read_position(self, dst: str) -> int:
        raw = await self._batcher.send("HGET", self._keys.stages(self.wf_id), f"{dst}:rd:{self.stage}")
        return int(raw or 0)

    def _payload_fields(self, seq: int, dst: str, payload: Any, step: list[Any], nbytes: int | None) -> list[Any]:
        """The chunk fields of one payload: inline (`d`), or a reference (`r`) to shared memory written
        now or to a Redis key the step stores (op 'B', before the 'E' op that references it)."""
        plane = self._plane
        if plane is None or (nbytes is not None and nbytes <= plane.inline_upto):
            return self._inline_fields(seq, payload)
        kind = plane.choose(payload, consumer_domain=self._domains.get(dst, ("", 0.0))[0] or None, nbytes=nbytes)
        if kind is TransportKind.INLINE:
            return self._inline_fields(seq, payload)
        ref, op = plane.put_op(payload, plane.context(self.wf_id, self.stage, dst, self.attempt, seq), kind)
        step += op           # a Redis key's payload (also shared memory's when it is full), stored with the entry
        plane.traffic.sent(self.stage, ref.kind, ref.nbytes)
        return ["seq", seq, "a", self.attempt, "r", ref.pack()]

    def _inline_fields(self, seq: int, payload: Any) -> list[Any]:
        data = codec.dumps(payload)
        if self._plane is not None:
            self._plane.traffic.sent(self.stage, TransportKind.INLINE, len(data))
        return ["seq", seq, "a", self.attempt, "d", data]

    def _build_step(self, seq: int, text: str | None, audio: np.ndarray | None, sample_rate: int | None,
                    data: Any, to: Mapping[str, Any] | None, checkpoint: str | None,
                    sizes: Mapping[str, int] | None = None) -> list[Any]:
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
                fields = self._payload_fields(seq, dst, payload, step, (sizes or {}).get(dst))
                step += ["E", dst, fields]
        if checkpoint:
            step += ["C", str(checkpoint), ""]
        return step

    def _push(self, step: list[Any]) -> None:
        """Queue one built step for the next `emit.lua` call (on the worker's loop)."""
        if self.state not in ACTIVE:   # a compute thread emitting after its session was closed (abort, timeout)
            return
        if self.state is SessionState.WAITING_INPUT:
            self.state, self._status = SessionState.RUNNING, StageStatus.RUNNING.value
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
        keys = self._emit_keys
        if keys is None:
            keys = self._emit_keys = self.emit_keys()
        blobs = [keys[0] + step[i + 1] for step in steps for i in range(1, len(step) - 2, 3) if step[i] == "B"]
        if blobs:       # payload keys this call stores (op 'B'): declared like every other key
            keys = [*keys, *blobs]
        if self._finish is None:
            return evalsha_args("emit", keys, args)
        # the finish's task and event streams in place of the session's, then its usage key (if metered)
        finish_keys = self._finish[0]
        return evalsha_args("emit", [keys[0], *finish_keys[:2], *keys[3:], *finish_keys[2:]],
                            [*args, self._finish[1]])

    def emit_keys(self) -> list[str]:
        """Every key an `emit.lua` call of this session may touch (see its header): the base key, the
        task and event streams of the workflow's cell, stages, log, this stage's output, its edges."""
        keys, wf_id, cell = self._keys, self.wf_id, self._keys.cell_of(self.wf_id)
        wf = keys.wf(wf_id)
        tasks = self.tasks_key or keys.tasks(self.stage, cell, self.priority.value)
        return [wf, tasks, keys.events(cell), f"{wf}:stages", f"{wf}:log",
                f"{wf}:out:{self.stage}", f"{wf}:blobs", *(f"{wf}:edge:{self.stage}:{dst}" for dst in self.downstream)]

    async def close(self, *, tasks_key: str, events_key: str, group: str, entry_id: str, outcome: str,
                    detail: str, retryable: bool, meter: Meter | None = None) -> str:
        """Write what is left and end the session in the same script call (`emit.lua` + finish).

        The finish carries how many steps the session emitted; the script compares it with what is
        stored, so a session whose write was refused or lost is never closed as done: it is closed
        as a retryable failure instead ('gap'; the retry resumes from what was stored).
        `meter`: what the session adds to its tenant's usage, in the same call (once: a finish sent
        again is fenced).
        Returns 'ok', 'fenced' or 'gap'; raises the error of the call itself (translated), after
        which calling `close` again is safe (the finish is fenced by status and by step count).
        """
        if self.state in ACTIVE:
            self.state = SessionState.CLOSED
        fin: list[Any] = [group, entry_id, outcome, detail, "1" if retryable else "0", self.seq,
                          ",".join(self.downstream)]
        finish_keys = [tasks_key, events_key]
        if meter is not None:
            fin.append(meter.fields())
            finish_keys.append(meter.key)
        self._finish = (finish_keys, msgpack.packb(fin, use_bin_type=False))
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
            self.fence()
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
        if self.state is SessionState.FENCED:
            raise Fenced(f"stage {self.stage} attempt {self.attempt} of {self.wf_id} was fenced off")
