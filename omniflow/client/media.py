"""The workflow store's streamed media: audio appended to a running workflow's input (`@input`),
and the audio outputs read back (whole, or chunk by chunk after an entry). A part of `Store`
(`omniflow.client.store`), which it is mixed into: its methods use the store's connection, keys,
pipeline and reads."""
from __future__ import annotations

import builtins
import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from omniflow.dataplane import codec
from omniflow.errors import InputClosed, InvalidRequest, NotReady, RedisUnavailable, WorkflowNotFound
from omniflow.pipeline import Pipeline
from omniflow.storage import redisio
from omniflow.storage.client import RedisClient
from omniflow.storage.keys import Keys
from omniflow.storage.redisio import translated
from omniflow.storage.schema import s
from omniflow.storage.transitions import inputs
from omniflow.storage.transitions.inputs import AppendResult

__all__ = ["StreamedMedia"]


class _Store(Protocol):
    """What of `Store` the media methods use."""

    _redis: RedisClient
    keys: Keys
    pipeline: Pipeline
    _input_consumers: dict[tuple[str, int], str]

    async def _check_tenant(self, wf_id: str, tenant: str) -> None: ...

    async def document(self, wf_id: str, *, tenant: str | None = None) -> dict[str, Any]: ...


class StreamedMedia:
    """`Store`'s streamed input and audio reads (see the module docstring)."""

    @translated
    async def append_input(self: _Store, wf_id: str, pcm: Sequence[np.ndarray] | np.ndarray = (), *, final: bool = False,
                           sample_rate: int | None = None, stage: str | None = None,
                           tenant: str | None = None) -> int:
        """Append audio (int16 mono chunks) to a running workflow's input, and end it with `final`.

        The chunks reach the pipeline's audio stage as they are appended (`@input`), so it works
        on them while more come. `sample_rate` defaults to the one the submit declared; one
        append is one Redis call (the chunks form one edge entry). Returns the input's last
        sequence number. `InputClosed` once the input was ended or the workflow is over;
        `InvalidRequest` for a workflow that takes no streamed input or for samples that are
        not int16 mono."""
        stage = stage or self.pipeline.audio_stage
        if stage is None:
            raise InvalidRequest(f"pipeline {self.pipeline.name!r} takes no audio input")
        if tenant is not None:
            await self._check_tenant(wf_id, tenant)
        chunks = [pcm] if isinstance(pcm, np.ndarray) else list(pcm)
        for n, chunk in enumerate(chunks):
            if not isinstance(chunk, np.ndarray) or chunk.dtype != np.int16 or chunk.ndim != 1:
                raise InvalidRequest(f"audio chunk {n}: int16 mono samples (a 1-D numpy array) are needed")
        if chunks and sample_rate is None:
            raw = await self._redis.hget(self.keys.wf(wf_id), "input")
            if raw is None:
                raise WorkflowNotFound(f"no workflow {wf_id}")
            sample_rate = int((json.loads(raw).get("audio") or {}).get("sample_rate") or 16000)
        payloads = [codec.dumps({"pcm": chunk, "sample_rate": sample_rate}) for chunk in chunks if chunk.size]
        cell = self.keys.cell_of(wf_id)
        for _ in range(3):      # the stage's session moved to another replica meanwhile: declare it, send again
            known = self._input_consumers.get((stage, cell))
            reply = await redisio.call(self._redis, *inputs.append_input(
                self.keys, wf_id, stage, final=final, payloads=payloads, inboxes=(known,) if known else ()))
            code, value = inputs.append_result(reply)
            if code is not AppendResult.INBOX:
                break
            self._input_consumers[(stage, cell)] = value
        if code is AppendResult.OK:
            return int(value)
        if code is AppendResult.CLOSED:
            raise InputClosed(f"workflow {wf_id}: its input has ended (final=True was sent)")
        if code is AppendResult.ENDED:
            if value == "gone":
                raise WorkflowNotFound(f"no workflow {wf_id}")
            raise InputClosed(f"workflow {wf_id} is {value}: it takes no more input")
        if code is AppendResult.INBOX:
            raise RedisUnavailable(f"workflow {wf_id}: the replica reading its input kept moving; try again")
        raise InvalidRequest(f"workflow {wf_id} takes no streamed input at stage {stage!r} (submit it with input.audio)")

    # ---------------------------------------------------------------- audio outputs
    @translated
    async def audio(self: _Store, wf_id: str, stage: str | None = None) -> tuple[int, np.ndarray]:
        """(sample_rate, int16 PCM) of a final audio stage; `NotReady` while it is still running."""
        doc = await self.document(wf_id)
        audio = {k: v for k, v in doc["outputs"].items() if v["type"] == "audio"}
        if not audio:
            raise WorkflowNotFound(f"workflow {wf_id} has no audio output")
        stage = stage or next(iter(audio))
        if stage not in audio:
            raise WorkflowNotFound(f"workflow {wf_id} has no audio output from stage {stage!r}")
        if audio[stage]["partial"] and doc["state"] in ("pending", "running"):
            raise NotReady(f"audio of workflow {wf_id} is not ready (stage {stage} is {doc['stages'][stage]['status']})")
        entries = await self._redis.xrange(self.keys.out(wf_id, stage))
        pcm = [np.frombuffer(f[b"pcm"], dtype="<i2") for _, f in entries]
        samples = np.concatenate(pcm) if pcm else np.zeros(0, dtype="<i2")
        return int(audio[stage]["sample_rate"] or 0), samples

    @translated
    async def audio_chunks(self: _Store, wf_id: str, stage: str, *, after: str = "-") -> builtins.list[tuple[str, bytes, int]]:
        """Audio chunks of a final stage after entry `after` (exclusive unless '-'): (entry id, PCM, rate)."""
        start = after if after == "-" else f"({after}"
        return [(s(eid), bytes(f[b"pcm"]), int(s(f.get(b"sr")) or 0))
                for eid, f in await self._redis.xrange(self.keys.out(wf_id, stage), min=start)]
