"""A session's outputs: `emit` (one step, encoded on the caller's thread, queued on the worker's
group-commit batcher as one lazily built `emit.lua` call), `close` (the finish rides on the last
write), `flush`, and the data-plane side of a step (payload transport, backpressure)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np

from omniflow import tracing
from omniflow.dataplane import codec
from omniflow.dataplane.backpressure import EdgeWindow, WaitStats, wait_for_room
from omniflow.dataplane.base import TransportKind
from omniflow.dataplane.codec import payload_nbytes
from omniflow.engine.session.core import ACTIVE, SessionCore
from omniflow.errors import Fenced, NonRetryableError, RedisUnavailable
from omniflow.models import SessionState, StageStatus
from omniflow.storage.schema import StageField, pack_raw, s
from omniflow.storage.transitions.emit import EMIT_LOG, EMIT_OUT, EmitResult, emit_code, emit_keys, refused_inbox
from omniflow.storage.transitions.emit import emit as emit_call
from omniflow.storage.usage import Meter

logger = logging.getLogger(__name__)

MAX_EMITS_IN_FLIGHT = 64
#: how long a step a compute thread emitted waits for what the thread emits right after it (more steps,
#: the executor's return and so the finish) before it is written: one call instead of several
EMIT_LINGER_S = 0.0005
MAX_INBOX_RESENDS = 8       # a call refused for a consumer's inbox is sent again at most this many times
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
        if self._span is not None and (data is not None or to):
            for dst in self.downstream:
                if data is not None or dst in (to or {}):
                    tracing.chunk_event(self._span, "out", dst, self.seq, sizes.get(dst))
        for dst, nbytes in sizes.items():
            window = self._windows.get(dst)
            if window is not None:
                window.sent(self.seq, nbytes)
                if self._bp is not None:
                    self._bp.saw(window)
        # (from a compute thread: batched with its other handoffs; the slots' check below needs to know)
        remote = self._call_home(self._push, step)
        if len(self._inflight) >= MAX_EMITS_IN_FLIGHT:
            await self.flush()
        if self._slots is not None:       # a chunk boundary: live traffic, fair turns
            if remote:          # the compute thread reads the hint; the loop decides
                if self._slots_say_give_way():
                    await self._on_home(self._slots.give_way(self.priority, self.tenant))
            elif self._slots.should_give_way(self.priority, self.tenant):
                await self._slots.give_way(self.priority, self.tenant)

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
        raw = await self._batcher.send("HGET", self._keys.stages(self.wf_id), StageField.read_pos(dst, self.stage))
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
        final = self.is_final      # (read once per step)
        if final and text:
            step += ["T", text, ""]
        if final and audio is not None:
            pcm = np.asarray(audio)
            if pcm.dtype != np.int16:
                pcm = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2")
            sr = int(sample_rate or 0)
            if sr <= 0:
                raise NonRetryableError(f"stage {self.stage}: audio needs a positive sample_rate")
            step += ["X", EMIT_OUT, ["seq", seq, "pcm", pcm.astype("<i2").tobytes(), "sr", sr],
                     "I", StageField.samples(self.stage), int(pcm.size), "H", StageField.sample_rate(self.stage), sr,
                     "X", EMIT_LOG, ["t", "audio", "stage", self.stage, "seq", seq, "samples", int(pcm.size), "sr", sr]]
        payloads = dict(to or {})
        if data is not None:
            payloads.update({dst: data for dst in self.downstream if dst not in payloads})
        for dst, payload in payloads.items():
            if dst in self.downstream:
                fields = self._payload_fields(seq, dst, payload, step, (sizes or {}).get(dst))
                # packed here (on the caller's thread): emit.lua appends it to the edge entry as it is
                step += ["P", dst, pack_raw(fields)]
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
        if self._home is None:
            self._schedule()
        elif len(self._steps) == 1:
            # handed off by the compute thread: written after a short linger, so that what the thread
            # emits right after it (more steps, the executor's return, after which the worker closes the
            # session: the finish rides on this write then) joins this write, as it does when the
            # executor runs on this loop; a step emitted before a long forward pass waits no longer
            self._home.call_later(EMIT_LINGER_S, self._schedule_pending)

    def _schedule(self) -> None:
        if self._open is None:
            self._open = self._send_emit()
            self._track(self._open)

    def _schedule_pending(self) -> None:
        """Schedule a write if anything is waiting for one (steps, a status change) and none is queued."""
        if self._open is None and (self._steps or self._status) and self.state in ACTIVE:
            self._schedule()

    def _send_emit(self) -> asyncio.Future[Any]:
        """Queue one `emit.lua` call, built at flush time from everything emitted until then; its
        future resolves with the call's reply once it is written. A call refused because a consumer's
        inbox was not declared wrote nothing: it is sent again, declaring it (`Consumers`)."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        taken: list[tuple[list[list[Any]], str, tuple[list[str], bytes] | None]] = []

        def build() -> tuple[Any, ...]:
            if not taken:       # what the call carries is taken once: a call sent again carries the same
                steps, self._steps = self._steps, []
                status, self._status = self._status, ""
                self._open = None
                taken.append((steps, status, self._finish))
            steps, status, finish = taken[0]
            return emit_call(self._current_emit_keys(), self.wf_id, self.stage, self.attempt, status=status,
                             now_ms=int(time.time() * 1000), steps=steps, finish=finish,
                             replica=self._local.replica if self._local is not None else "")

        self._relay(done, build, self._batcher.send_lazy(build), 0, taken)
        return done

    def _hand_over(self, reply: list[Any], steps: list[list[Any]], finish: tuple[list[str], bytes] | None) -> None:
        """After a call wrote `steps` (and its finish): the chunks it wrote for the consumers bound to
        this worker (the reply names each, with its attempt: the script wrote them no inbox copy), and
        a done finish's end of stream, to those sessions (`LocalInputs`)."""
        local = self._local
        assert local is not None
        src = self.stage
        for j in range(1, len(reply) - 1, 2):
            dst, attempt = s(reply[j]), int(reply[j + 1])
            chunks: list[dict[bytes, Any]] = []
            for step in steps:
                for i in range(1, len(step) - 2, 3):
                    if step[i] == "P" and step[i + 1] == dst:   # decoded as the inbox reader decodes them
                        flat = msgpack.unpackb(step[i + 2], raw=True)
                        chunks.append(dict(zip(flat[::2], flat[1::2])))
            if finish is not None and self._done:
                chunks.append({b"eos": b"1", b"seq": self.seq, b"a": self.attempt})
            local.deliver((self.wf_id, dst, attempt), src, chunks)

    def _relay(self, done: asyncio.Future[Any], build: Callable[[], tuple[Any, ...]], sent: asyncio.Future[Any],
               tries: int, taken: list[tuple[list[list[Any]], str, tuple[list[str], bytes] | None]]) -> None:
        def settled(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled():
                if not done.done():
                    done.cancel()
                return
            exc = fut.exception()
            result = None if exc is not None else fut.result()
            if isinstance(result, list) and result and emit_code(result) is EmitResult.INBOX \
                    and tries < MAX_INBOX_RESENDS:
                # sent again even when its waiter was cancelled: a final write must land
                dst, replica = refused_inbox(result)
                if replica:
                    self._consumers.learn(dst, self._keys.cell_of(self.wf_id), replica)
                self._relay(done, build, self._batcher.send_lazy(build), tries + 1, taken)
                return
            if isinstance(result, list) and len(result) > 2 and self._local is not None and taken \
                    and emit_code(result) in (EmitResult.OK, EmitResult.COMPLETED):
                self._hand_over(result, taken[0][0], taken[0][2])
            if done.done():
                return
            if exc is not None:
                done.set_exception(exc)
            elif isinstance(result, list) and result and emit_code(result) is EmitResult.INBOX:
                done.set_exception(RedisUnavailable(
                    f"stage {self.stage} attempt {self.attempt} of {self.wf_id}: its consumers kept moving"))
            else:
                done.set_result(result)

        sent.add_done_callback(settled)

    def _current_emit_keys(self) -> list[str]:
        keys = self._emit_keys
        if keys is None or self._consumers_seen != self._consumers.version:
            self._consumers_seen = self._consumers.version
            keys = self._emit_keys = self.emit_keys()
        return keys

    def emit_keys(self) -> list[str]:
        """Every key an `emit.lua` call of this session may touch (`transitions.emit.emit_keys`): its
        task stream is the queue's of its priority class."""
        return emit_keys(self._keys, self.wf_id, self.stage, self.downstream,
                         self._consumers.of(self.downstream, self._keys.cell_of(self.wf_id)), queue=self.queue,
                         priority=self.priority.value, legacy=self._legacy)

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
        self._done = outcome == "done"
        fin: list[Any] = [group, entry_id, outcome, detail, "1" if retryable else "0", self.seq,
                          ",".join(self.downstream)]
        finish_keys = [tasks_key, events_key]
        if meter is not None:
            fin.append(meter.fields())
            finish_keys.append(meter.key)
        if self._completion is not None and outcome == "done":
            # it may complete the workflow: finalize's keys (those its emits do not declare already)
            extra, inflight, ttl = self._completion
            if meter is None:
                fin.append(False)
            fin.append([inflight, ttl, ",".join(self.required)])     # (the stages: read with the record)
            have = set(self._current_emit_keys()) | set(finish_keys)
            finish_keys.extend(k for k in extra if k not in have)
        self._finish = (finish_keys, pack_raw(fin))
        if self._open is not None:
            last = self._open          # the pending write is still in the batcher's queue: the finish rides on it
        else:
            last = self._open = self._send_emit()
        earlier = [f for f in self._inflight if f is not last]
        if earlier:
            await asyncio.gather(*earlier, return_exceptions=True)
        code = emit_code(await last)
        self.completed = code is EmitResult.COMPLETED
        return code.value if code in (EmitResult.FENCED, EmitResult.GAP) else EmitResult.OK.value

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
        code = emit_code(fut.result())
        if code is EmitResult.FENCED:
            self.fence()
        elif code is EmitResult.GAP:     # emit.lua refused steps after a lost write: end this attempt, retry resumes
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
