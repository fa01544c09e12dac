"""Python client: submit, get, wait (blocks on the event log), stream events, abort.

    async with AsyncClient() as client:
        wf = await client.submit("hello", modalities=["text", "audio"])
        doc = await client.wait(wf, timeout_s=60)
        ids = await client.submit_many(["a", "b", "c"])          # pipelined
        docs = await client.wait_many(ids, timeout_s=60)         # one blocking read for all of them

`Client` is the same, synchronous (it runs its own event loop).
"""
from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from omniflow.client import bulk
from omniflow.storage import redisio, registry
from omniflow.config import Settings, get_settings
from omniflow.errors import RedisRefused, UnknownPipeline
from omniflow.models import AudioInput, SubmitRequest, WorkflowInput
from omniflow.catalog import Catalog
from omniflow.pipeline import Pipeline, load_pipeline
from omniflow.runtime import loop_factory
from omniflow.storage.redisio import connect, connect_sync
from omniflow.storage.transitions.admission import SubmitResult
from omniflow.client.store import Store, check_same_body
from omniflow.storage.batcher import Batcher
from omniflow.storage.schema import s


RATES_KEPT = 4096                 # audio workflows whose input rate a client remembers


class AsyncClient:
    def __init__(self, redis_url: str | None = None, *, settings: Settings | None = None,
                 pipeline: Pipeline | Catalog | None = None, tenant: str = "default") -> None:
        self.settings = settings or get_settings()
        self.redis_url = redis_url or self.settings.resolve_redis_url()
        catalog = pipeline if isinstance(pipeline, Catalog) else Catalog.of(
            pipeline or load_pipeline(self.settings.pipeline_path()))
        self.pipeline = catalog.default
        self.tenant = tenant
        self.redis = connect(self.redis_url)
        # submits from concurrent callers go out together (one round trip while one is on the wire;
        # one at once at low load): omniflow.storage.batcher
        self._submits = Batcher(self.redis)
        self.store = Store(self.redis, self.settings, catalog, batcher=self._submits)
        self._rates: dict[str, int] = {}        # audio workflows submitted here -> their input's sample rate
        # no pipeline given: the default comes from local settings (OMNIFLOW_PIPELINE), which need not be
        # what the deployment serves; checked against its registry at the first submit (`_default_ref`)
        self._picked: str | None = None if pipeline is None else ""     # "": keep the local default
        # this client's watchers (`completions()`): told of the workflows it submits after they are
        # positioned, which they then watch without checking their state (bulk.Completions.submitted)
        self._watchers: weakref.WeakSet[bulk.Completions] = weakref.WeakSet()

    async def _default_ref(self, req: SubmitRequest) -> SubmitRequest:
        """The request, sent to the deployment's pipeline when it names none and this client's default
        came from local settings: that default when the deployment has registered its name (or has
        registered nothing yet: a client may submit before any worker starts), else the deployment's
        only pipeline; with several and not this one, `UnknownPipeline` (a workflow of a pipeline no
        worker serves would wait until its deadline)."""
        if req.pipeline or self._picked == "":
            return req
        if self._picked is None:
            registered = await registry.names(self.redis, self.store.keys)
            local = self.pipeline.name
            if not registered or local in registered:
                self._picked = ""
            elif len(registered) == 1:
                name = next(iter(registered))
                await self.store.pipeline_named(name, param="pipeline")     # learnt from the registry
                self._picked = name
            else:
                raise UnknownPipeline(
                    f"this client's default pipeline {local!r} (OMNIFLOW_PIPELINE={self.settings.pipeline_path()}) "
                    f"is not one this deployment serves ({sorted(registered)}): pass pipeline= to submit, "
                    "or AsyncClient(pipeline=...)", known=sorted(registered), param="pipeline")
        return req.model_copy(update={"pipeline": self._picked}) if self._picked else req

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._submits.drain()                 # a submit whose caller gave up is still written
        await self.redis.aclose()

    async def submit(self, text: str | None = None, *, modalities: Sequence[str] | None = None,
                     stage_params: dict[str, dict[str, Any]] | None = None, request_id: str | None = None,
                     deadline_s: float | None = None, webhook_url: str | None = None,
                     audio_sample_rate: int | None = None, pipeline: str | None = None) -> str:
        """Submit one request; returns the workflow id (the existing one for a repeated request_id).

        With `audio_sample_rate` the workflow takes audio (int16 mono at that rate), which
        `append_input` streams in after the submit. `pipeline`: a pipeline this deployment serves,
        by name or NAME@VERSION (default: the client's, see `_default_ref`)."""
        req = await self._default_ref(_request(text, modalities, stage_params, request_id, deadline_s, webhook_url,
                                               audio_sample_rate, pipeline))
        positioned = [w for w in self._watchers if w.positioned]      # before the submit is sent
        submitted = await self.store.submit(req, tenant=self.tenant)
        wf_id = submitted.id
        if not submitted.existing:
            for watcher in positioned:
                watcher.submitted(wf_id)
        if audio_sample_rate is not None and len(self._rates) < RATES_KEPT:
            self._rates[wf_id] = audio_sample_rate      # its appends need not read it back
        return wf_id

    async def append_input(self, wf_id: str, pcm: np.ndarray | Sequence[np.ndarray] = (), *,
                           final: bool = False) -> int:
        """Stream audio (int16 mono) into a running workflow submitted with `audio_sample_rate`; `final`
        ends its input (the speaker is done). See `Store.append_input`."""
        rate = self._rates.pop(wf_id, None) if final else self._rates.get(wf_id)
        return await self.store.append_input(wf_id, pcm, final=final, sample_rate=rate)

    async def submit_many(self, texts: Sequence[str], *, modalities: Sequence[str] | None = None,
                          stage_params: dict[str, dict[str, Any]] | None = None, deadline_s: float | None = None,
                          return_exceptions: bool = False, pipeline: str | None = None) -> list[Any]:
        """Submit one request per text, pipelined (one round trip per 256); the workflow ids in order.
        With `return_exceptions`, a request that was refused is its exception in the list; without, the
        first refusal is raised once its batch has been sent (omniflow.client.bulk)."""
        if pipeline:
            await self.store.pipeline_named(pipeline, param="pipeline")
        reqs = [await self._default_ref(SubmitRequest(
                    input=WorkflowInput(text=text), output_modalities=list(modalities) if modalities else None,
                    stage_params=stage_params or {}, deadline_s=deadline_s, pipeline=pipeline)) for text in texts]
        results = await bulk.submit_many(self.store, reqs, tenant=self.tenant, return_exceptions=return_exceptions)
        return [r if isinstance(r, BaseException) else r.id for r in results]

    def completions(self, *, block_ms: int = 5_000) -> bulk.Completions:
        """A watcher for the ends of many workflows through one blocking read (BullMQ's QueueEvents):
        `watch(wf_id)` gives a future for the document once it is terminal.

            async with client.completions() as ends:
                docs = await asyncio.gather(*(ends.watch(wf) for wf in ids))
        """
        watcher = bulk.Completions(self.store, block_ms=block_ms)
        self._watchers.add(watcher)
        return watcher

    async def wait_many(self, wf_ids: Sequence[str], *, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """`wait` for many workflows with one blocking read: every document, by id, once all are terminal
        or `timeout_s` has passed (then the current document of those still running)."""
        async with self.completions() as ends:
            return await ends.wait(wf_ids, timeout_s=timeout_s)

    async def get(self, wf_id: str) -> dict[str, Any]:
        return await self.store.document(wf_id)

    async def wait(self, wf_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        return await self.store.wait(wf_id, timeout_s=timeout_s)

    async def events(self, wf_id: str, *, after: str = "0-0",
                     timeout_s: float | None = None) -> AsyncIterator[tuple[str, dict[str, str]]]:
        async for item in self.store.follow(wf_id, after=after, timeout_s=timeout_s):
            yield item

    async def abort(self, wf_id: str, *, reason: str = "aborted by client") -> str:
        return await self.store.abort(wf_id, reason=reason)

    async def audio(self, wf_id: str, stage: str | None = None) -> tuple[int, np.ndarray]:
        return await self.store.audio(wf_id, stage)

    async def save_audio(self, wf_id: str, path: str | Path, *, stage: str | None = None) -> float:
        """Write the audio output to `path` (format from the suffix: wav, flac, ogg); returns seconds."""
        import soundfile as sf

        rate, pcm = await self.audio(wf_id, stage)
        sf.write(str(path), pcm, rate)
        return pcm.size / rate if rate else 0.0

    async def list(self, *, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        return await self.store.list(state=state, limit=limit)


class Client:
    """Synchronous twin of `AsyncClient`. Submits go straight through a synchronous redis-py
    connection (cheaper per call than driving an event loop); the rest runs `AsyncClient`."""

    def __init__(self, redis_url: str | None = None, **kwargs: Any) -> None:
        # its own loop, on uvloop where installed (`OMNIFLOW_LOOP`): -10 % of the client's CPU per
        # workflow at a fixed rate (bench/rate.py --client-uvloop; bench/notes.md, round 12)
        self._loop = (loop_factory() or asyncio.new_event_loop)()
        self._client: AsyncClient = self._run(_make(redis_url, kwargs))
        self._sync = connect_sync(self._client.redis_url)

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._run(self._client.close())
            self._loop.close()
            self._sync.close()

    def submit(self, text: str | None = None, *, modalities: Sequence[str] | None = None,
               stage_params: dict[str, dict[str, Any]] | None = None, request_id: str | None = None,
               deadline_s: float | None = None, webhook_url: str | None = None,
               audio_sample_rate: int | None = None, pipeline: str | None = None) -> str:
        """Submit one request; returns the workflow id (the existing one for a repeated request_id)."""
        req = _request(text, modalities, stage_params, request_id, deadline_s, webhook_url, audio_sample_rate, pipeline)
        store = self._client.store
        picked = self._client._picked           # see AsyncClient._default_ref
        if req.pipeline is None and picked is None:
            req = self._run(self._client._default_ref(req))     # the first submit asks the registry
        elif req.pipeline is None and picked:
            req = req.model_copy(update={"pipeline": picked})
        if req.pipeline and store.catalog.find(req.pipeline) is None:
            self._run(store.pipeline_named(req.pipeline, param="pipeline"))
        call, tried = store.submit_call(req, tenant=self._client.tenant)
        try:
            reply = redisio.call_sync(self._sync, call)
            if s(reply[0]) == SubmitResult.BUSY and len(reply) == 2 and not request_id and store.keys.cells > 1:
                # that cell is full: one more try in another one (as Store.submit does)
                call, tried = store.submit_call(req, tenant=self._client.tenant, wf_id=store.other_cell_id(tried))
                reply = redisio.call_sync(self._sync, call)
        except RedisRefused as exc:
            raise store.refused(exc) from exc
        result = store.submitted(reply, tenant=self._client.tenant)
        with redisio.boundary():
            if result.existing:     # retired, or the same key with a different request (IdempotencyConflict)
                if self._sync.exists(store.keys.tomb(result.id)):
                    raise store.retired(result.id)
                check_same_body(result.id, req, s(self._sync.hget(store.keys.wf(result.id), "body_hash")))
            elif self._client.settings.wait_aof:
                self._sync.execute_command("WAITAOF", 1, 0, 1000)
        return result.id

    def submit_many(self, texts: Sequence[str], **kwargs: Any) -> list[Any]:
        """`AsyncClient.submit_many`: pipelined submits, the workflow ids in order."""
        return self._run(self._client.submit_many(texts, **kwargs))  # type: ignore[no-any-return]

    def wait_many(self, wf_ids: Sequence[str], *, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """`AsyncClient.wait_many`: every document once all are terminal (one blocking read)."""
        return self._run(self._client.wait_many(wf_ids, timeout_s=timeout_s))  # type: ignore[no-any-return]

    def get(self, wf_id: str) -> dict[str, Any]:
        return self._run(self._client.get(wf_id))  # type: ignore[no-any-return]

    def wait(self, wf_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        return self._run(self._client.wait(wf_id, timeout_s=timeout_s))  # type: ignore[no-any-return]

    def abort(self, wf_id: str, **kwargs: Any) -> str:
        return self._run(self._client.abort(wf_id, **kwargs))  # type: ignore[no-any-return]

    def append_input(self, wf_id: str, pcm: np.ndarray | Sequence[np.ndarray] = (), *, final: bool = False) -> int:
        """See `AsyncClient.append_input`."""
        return self._run(self._client.append_input(wf_id, pcm, final=final))  # type: ignore[no-any-return]

    def save_audio(self, wf_id: str, path: str | Path, **kwargs: Any) -> float:
        return self._run(self._client.save_audio(wf_id, path, **kwargs))  # type: ignore[no-any-return]

    def list(self, **kwargs: Any) -> list[dict[str, Any]]:
        return self._run(self._client.list(**kwargs))  # type: ignore[no-any-return]


def _request(text: str | None, modalities: Sequence[str] | None, stage_params: dict[str, dict[str, Any]] | None,
             request_id: str | None, deadline_s: float | None, webhook_url: str | None,
             audio_sample_rate: int | None, pipeline: str | None = None) -> SubmitRequest:
    audio = AudioInput(sample_rate=audio_sample_rate) if audio_sample_rate is not None else None
    return SubmitRequest(input=WorkflowInput(text=text, audio=audio),
                         output_modalities=list(modalities) if modalities else None,
                         stage_params=stage_params or {}, request_id=request_id, deadline_s=deadline_s,
                         webhook_url=webhook_url, pipeline=pipeline)


async def _make(redis_url: str | None, kwargs: dict[str, Any]) -> AsyncClient:
    return AsyncClient(redis_url, **kwargs)
