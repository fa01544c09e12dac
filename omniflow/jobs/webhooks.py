"""Webhook callbacks: a terminal workflow's document, POSTed to its `webhook_url`.

Flow: the Lua `finalize` XADDs `{wf, state}` to `<prefix>:notify` when a
workflow with a webhook ends. `NotifyDispatcher` (in every `omniflow jobs`
process, consumer group `webhooks`, stale entries reclaimed with XAUTOCLAIM)
turns each entry into one arq job `deliver_webhook` whose job id is stable per
(workflow, state), then acks and deletes the entry. The job POSTs the workflow
document with Standard Webhooks headers; a non-2xx answer or a network error
is retried by arq with exponential backoff up to `webhook_max_attempts`.
Addresses are checked by `omniflow.jobs.egress` first (no private targets).

Outcomes are kept in `<prefix>:webhook:{<id>}` (hash: the last one), every attempt in
`<prefix>:webhook:{<id>}:attempts` (list of JSON, shown in the workflow document) and counted in
`<prefix>:stats` fields `webhook:delivered`, `webhook:failed`,
`webhook:refused` and `webhook:retried` (read by `/metrics`).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import Enum
from typing import Any

import httpx
from arq import Retry
from arq.connections import ArqRedis
from omniflow.storage.client import RedisClient
from standardwebhooks import Webhook

from omniflow import tracing
from omniflow.storage import redisio
from omniflow.config import Settings
from omniflow.jobs.egress import EgressPolicy, EgressRefused, check_url, split_url
from omniflow.storage.entries import notification
from omniflow.errors import ConfigError, MalformedEntry, WorkflowNotFound
from omniflow.jobs.queue import DELIVER_WEBHOOK
from omniflow.storage.topology import is_cluster, read_groups
from omniflow.storage.keys import NOTIFY_GROUP, Keys
from omniflow.storage.transitions.housekeeping import reap_consumer, reap_idle_consumers
from omniflow.storage.transitions.reconcile import dead_letter
from omniflow.client.store import Store
from omniflow.storage.schema import StatsField, s

logger = logging.getLogger(__name__)

BACKOFF_FACTOR = 4
USER_AGENT = "omniflow-webhooks/1"
CLAIM_INTERVAL_S = 5.0
READ_COUNT = 64
ERROR_PAUSE_S = 1.0
MAX_RECORDED_ATTEMPTS = 50
#: a consumer of the notify group that holds nothing and has not read for this long is a jobs
#: runner that is gone (a live one reads at least once per `block_ms`)
DEAD_CONSUMER_IDLE_MS = 120_000


class DeliveryOutcome(str, Enum):
    DELIVERED = "delivered"
    RETRIED = "retried"     # one failed attempt; another is scheduled
    FAILED = "failed"       # every attempt failed, or the workflow record is gone
    REFUSED = "refused"     # the URL is not allowed (SSRF policy, bad scheme); never retried


def backoff_s(attempt: int, *, base_s: float, max_s: float) -> float:
    """Delay before attempt `attempt + 1`: base, x4 each time, capped."""
    return float(min(max_s, base_s * BACKOFF_FACTOR ** max(0, attempt - 1)))


def webhook_id(wf_id: str, state: str) -> str:
    """The `webhook-id` header: the same on every retry of one (workflow, state), so receivers can dedupe."""
    return f"msg_{wf_id}_{state}"


def make_signer(secret: str) -> Webhook:
    try:
        return Webhook(secret)
    except Exception as exc:    # noqa: BLE001 - the package raises bare errors for bad base64
        raise ConfigError(f"OMNIFLOW_WEBHOOK_SECRET is not a valid 'whsec_<base64>' secret: {exc}") from exc


async def load_secret(redis: RedisClient, keys: Keys, settings: Settings) -> str:
    """`webhook_secret`, else the one kept in Redis (generated once, shared by every jobs process)."""
    if settings.webhook_secret:
        make_signer(settings.webhook_secret)
        return settings.webhook_secret
    fresh = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    if await redis.set(keys.webhook_secret, fresh, nx=True):
        logger.warning("no OMNIFLOW_WEBHOOK_SECRET: generated one and stored it in Redis key %s "
                       "(receivers need it to verify signatures)", keys.webhook_secret)
    return s(await redis.get(keys.webhook_secret))


@dataclass
class WebhookSender:
    """Signs and POSTs one payload, connecting to the address the egress policy approved."""

    signer: Webhook
    policy: EgressPolicy
    http: httpx.AsyncClient

    async def post(self, url: str, msg_id: str, body: str) -> int:
        """The response status; EgressRefused or httpx.HTTPError when there is none."""
        addr = await check_url(url, self.policy)
        scheme, host, port = split_url(url)
        now = datetime.now(tz=UTC)
        default_port = 443 if scheme == "https" else 80
        headers = {
            "content-type": "application/json",
            "host": host if port == default_port else f"{host}:{port}",
            "webhook-id": msg_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self.signer.sign(msg_id, now, body),
        }
        pinned = httpx.URL(url).copy_with(host=str(addr))
        extensions = {"sni_hostname": host} if scheme == "https" else {}
        async with self.http.stream("POST", pinned, content=body.encode(), headers=headers,
                                    extensions=extensions) as resp:
            return resp.status_code


def http_client(settings: Settings) -> httpx.AsyncClient:
    # no redirects (a 3xx could point inside the network), no proxies from the environment
    return httpx.AsyncClient(timeout=settings.webhook_timeout_s, follow_redirects=False, trust_env=False,
                             headers={"user-agent": USER_AGENT})


async def record(redis: RedisClient, keys: Keys, wf_id: str, outcome: DeliveryOutcome, *, ttl_s: int,
                 **fields: Any) -> None:
    """One pipeline: the per-workflow delivery record and the `<prefix>:stats` counter."""
    now = int(time.time() * 1000)
    values = {k: "" if v is None else str(v) for k, v in fields.items()}
    values.update(outcome=outcome.value, updated_ms=str(now))
    if outcome is DeliveryOutcome.DELIVERED:
        values["delivered_ms"] = str(now)
    attempt = {"attempt": int(fields.get("attempts") or 1), "at": now / 1000, "outcome": outcome.value,
               "status": fields.get("status"), "error": fields.get("error") or None}
    pipe = redis.pipeline(transaction=True)
    pipe.hset(keys.webhook(wf_id), mapping=values)
    pipe.expire(keys.webhook(wf_id), ttl_s)
    pipe.rpush(keys.webhook_attempts(wf_id), json.dumps(attempt))
    pipe.ltrim(keys.webhook_attempts(wf_id), -MAX_RECORDED_ATTEMPTS, -1)
    pipe.expire(keys.webhook_attempts(wf_id), ttl_s)
    pipe.hincrby(keys.stats, StatsField.webhook(outcome.value), 1)
    await pipe.execute()


async def deliver_webhook(ctx: dict[str, Any], *, wf_id: str, state: str) -> str:
    """arq job: POST the document of workflow `wf_id` (ended in `state`) to its webhook URL."""
    try:
        if tracing.tracer is None:
            return await _deliver(ctx, wf_id, state)
        # a span of the workflow's trace per delivery attempt (an attempt that is retried ends in error)
        store: Store = ctx["store"]
        trace = s(await store.client.hget(store.keys.wf(wf_id), "trace"))
        if not trace:           # submitted untraced: stays so
            return await _deliver(ctx, wf_id, state)
        with tracing.span("webhook deliver", traceparent=trace, kind="client",
                          attributes={"workflow.id": wf_id, "state": state,
                                      "attempt": int(ctx.get("job_try") or 1)}) as sp:
            outcome = await _deliver(ctx, wf_id, state)
            if sp is not None:
                sp.set_attribute("omniflow.outcome", outcome)
            return outcome
    except redisio.REDIS_ERRORS as exc:
        logger.warning("webhook for workflow %s: Redis error %s; trying again in %.0fs", wf_id, exc, ERROR_PAUSE_S)
        raise Retry(defer=ERROR_PAUSE_S) from exc


async def _deliver(ctx: dict[str, Any], wf_id: str, state: str) -> str:
    store: Store = ctx["store"]
    sender: WebhookSender = ctx["sender"]
    settings = store.settings
    keys = Keys(settings.prefix)
    attempt = int(ctx.get("job_try") or 1)
    msg_id = webhook_id(wf_id, state)
    prior = await store.client.hmget(keys.webhook(wf_id), "outcome", "webhook_id")
    if s(prior[0]) in (DeliveryOutcome.DELIVERED.value, DeliveryOutcome.REFUSED.value) and s(prior[1]) == msg_id:
        return f"already {s(prior[0])}"
    base = {"webhook_id": msg_id, "state": state, "attempts": attempt}

    async def done(outcome: DeliveryOutcome, **fields: Any) -> str:
        await asyncio.shield(record(store.client, keys, wf_id, outcome, ttl_s=settings.result_ttl_s,
                                    **base, **fields))
        return outcome.value

    url = s(await store.client.hget(keys.wf(wf_id), "webhook"))
    try:
        doc = await store.document(wf_id)
    except WorkflowNotFound:
        logger.warning("webhook %s: workflow %s is gone (expired?); not delivered", msg_id, wf_id)
        return await done(DeliveryOutcome.FAILED, error="workflow record expired before delivery")
    if not url:
        return await done(DeliveryOutcome.FAILED, error="workflow has no webhook_url")
    body = json.dumps(doc, separators=(",", ":"))
    status: int | None = None
    try:
        status = await sender.post(url, msg_id, body)
        error = "" if 200 <= status < 300 else f"HTTP {status}"
    except EgressRefused as exc:
        logger.warning("webhook %s for workflow %s refused: %s", msg_id, wf_id, exc)
        return await done(DeliveryOutcome.REFUSED, url=url, error=str(exc))
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if not error:
        logger.info("webhook %s delivered to %s (attempt %d, HTTP %d)", msg_id, url, attempt, status)
        return await done(DeliveryOutcome.DELIVERED, url=url, status=status, error="")
    if attempt >= settings.webhook_max_attempts:
        logger.warning("webhook %s to %s failed after %d attempts: %s", msg_id, url, attempt, error)
        return await done(DeliveryOutcome.FAILED, url=url, status=status, error=error)
    delay = backoff_s(attempt, base_s=settings.webhook_backoff_s, max_s=settings.webhook_backoff_max_s)
    logger.info("webhook %s to %s: %s; attempt %d of %d in %.1fs", msg_id, url, error, attempt + 1,
                settings.webhook_max_attempts, delay)
    await done(DeliveryOutcome.RETRIED, url=url, status=status, error=error,
               next_attempt_ms=int((time.time() + delay) * 1000))
    raise Retry(defer=delay)


class NotifyDispatcher:
    """Turns the cells' `notify` entries into `deliver_webhook` jobs (consumer groups, crash-safe):
    one blocking read over every cell on a single server, one loop per cell on a cluster."""

    def __init__(self, *, redis: RedisClient, pool: ArqRedis, settings: Settings, consumer: str) -> None:
        self.redis, self.pool, self.settings, self.consumer = redis, pool, settings, consumer
        self.keys = Keys.of(settings, redis)
        self.dispatched = 0

    async def ensure_group(self, cells: tuple[int, ...] | None = None) -> None:
        for cell in self.keys.all_cells if cells is None else cells:
            await redisio.ensure_group(self.redis, self.keys.notify(cell), NOTIFY_GROUP)

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(*(self._run(stop, group) for group in read_groups(self.redis, self.keys.cells)))
        await self.leave()

    async def _run(self, stop: asyncio.Event, cells: tuple[int, ...]) -> None:
        next_claim = 0.0
        fresh = True
        streams = {self.keys.notify(cell): cell for cell in cells}
        while not stop.is_set():
            try:
                if fresh:
                    await self.ensure_group(cells)
                    fresh = False
                if time.monotonic() >= next_claim:
                    next_claim = time.monotonic() + CLAIM_INTERVAL_S
                    for cell in cells:
                        await self.claim_stale(cell)
                reply = await self.redis.xreadgroup(NOTIFY_GROUP, self.consumer, dict.fromkeys(streams, ">"),
                                                    count=READ_COUNT, block=self.settings.block_ms)
                for stream, entries in reply or []:
                    await self.dispatch(entries, streams[s(stream)])
            except redisio.REDIS_ERRORS as exc:
                logger.warning("notify dispatcher: %s; retrying in %.1fs", redisio.translate(exc), ERROR_PAUSE_S)
                await asyncio.sleep(ERROR_PAUSE_S)
                fresh = fresh or redisio.is_nogroup(redisio.translate(exc))

    async def leave(self) -> None:
        """Delete our consumer from the groups if it holds nothing (one left by a crash is deleted by
        the other dispatchers once it has been idle long enough)."""
        try:
            await redisio.execute(self.redis, [reap_consumer(self.keys.notify(cell), NOTIFY_GROUP, self.consumer)
                                               for cell in self.keys.all_cells])
        except redisio.REDIS_ERRORS as exc:
            logger.warning("notify dispatcher %s: could not leave the group: %s", self.consumer, exc)

    async def claim_stale(self, cell: int = 0) -> None:
        """Take over entries another dispatcher read but never acked (it died); delete the consumers
        of dispatchers that are gone."""
        stream = self.keys.notify(cell)
        await reap_idle_consumers(self.redis, stream, NOTIFY_GROUP, idle_ms=max(
            DEAD_CONSUMER_IDLE_MS, 10 * self.settings.block_ms), keep=self.consumer)
        start = "0-0"
        while True:
            reply = await self.redis.xautoclaim(stream, NOTIFY_GROUP, self.consumer,
                                                min_idle_time=self.settings.event_claim_idle_ms,
                                                start_id=start, count=READ_COUNT)
            start, entries = s(reply[0]), reply[1]
            if entries:
                logger.info("notify dispatcher %s reclaimed %d stale entries", self.consumer, len(entries))
                await self.dispatch(entries, cell)
            if start == "0-0" or not entries:
                return

    async def dispatch(self, entries: list[Any], cell: int = 0) -> None:
        done: list[Any] = []
        for entry_id, fields in entries:
            if fields:
                try:
                    note = notification(fields)
                except MalformedEntry as exc:
                    logger.warning("notify entry %s is malformed (%s); dead-lettered", s(entry_id), exc)
                    await redisio.call(self.redis, *dead_letter(
                        self.keys.dlq("notify", cell), self.keys.notify(cell), NOTIFY_GROUP, entry_id, fields,
                        f"malformed notify entry: {exc}", max_len=self.settings.dlq_max_len))
                    continue
                # None means a job with this id exists already (redelivered entry): nothing to do
                await self.pool.enqueue_job(DELIVER_WEBHOOK, _job_id=self.keys.job_id("webhook", note.wf_id, note.state),
                                            wf_id=note.wf_id, state=note.state)
                self.dispatched += 1
            done.append(entry_id)
        if done:
            pipe = self.redis.pipeline(transaction=not is_cluster(self.redis))   # one key: one slot
            pipe.xack(self.keys.notify(cell), NOTIFY_GROUP, *done)
            pipe.xdel(self.keys.notify(cell), *done)
            await pipe.execute()
