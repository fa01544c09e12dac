"""Unit-test an executor without Redis: a fake session that records what it emits.

    from omniflow.testing import FakeSession, run_executor

    async def test_upper():
        session = FakeSession(input={"text": "hi"}, finals=("upper",), stage="upper")
        usage = await run_executor(Upper(stage="upper", params={}), session)
        assert session.text_out == "HI!" and usage == {"tokens": 1}

`FakeSession` implements the executor contract's `Session` Protocol
(`omniflow.executor.Session`: mypy checks it below, `tests/test_executor_contract.py`
compares its members with the Protocol's and the engine's session). It behaves as the
engine's session does where an executor can see it: payloads go through the same
msgpack codec as in production, so a tensor that would not survive Redis does not
survive here either; `inputs()` drops a chunk it has already yielded (`(src, seq)`);
steps up to `resume_seq` are suppressed exactly like in production, so resume logic
can be tested by giving the session what an earlier attempt left (`resume_seq`,
`checkpoint`); `emit` and `flush` raise `Fenced` once the session is fenced off.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omniflow.dataplane import codec
from omniflow.errors import Fenced, NonRetryableError
from omniflow.executor import Chunk, Executor, Session


@dataclass
class Emitted:
    """One recorded output step."""

    seq: int
    text: str | None = None
    audio: np.ndarray | None = None         # int16 PCM, as it would be stored
    sample_rate: int | None = None
    data: dict[str, Any] = field(default_factory=dict)     # downstream stage -> decoded payload
    checkpoint: str | None = None


@dataclass
class FakeSession:
    """A session with no Redis behind it; inspect `.emitted`, `.text_out`, `.audio_out` afterwards."""

    input: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    stage: str = "stage"
    wf_id: str = "wf-test"
    attempt: int = 1
    finals: tuple[str, ...] = ()
    downstream: tuple[str, ...] = ()
    upstream: tuple[str, ...] = ()
    resume_seq: int = 0
    checkpoint: str = ""
    #: input chunks, as (src, data) pairs or `Chunk`s; `seq` is numbered per source when not given
    chunks: Sequence[Chunk | tuple[str, Any]] = ()
    #: a chunk source that is still open after `chunks` (inputs() then waits on `feed`)
    live: bool = False
    seq: int = 0
    emitted: list[Emitted] = field(default_factory=list)
    fenced: bool = False
    aborted: bool = False
    _feed: asyncio.Queue[Chunk | None] | None = None

    def __post_init__(self) -> None:
        if self.chunks and not self.upstream:
            self.upstream = tuple(dict.fromkeys(c.src if isinstance(c, Chunk) else c[0] for c in self.chunks))
        if not self.finals:
            self.finals = (self.stage,)

    # ---------------------------------------------------------------- what an executor reads
    @property
    def text(self) -> str:
        return str(self.input.get("text") or "")

    @property
    def is_final(self) -> bool:
        return self.stage in self.finals

    def fast_forward(self) -> int:
        self.seq = max(self.seq, self.resume_seq)
        return self.seq

    async def inputs(self) -> AsyncIterator[Chunk]:
        """The given chunks (round-tripped through the codec), then whatever is `feed()`-ed while live.

        As in production, a chunk whose `seq` is not past the last one yielded from its source
        (a replayed or duplicated entry) is skipped."""
        counters: dict[str, int] = {}
        last: dict[str, int] = {}
        for item in self.chunks:
            chunk: Chunk | None
            if isinstance(item, Chunk):
                chunk = item
            else:
                src, data = item
                counters[src] = counters.get(src, 0) + 1
                chunk = Chunk(src=src, seq=counters[src], attempt=1, data=data)
            if chunk.seq > last.get(chunk.src, 0):
                last[chunk.src] = chunk.seq
                yield Chunk(chunk.src, chunk.seq, chunk.attempt, codec.loads(codec.dumps(chunk.data)))
        if not self.live:
            return
        feed = self._queue()
        while (chunk := await feed.get()) is not None:
            if chunk.seq > last.get(chunk.src, 0):
                last[chunk.src] = chunk.seq
                yield Chunk(chunk.src, chunk.seq, chunk.attempt, codec.loads(codec.dumps(chunk.data)))

    def feed(self, chunk: Chunk | None) -> None:
        """Deliver one more live chunk (None: every upstream ended)."""
        self._queue().put_nowait(chunk)

    def _queue(self) -> asyncio.Queue[Chunk | None]:
        if self._feed is None:
            self._feed = asyncio.Queue()
        return self._feed

    # ---------------------------------------------------------------- what an executor writes
    async def emit(self, *, text: str | None = None, audio: np.ndarray | None = None,
                   sample_rate: int | None = None, data: Any = None, to: Mapping[str, Any] | None = None,
                   checkpoint: str | None = None) -> None:
        if self.fenced or self.aborted:
            raise Fenced(f"stage {self.stage} of {self.wf_id} no longer owns the session")
        self.seq += 1
        if self.seq <= self.resume_seq:
            return
        step = Emitted(seq=self.seq, checkpoint=checkpoint)
        if text and self.is_final:
            step.text = text
        if audio is not None and self.is_final:
            if not sample_rate or sample_rate <= 0:
                raise NonRetryableError(f"stage {self.stage}: audio needs a positive sample_rate")
            pcm = np.asarray(audio)
            if pcm.dtype != np.int16:
                pcm = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2")
            step.audio, step.sample_rate = pcm, int(sample_rate)
        payloads = dict(to or {})
        if data is not None:
            payloads.update({dst: data for dst in self.downstream if dst not in payloads})
        step.data = {dst: codec.loads(codec.dumps(p)) for dst, p in payloads.items() if dst in self.downstream}
        self.emitted.append(step)

    async def flush(self) -> None:
        """Nothing is in flight in a fake session; raises `Fenced` once it is fenced off, as production does."""
        self.raise_if_broken()

    def raise_if_broken(self) -> None:
        if self.fenced:
            raise Fenced(f"stage {self.stage} of {self.wf_id} was fenced off")

    # ---------------------------------------------------------------- what a test reads
    @property
    def text_out(self) -> str:
        return "".join(e.text or "" for e in self.emitted)

    @property
    def audio_out(self) -> np.ndarray:
        parts = [e.audio for e in self.emitted if e.audio is not None]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int16)

    @property
    def checkpoint_out(self) -> str:
        """Everything checkpointed so far, earlier attempts included (what a retry would get)."""
        return self.checkpoint + "".join(e.checkpoint or "" for e in self.emitted)

    def data_to(self, stage: str) -> list[Any]:
        return [e.data[stage] for e in self.emitted if stage in e.data]

    def retried(self, **changes: Any) -> FakeSession:
        """The session a retry would get after this attempt: same input, resume state carried over."""
        fields: dict[str, Any] = dict(input=self.input, params=self.params, stage=self.stage, wf_id=self.wf_id,
                      attempt=self.attempt + 1, finals=self.finals, downstream=self.downstream,
                      upstream=self.upstream, resume_seq=max(self.resume_seq, self.seq),
                      checkpoint=self.checkpoint_out, chunks=self.chunks)
        fields.update(changes)
        return FakeSession(**fields)


# mypy checks here that the fake is what the executor contract promises (and
# tests/test_executor_contract.py checks it at run time, member by member).
_CONTRACT: type[Session] = FakeSession


async def run_executor(executor: Executor, session: Session, *, setup: bool = False) -> Mapping[str, Any] | None:
    """Run one session through an executor (plain or batched) on this loop; optionally `setup()` first."""
    if setup:
        await executor.setup()
    usage: Mapping[str, Any] | None = await executor.run(session)
    return usage


async def run_many(executor: Executor, sessions: Iterable[Session]) -> list[Mapping[str, Any] | None]:
    """Run sessions concurrently through one executor (a `BatchedExecutor` batches them)."""
    return list(await asyncio.gather(*(executor.run(s) for s in sessions)))
