"""Speech from a workflow as it is produced: the audio stage's chunks, encoded as they arrive.

`SpeechStream` follows a workflow's log (the hub: no polling) and, for each audio entry, reads
the new chunks of the audio stage and pushes them through a streaming encoder
(`omniflow.api.audio_stream`): wav with a streaming header, raw pcm (resampled to 24 kHz, as
OpenAI's `pcm` is), flac, ogg opus, mp3 — each chunk's bytes leave as soon as the encoder has
them, so the first byte goes out about when the first chunk is decoded.

`first()` waits for the first bytes before anything is sent, so a workflow that fails before
it speaks is answered with a proper HTTP error; a failure after that cuts the stream
(`SpeechFailed` propagates and the connection is dropped, so the client sees an incomplete
body, never a short file that looks whole).
"""
from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import numpy as np

from omniflow.api.audio import OPENAI_PCM_RATE, AudioFormat
from omniflow.api.audio_stream import AudioStream, open_stream
from omniflow.api.hub import LogHub
from omniflow.client.store import Store
from omniflow.models import WorkflowState

logger = logging.getLogger(__name__)

DEFAULT_RATE = 22050          # the rate of an empty answer's header (a workflow that spoke nothing)


class SpeechFailed(Exception):
    """The workflow ended without completing; `doc` is its document."""

    def __init__(self, doc: dict[str, Any]) -> None:
        where = f" (stage {doc['error_stage']})" if doc.get("error_stage") else ""
        super().__init__(f"workflow {doc['id']} {doc['state']}{where}: {doc.get('error')}")
        self.doc = doc


class SpeechStream:
    """The encoded audio of one workflow's audio stage, chunk by chunk."""

    def __init__(self, store: Store, hub: LogHub, wf_id: str, stage: str, fmt: AudioFormat) -> None:
        self.store, self.hub, self.wf_id, self.stage, self.format = store, hub, wf_id, stage, fmt
        self.finished = False                  # the workflow completed and every byte was handed out
        self._encoder: AudioStream | None = None
        self._body = self._bytes()

    def _open(self, rate: int) -> AudioStream:
        out_rate = OPENAI_PCM_RATE if self.format is AudioFormat.PCM16 else None
        return open_stream(self.format, rate, out_rate=out_rate)

    async def _bytes(self) -> AsyncGenerator[bytes, None]:
        cursor = "-"
        async with self.hub.follow(self.wf_id) as events:
            async for _eid, entry in events:
                kind = entry.get("t")
                if kind == "audio" and entry.get("stage") == self.stage:
                    for entry_id, pcm, rate in await self.store.audio_chunks(self.wf_id, self.stage, after=cursor):
                        cursor = entry_id
                        self._encoder = self._encoder or self._open(rate)
                        data = self._encoder.push(np.frombuffer(pcm, dtype="<i2"))
                        if data:
                            yield data
                elif kind == "terminal":
                    break
        doc = await self.store.document(self.wf_id)
        if doc["state"] != WorkflowState.COMPLETED.value:
            raise SpeechFailed(doc)
        self._encoder = self._encoder or self._open(DEFAULT_RATE)
        tail = self._encoder.finish()
        self.finished = True
        if tail:
            yield tail

    async def first(self) -> bytes:
        """The first bytes (SpeechFailed if the workflow ends before it speaks)."""
        async for data in self._body:
            return data
        return b""

    async def rest(self) -> AsyncIterator[bytes]:
        async for data in self._body:
            yield data

    async def aclose(self) -> None:
        await self._body.aclose()
