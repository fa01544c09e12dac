"""Process plumbing shared by the long-running commands: signals, logging, checks."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from omniflow.errors import ConfigError

logger = logging.getLogger(__name__)

SAFE_POLICIES = frozenset({"noeviction"})
DEFAULT_BACKOFF_FIRST_S = 0.05
DEFAULT_BACKOFF_CAP_S = 2.0


class Backoff:
    """Exponential backoff for a loop that retries after a Redis error (reset on success)."""

    def __init__(self, *, first_s: float = DEFAULT_BACKOFF_FIRST_S, cap_s: float = DEFAULT_BACKOFF_CAP_S) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self.delay_s = first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    async def wait(self, log: logging.Logger, what: str, exc: BaseException) -> None:
        log.warning("%s: %s; retrying in %.2fs", what, exc, self.delay_s)
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.cap_s)


def setup_logging(level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("OMNIFLOW_LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
    )


# A worker under load allocates and frees many small objects per session (futures, tasks, dicts),
# and the default collector (a gen-0 pass every 700 allocations, full passes over everything the
# process imported) took ~13 % of a busy worker's time with pauses up to 50 ms (measured). Objects
# alive at startup are frozen out of the collector, and collections run less often.
GC_THRESHOLDS = (50_000, 20, 20)


def tune_gc() -> None:
    """For long-running processes, once their imports and setup are done (`OMNIFLOW_GC_TUNE=0`: off)."""
    if os.environ.get("OMNIFLOW_GC_TUNE", "1") == "0":
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def run_until_signal(main: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run `main(stop)` until SIGINT or SIGTERM sets `stop`."""
    tune_gc()

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())


async def check_eviction_policy(redis: Redis) -> None:
    """Refuse to run against a server that may evict keys: evicting a record loses a workflow."""
    try:
        reply = await redis.config_get("maxmemory-policy")
    except ResponseError as exc:   # managed Redis may forbid CONFIG
        logger.warning("cannot read maxmemory-policy (%s); make sure it is noeviction", exc)
        return
    policy = reply.get(b"maxmemory-policy") or reply.get("maxmemory-policy")
    policy = policy.decode() if isinstance(policy, bytes) else policy
    if policy and policy not in SAFE_POLICIES:
        raise ConfigError(
            f"Redis maxmemory-policy is {policy!r}: it may evict workflow records and lose requests; "
            "set `maxmemory-policy noeviction` (see deploy/redis/redis.conf)"
        )
