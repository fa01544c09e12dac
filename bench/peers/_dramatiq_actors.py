"""Dramatiq actors for bench/peers/dramatiq_chain.py (loaded by the `dramatiq` CLI in each worker).

The broker URL comes from BENCH_REDIS_URL. Default middleware, default JSON encoder.
"""
from __future__ import annotations

import os
import time

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import Middleware

from bench import workload

URL = os.environ["BENCH_REDIS_URL"]
_client = redis.Redis.from_url(URL)


class _Ready(Middleware):
    def after_worker_boot(self, broker, worker):
        _client.incr(workload.READY_KEY)


broker = RedisBroker(url=URL)
broker.add_middleware(_Ready())
dramatiq.set_broker(broker)


@dramatiq.actor(actor_name="thinker")
def thinker(wf: str, ts: float, prompt: str) -> None:
    talker.send(wf, ts, workload.thinker(prompt))


@dramatiq.actor(actor_name="talker")
def talker(wf: str, ts: float, texts: list[str]) -> None:
    code2wav.send(wf, ts, workload.talker(texts))


@dramatiq.actor(actor_name="code2wav")
def code2wav(wf: str, ts: float, codes: list[list[int]]) -> None:
    workload.code2wav(codes)
    _client.xadd(workload.DONE_STREAM, {"wf": wf, "ts": repr(ts), "td": repr(time.time())})
