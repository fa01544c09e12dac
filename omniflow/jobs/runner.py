"""`omniflow jobs`: one process that runs the arq worker for both job kinds
(`deliver_webhook`, `run_batch_chunk`) and the `<prefix>:notify` dispatcher.

Any number may run against one Redis: arq hands each job to one of them, the
dispatcher shares `<prefix>:notify` through a consumer group. SIGTERM stops
picking jobs, lets running ones finish for `jobs_grace_s`, then cancels the
rest; arq re-queues a cancelled job and both job kinds resume where they were.
While Redis is away or refusing (restart, failover, out of memory) the arq
worker and the dispatcher wait and start again with backoff: the process never
exits for it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from omniflow.storage.client import RedisClient
from arq.worker import Worker, func

from omniflow.jobs.batch import CHUNK_MAX_TRIES, run_batch_chunk
from omniflow.config import Settings
from omniflow.jobs.egress import EgressPolicy
from omniflow.jobs.queue import (
    DELIVER_WEBHOOK,
    RUN_BATCH_CHUNK,
    create_job_pool,
    job_deserializer,
    job_serializer,
    queue_name,
)
from omniflow.storage.keys import Keys
from omniflow.pipeline import Pipeline
from omniflow.storage.redisio import REDIS_ERRORS, boundary, translate
from omniflow.runtime import Backoff, check_eviction_policy, when_redis_answers
from omniflow.storage.redisio import connect
from omniflow.client.store import Store
from omniflow.jobs.webhooks import (
    NotifyDispatcher,
    WebhookSender,
    deliver_webhook,
    http_client,
    load_secret,
    make_signer,
)

logger = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 5
WEBHOOK_RESULT_TTL_S = 24 * 3600     # arq keeps the result this long: a re-enqueued job id is a no-op meanwhile


def worker_settings(settings: Settings) -> dict[str, Any]:
    """arq `Worker` keyword arguments (a `WorkerSettings` as a dict), without the Redis connection."""
    return {
        "functions": [
            func(deliver_webhook, name=DELIVER_WEBHOOK, timeout=settings.webhook_timeout_s + 10,
                 keep_result=WEBHOOK_RESULT_TTL_S, max_tries=settings.webhook_max_attempts + 1),
            func(run_batch_chunk, name=RUN_BATCH_CHUNK, timeout=settings.batch_slice_s + 60,
                 keep_result=settings.result_ttl_s, max_tries=CHUNK_MAX_TRIES),
        ],
        "queue_name": queue_name(settings),
        "job_serializer": job_serializer,
        "job_deserializer": job_deserializer,
        "max_jobs": settings.jobs_max_concurrency,
        "poll_delay": settings.jobs_poll_delay_s,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "handle_signals": False,
    }


class JobsRunner:
    def __init__(self, *, settings: Settings, pipeline: Pipeline, redis_url: str, runner_id: str | None = None) -> None:
        self.settings, self.pipeline, self.redis_url = settings, pipeline, redis_url
        self.id = runner_id or f"jobs-{settings.host_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.started = asyncio.Event()
        self.dispatcher: NotifyDispatcher | None = None
        self.worker: Worker | None = None

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        clients: list[RedisClient] = []
        http = http_client(self.settings)
        try:
            async def setup() -> None:
                if not clients:
                    clients.append(connect(self.redis_url))     # asks what kind of server this is: may raise
                redis = clients[0]
                with boundary():
                    await check_eviction_policy(redis)
                    signer = make_signer(await load_secret(redis, Keys(self.settings.prefix), self.settings))
                    pool = await create_job_pool(self.settings.jobs_redis_url or self.redis_url, self.settings,
                                                 conn_retries=0)
                ctx = {"store": Store(redis, self.settings, self.pipeline),
                       "sender": WebhookSender(signer, EgressPolicy.from_settings(self.settings), http)}
                self.worker = Worker(**worker_settings(self.settings), redis_pool=pool, ctx=ctx)
                # (its own client: closed by _shutdown)
                self.dispatcher = NotifyDispatcher(redis=connect(self.redis_url), pool=pool, settings=self.settings,
                                                   consumer=self.id)

            if not await when_redis_answers(setup, what=f"jobs runner {self.id}", url=self.redis_url, stop=stop):
                return
            assert self.worker is not None and self.dispatcher is not None
            halt = asyncio.Event()
            dispatcher = self.dispatcher
            tasks = [asyncio.create_task(_again_and_again("arq worker", self.worker.async_run, halt), name="arq-worker"),
                     asyncio.create_task(_again_and_again("notify dispatcher", lambda: dispatcher.run(halt), halt),
                                         name="notify-dispatcher")]
            self.started.set()
            logger.info("jobs runner %s serving queue %s", self.id, self.worker.queue_name)
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            halt.set()
            await self._shutdown(tasks)
        finally:
            await http.aclose()
            for client in clients:
                await client.aclose()

    async def _shutdown(self, tasks: list[asyncio.Task[Any]]) -> None:
        worker, dispatcher = self.worker, self.dispatcher
        assert worker is not None and dispatcher is not None
        worker.allow_pick_jobs = False
        deadline = time.monotonic() + self.settings.jobs_grace_s
        while any(not t.done() for t in worker.tasks.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # arq's Worker.close() calls the deprecated Redis.close(); this is the same, with aclose()
        worker.handle_sig(signal.SIGTERM)       # cancels what is left: arq re-queues it
        await asyncio.gather(*worker.tasks.values(), return_exceptions=True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(*REDIS_ERRORS):
            await worker.pool.delete(worker.health_check_key)
        await worker.pool.aclose()
        await dispatcher.redis.aclose()
        for task, result in zip(tasks, results):
            if isinstance(result, Exception):
                logger.error("jobs runner: %s ended with %r", task.get_name(), result)
        logger.info("jobs runner %s stopped (%d notify entries dispatched; jobs: %d done, %d failed, %d retried)",
                    self.id, dispatcher.dispatched, worker.jobs_complete, worker.jobs_failed, worker.jobs_retried)
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            raise failures[0]


async def _again_and_again(name: str, run: Callable[[], Coroutine[Any, Any, None]], halt: asyncio.Event) -> None:
    """Run `run` until `halt`; when it ends on a Redis error (away, refusing, restarting), say so in
    one line and start it again with backoff, so the process never exits for it."""
    backoff = Backoff(first_s=0.5, cap_s=5.0)
    failing = False
    while not halt.is_set():
        try:
            await run()
            return
        except REDIS_ERRORS as exc:
            if not failing:
                logger.warning("jobs runner: %s stopped on a Redis error (%s); restarting it with backoff",
                               name, translate(exc))
            failing = True
        except Exception:  # noqa: BLE001 - a bug: logged with its traceback, then restarted
            logger.exception("jobs runner: %s stopped on an unexpected error; restarting it", name)
        await backoff.sleep()


def run_jobs(settings: Settings, pipeline: Pipeline, redis_url: str) -> None:
    """Run the job runner until SIGINT/SIGTERM (blocking)."""
    from omniflow.engine.health import with_health
    from omniflow import tracing
    from omniflow.runtime import run_until_signal

    tracing.setup("jobs")
    runner = JobsRunner(settings=settings, pipeline=pipeline, redis_url=redis_url)
    run_until_signal(with_health(runner.run, port=settings.health_port,
                                 ready=lambda: (runner.started.is_set(), "starting")))
