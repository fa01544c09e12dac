"""Batch jobs: every line of a JSONL file becomes a workflow, run by arq jobs.

`parse_batch_file` validates the file up front (unreadable, not JSONL, or no
valid line: `InvalidRequest`); bad lines are kept with their line number and
never stop the batch. `submit_batch` writes the batch record and enqueues one
`run_batch_chunk` job per `batch_chunk_lines` lines. A chunk job submits its
lines (waiting on `AdmissionRefused`), waits for each workflow to end and
counts the outcome exactly once. It works in slices of `batch_slice_s`: a
slice that ends with lines still running raises `Retry`, so a crashed or
stopped jobs process loses at most one slice of waiting, never a line.

Keys (see `omniflow.storage.keys`): `<prefix>:batch:{<id>}` (hash: total,
submitted, completed, failed, invalid, state, created_ms, finished_ms),
`...:input` (line -> request), `...:lines` (line -> {wf, state, error}),
`...:done` (stream, one entry when the batch ends), `<prefix>:batches` (zset).
A line that never became a workflow counts as `invalid` and `failed`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from arq import Retry
from arq.connections import ArqRedis
from pydantic import ValidationError
from omniflow.storage.client import REDIS_ERRORS, RedisClient

from omniflow import tracing
from omniflow.config import Settings
from omniflow.errors import AdmissionRefused, InvalidRequest, WorkflowError, WorkflowNotFound
from omniflow.storage.keys import Keys
from omniflow.jobs.queue import RUN_BATCH_CHUNK
from omniflow.models import TERMINAL_STATES, Priority, SubmitRequest, WorkflowState
from omniflow.pipeline import Pipeline
from omniflow.client.store import Store
from omniflow.storage.schema import now_ms, s, text_fields

logger = logging.getLogger(__name__)

MAX_REPORTED_ERRORS = 20
CHUNK_MAX_TRIES = 1_000_000       # each slice of a chunk is one arq try
REDIS_RETRY_S = 1.0
_ID_NAMESPACE = uuid.UUID("5b0a8d4e-3f3c-4f55-9a53-6f6d6e69666c")


class BatchState(str, Enum):
    RUNNING = "running"
    COMPLETED = "completed"     # every line's workflow completed
    FAILED = "failed"           # all lines ended, at least one failed, was aborted or was invalid

    @property
    def terminal(self) -> bool:
        return self is not BatchState.RUNNING


class LineState(str, Enum):
    QUEUED = "queued"           # not submitted yet
    SUBMITTED = "submitted"     # its workflow runs
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"
    INVALID = "invalid"         # never became a workflow (bad line, or refused at submit)


LINE_TERMINAL = frozenset({LineState.COMPLETED, LineState.FAILED, LineState.ABORTED, LineState.INVALID})


@dataclass
class ParsedBatch:
    source: str
    requests: dict[int, SubmitRequest] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return len(self.requests) + len(self.errors)


def parse_line(raw: str, pipeline: Pipeline, settings: Settings) -> SubmitRequest:
    """One JSONL line -> a request; `{"text": ...}` is short for `{"input": {"text": ...}}`."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"not JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict):
        raise InvalidRequest(f"expected a JSON object, got {type(obj).__name__}")
    if "text" in obj:
        if "input" in obj:
            raise InvalidRequest("give either 'input' or 'text', not both")
        text = obj.pop("text")
        obj = {**obj, "input": {"text": text}}
    elif isinstance(obj.get("input"), str):
        obj = {**obj, "input": {"text": obj["input"]}}
    try:
        req = SubmitRequest.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "line"
        raise InvalidRequest(f"{where}: {first['msg']}") from exc
    pipeline.plan(req.output_modalities, input_kind=req.input.kind)
    unknown = sorted(set(req.stage_params) - set(pipeline.stages))
    if unknown:
        raise InvalidRequest(f"stage_params: unknown stage(s) {unknown}")
    if req.input.audio is not None:
        raise InvalidRequest("input.audio: a batch line carries text; audio is streamed into a running workflow")
    if len(req.input.text or "") > settings.max_prompt_chars:
        raise InvalidRequest(f"input.text is longer than {settings.max_prompt_chars} characters")
    return req


def parse_batch_file(path: Path, pipeline: Pipeline, settings: Settings) -> ParsedBatch:
    """Validate a JSONL file. Bad lines are reported by number; a file with no valid line is refused."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise InvalidRequest(f"{path}: cannot read the batch file ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{path}: not a UTF-8 text file (byte {exc.start})") from exc
    batch = ParsedBatch(source=str(path))
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if batch.total >= settings.batch_max_lines:
            raise InvalidRequest(f"{path}: more than {settings.batch_max_lines} lines (OMNIFLOW_BATCH_MAX_LINES)")
        try:
            batch.requests[n] = parse_line(raw, pipeline, settings)
        except InvalidRequest as exc:
            batch.errors[n] = str(exc)
    if not batch.requests:
        shown = "; ".join(f"line {n}: {e}" for n, e in list(batch.errors.items())[:3])
        raise InvalidRequest(f"{path}: no valid JSONL request line" + (f" ({shown})" if shown else " (empty file)"))
    return batch


def line_workflow_id(batch_id: str, line: int) -> str:
    """Deterministic, so a chunk re-run after a crash finds the workflow it already submitted."""
    return uuid.uuid5(_ID_NAMESPACE, f"{batch_id}:{line}").hex


async def submit_batch(store: Store, pool: ArqRedis, batch: ParsedBatch, *, tenant: str = "default") -> dict[str, Any]:
    """Write the batch record and enqueue its chunk jobs. Returns {id, state, total, invalid: [...]}."""
    settings, keys = store.settings, Keys(store.settings.prefix)
    batch_id = uuid.uuid4().hex
    lines = sorted(batch.requests)
    chunks = [lines[i:i + settings.batch_chunk_lines] for i in range(0, len(lines), settings.batch_chunk_lines)]
    now = now_ms()
    pipe = store.client.pipeline(transaction=True)
    pipe.hset(keys.batch(batch_id), mapping={
        "id": batch_id, "tenant": tenant, "source": batch.source, "total": batch.total, "submitted": 0,
        "completed": 0, "failed": len(batch.errors), "invalid": len(batch.errors),
        "state": BatchState.RUNNING.value, "created_ms": now, "chunks": len(chunks)})
    for n, req in batch.requests.items():
        pipe.hset(keys.batch_input(batch_id), str(n), req.model_dump_json(exclude_none=True))
    for n, err in batch.errors.items():
        pipe.hset(keys.batch_lines(batch_id), str(n), json.dumps({"state": LineState.INVALID.value, "error": err}))
    pipe.zadd(keys.batches, {batch_id: now})
    await pipe.execute()
    for i, chunk in enumerate(chunks):
        await pool.enqueue_job(RUN_BATCH_CHUNK, _job_id=keys.job_id("batch", batch_id, str(i)),
                               batch_id=batch_id, lines=chunk)
    logger.info("batch %s: %d lines (%d invalid) in %d jobs", batch_id, batch.total, len(batch.errors), len(chunks))
    return {"id": batch_id, "state": BatchState.RUNNING.value, "total": batch.total,
            "invalid": [{"line": n, "error": e} for n, e in sorted(batch.errors.items())]}


# ---------------------------------------------------------------- the job
@dataclass
class _Chunk:
    store: Store
    batch_id: str
    tenant: str
    deadline: float             # time.monotonic() when this slice ends
    keys: Keys = field(init=False)

    def __post_init__(self) -> None:
        self.keys = Keys(self.store.settings.prefix)

    @property
    def redis(self) -> RedisClient:
        return self.store.client

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    async def line(self, n: int) -> dict[str, Any]:
        raw = await self.redis.hget(self.keys.batch_lines(self.batch_id), str(n))
        return json.loads(raw) if raw else {}

    async def run_line(self, n: int) -> bool:
        """Advance one line; True when its outcome is recorded."""
        rec = await self.line(n)
        if rec.get("state") in {x.value for x in LINE_TERMINAL}:
            return True
        wf_id = rec.get("wf") or await self.submit(n)
        if wf_id is None:
            return (await self.line(n)).get("state") in {x.value for x in LINE_TERMINAL}
        if self.left_s() <= 0:
            return False
        try:
            doc = await self.store.wait(wf_id, timeout_s=self.left_s())
        except WorkflowNotFound:
            await self.finish_line(n, wf_id, LineState.FAILED, "workflow record expired")
            return True
        if WorkflowState(doc["state"]) not in TERMINAL_STATES:
            return False
        await self.finish_line(n, wf_id, LineState(doc["state"]), doc.get("error"))
        return True

    async def submit(self, n: int) -> str | None:
        """Submit line `n` (once, even across re-runs); None when it was refused or the slice ended."""
        raw = await self.redis.hget(self.keys.batch_input(self.batch_id), str(n))
        req = SubmitRequest.model_validate_json(raw or b"{}")
        wf_id = line_workflow_id(self.batch_id, n)
        if await self.store.state(wf_id) is None:
            while True:
                try:
                    wf_id = (await self.store.submit(req, tenant=self.tenant, wf_id=wf_id,
                                                     priority=Priority.BATCH)).id
                    break
                except AdmissionRefused as exc:
                    if self.left_s() <= exc.retry_after_s:
                        return None
                    await asyncio.sleep(exc.retry_after_s * random.uniform(0.5, 1.5))
                except WorkflowError as exc:
                    await self.finish_line(n, None, LineState.INVALID, str(exc))
                    return None
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch_lines(self.batch_id), str(n),
                  json.dumps({"wf": wf_id, "state": LineState.SUBMITTED.value}))
        pipe.hincrby(self.keys.batch(self.batch_id), "submitted", 1)
        await pipe.execute()
        return wf_id

    async def finish_line(self, n: int, wf_id: str | None, state: LineState, error: str | None) -> None:
        """Record a line's outcome and count it, in one transaction (a re-run skips recorded lines)."""
        batch_key = self.keys.batch(self.batch_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.batch_lines(self.batch_id), str(n),
                  json.dumps({"wf": wf_id, "state": state.value, "error": error or None}))
        pipe.hincrby(batch_key, "completed" if state is LineState.COMPLETED else "failed", 1)
        if state is LineState.INVALID:
            pipe.hincrby(batch_key, "invalid", 1)
        pipe.hmget(batch_key, "total", "completed", "failed")
        *_, (total, completed, failed) = await pipe.execute()
        if int(completed) + int(failed) >= int(total):
            await self.finish_batch(BatchState.COMPLETED if int(failed) == 0 else BatchState.FAILED)

    async def finish_batch(self, state: BatchState) -> None:
        keys, ttl = self.keys, self.store.settings.result_ttl_s
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(keys.batch(self.batch_id), "state", state.value)
        pipe.hsetnx(keys.batch(self.batch_id), "finished_ms", now_ms())
        pipe.xadd(keys.batch_done(self.batch_id), {"state": state.value})
        for key in (keys.batch(self.batch_id), keys.batch_input(self.batch_id), keys.batch_lines(self.batch_id),
                    keys.batch_done(self.batch_id)):
            pipe.expire(key, ttl)
        await pipe.execute()
        logger.info("batch %s %s", self.batch_id, state.value)


async def run_batch_chunk(ctx: dict[str, Any], *, batch_id: str, lines: list[int]) -> str:
    """arq job: run some lines of a batch for one slice; `Retry` while any is still running."""
    store: Store = ctx["store"]
    settings = store.settings
    tenant = s(await store.client.hget(Keys(settings.prefix).batch(batch_id), "tenant"))
    if not tenant:
        logger.warning("batch %s is gone (expired?); chunk dropped", batch_id)
        return "gone"
    chunk = _Chunk(store, batch_id, tenant, time.monotonic() + settings.batch_slice_s)
    gate = asyncio.Semaphore(settings.batch_concurrency)

    async def one(n: int) -> bool:
        async with gate:
            if chunk.left_s() <= 0:
                return False
            try:
                with tracing.span("batch line", attributes={"batch.id": batch_id, "batch.line": n}):
                    return await chunk.run_line(n)
            except REDIS_ERRORS:
                raise
            except Exception as exc:    # noqa: BLE001 - one broken line never kills the batch
                logger.exception("batch %s line %d: unexpected error", batch_id, n)
                await chunk.finish_line(n, None, LineState.INVALID, f"internal error: {exc}")
                return True

    try:
        results = await asyncio.gather(*(one(n) for n in lines))
    except REDIS_ERRORS as exc:
        logger.warning("batch %s: %s; the chunk runs again in %.0fs", batch_id, exc, REDIS_RETRY_S)
        raise Retry(defer=REDIS_RETRY_S) from exc
    left = len(results) - sum(results)
    if left:
        raise Retry(defer=None)     # next slice at once; progress is in Redis
    return f"{len(lines)} lines done"


# ---------------------------------------------------------------- reading
async def batch_status(store: Store, batch_id: str, *, lines: bool = True) -> dict[str, Any]:
    """The batch record, and with `lines` every line's workflow id, state and error."""
    keys = Keys(store.settings.prefix)
    rec = text_fields(await store.client.hgetall(keys.batch(batch_id)))
    if not rec:
        raise WorkflowNotFound(f"no batch {batch_id}")
    doc: dict[str, Any] = {
        "id": batch_id, "state": rec.get("state"), "source": rec.get("source"),
        **{k: int(rec.get(k) or 0) for k in ("total", "submitted", "completed", "failed", "invalid")},
        "created_at": int(rec.get("created_ms") or 0) / 1000,
        "finished_at": int(rec["finished_ms"]) / 1000 if rec.get("finished_ms") else None,
    }
    if not lines:
        return doc
    pipe = store.client.pipeline(transaction=False)
    pipe.hkeys(keys.batch_input(batch_id))
    pipe.hgetall(keys.batch_lines(batch_id))
    inputs, recorded = await pipe.execute()
    rows = {int(s(n)): {"wf": None, "state": LineState.QUEUED.value} for n in inputs}
    rows.update({int(s(n)): json.loads(v) for n, v in recorded.items()})
    running = [n for n, r in rows.items() if r.get("state") == LineState.SUBMITTED.value]
    if running:
        pipe = store.client.pipeline(transaction=False)
        for n in running:
            pipe.hget(keys.wf(str(rows[n]["wf"])), "state")
        for n, st in zip(running, await pipe.execute()):
            rows[n]["workflow_state"] = s(st) or None
    doc["lines"] = [{"line": n, "workflow_id": r.get("wf"), "state": r.get("state"), "error": r.get("error"),
                     **({"workflow_state": r["workflow_state"]} if "workflow_state" in r else {})}
                    for n, r in sorted(rows.items())]
    return doc


async def batch_results(store: Store, batch_id: str, *, audio_dir: Path | None = None) -> AsyncIterator[dict[str, Any]]:
    """Every line's outcome, in line order: line, workflow_id, state, text (its text output),
    audio_path (with `audio_dir`: the completed line's audio saved there as line-<n>.wav), error."""
    status = await batch_status(store, batch_id)
    for line in status["lines"]:
        wf_id, text, audio_path = line["workflow_id"], None, None
        doc = None
        if wf_id:
            try:
                doc = await store.document(wf_id)
            except WorkflowNotFound:
                doc = None          # expired: the line's record still says how it ended
        if doc is not None:
            texts = [o["text"] for o in doc["outputs"].values() if o["type"] == "text"]
            text = texts[0] if texts else None
            if audio_dir is not None and doc["state"] == "completed" and \
                    any(o["type"] == "audio" for o in doc["outputs"].values()):
                import soundfile as sf

                rate, pcm = await store.audio(wf_id)
                path = audio_dir / f"line-{line['line']}.wav"
                sf.write(str(path), pcm, rate)
                audio_path = str(path)
        yield {"line": line["line"], "workflow_id": wf_id, "state": line["state"], "text": text,
               "audio_path": audio_path, "error": line.get("error")}


async def wait_batch(store: Store, batch_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
    """Block (on the batch's `done` stream, no polling) until it ends or the timeout passes; its status."""
    keys = Keys(store.settings.prefix)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        state = s(await store.client.hget(keys.batch(batch_id), "state"))
        if not state:
            raise WorkflowNotFound(f"no batch {batch_id}")
        if BatchState(state).terminal:
            break
        wait_ms = 5_000 if deadline is None else int((deadline - time.monotonic()) * 1000)
        if wait_ms <= 0:
            break
        await store.client.xread({keys.batch_done(batch_id): "0-0"}, count=1, block=min(wait_ms, 5_000))
    return await batch_status(store, batch_id)


async def runner_alive(redis: RedisClient, settings: Settings) -> bool:
    """Whether some `omniflow jobs` process has reported in recently (arq's health-check key)."""
    return bool(await redis.exists(Keys(settings.prefix).jobs_queue + ":health-check"))
