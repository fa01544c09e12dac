"""Process plumbing shared by the long-running commands: signals, logging, checks."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from omniflow.storage.client import RedisClient

from omniflow.errors import ConfigError, RedisUnavailable
from omniflow.storage.keys import Keys
from omniflow.storage.redisio import boundary

logger = logging.getLogger(__name__)

SAFE_POLICIES = frozenset({"noeviction"})
DEFAULT_BACKOFF_FIRST_S = 0.05
DEFAULT_BACKOFF_CAP_S = 2.0
DEFAULT_STARTUP_BACKOFF_CAP_S = 5.0


class Backoff:
    """Exponential backoff for a loop that retries after a Redis error (reset on success)."""

    def __init__(self, *, first_s: float = DEFAULT_BACKOFF_FIRST_S, cap_s: float = DEFAULT_BACKOFF_CAP_S) -> None:
        self.first_s, self.cap_s = first_s, cap_s
        self.delay_s = first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    async def sleep(self) -> None:
        """Wait the current delay, then double it (up to the cap)."""
        await asyncio.sleep(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.cap_s)

    async def wait(self, log: logging.Logger, what: str, exc: BaseException) -> None:
        """Say why (one warning), then `sleep`."""
        log.warning("%s: %s; retrying in %.2fs", what, exc, self.delay_s)
        await self.sleep()


async def when_redis_answers(setup: Callable[[], Coroutine[Any, Any, None]], *, what: str, url: str,
                             stop: asyncio.Event | None = None) -> bool:
    """Run `setup` (a daemon's first calls to Redis) until Redis answers; False if `stop` came first.

    A daemon started while Redis is away (not started yet, restarting, failing over) waits for it
    with backoff and says so in one line, instead of dying with a traceback."""
    backoff = Backoff(cap_s=DEFAULT_STARTUP_BACKOFF_CAP_S)
    said = False
    while stop is None or not stop.is_set():
        try:
            await setup()
        except RedisUnavailable as exc:
            if not said:
                logger.warning("%s: Redis at %s is not answering (%s); retrying with backoff", what, url, exc)
                said = True
            await backoff.sleep()
            continue
        if said:
            logger.info("%s: Redis at %s answers again", what, url)
        return True
    return False


async def forever(name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run a daemon's background loop; if it ever raises (a bug: every loop handles Redis errors
    itself), log it and start it again after a backoff. A loop of a daemon never ends the process."""
    backoff = Backoff(first_s=0.5, cap_s=DEFAULT_STARTUP_BACKOFF_CAP_S)
    while True:
        try:
            await loop()
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged with its traceback, then the loop restarts
            logger.exception("%s stopped on an unexpected error; restarting it in %.1fs", name, backoff.delay_s)
            await backoff.sleep()


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


LOOPS = ("uvloop", "asyncio")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop the long-running processes run on: uvloop where it is installed (uvicorn's
    `standard` extra brings it, so the API already runs on it), asyncio's own otherwise or with
    `OMNIFLOW_LOOP=asyncio`. uvloop took 3.7 % less of a worker's CPU per workflow at a fixed rate
    (bench/notes.md, round 12; 8.5 % in round 11's runs). None: asyncio's default."""
    choice = os.environ.get("OMNIFLOW_LOOP", "uvloop").strip().lower() or "uvloop"
    if choice not in LOOPS:
        raise ConfigError(f"OMNIFLOW_LOOP must be one of {', '.join(LOOPS)}, not {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        logger.info("uvloop is not installed: running on asyncio's own event loop")
        return None
    return uvloop.new_event_loop


def run_until_signal(main: Callable[[asyncio.Event], Coroutine[Any, Any, None]]) -> None:
    """Run `main(stop)` until SIGINT or SIGTERM sets `stop` (on `loop_factory()`'s loop)."""
    factory = loop_factory()
    tune_gc()

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    with asyncio.Runner(loop_factory=factory) as run:
        run.run(runner())


async def check_eviction_policy(redis: RedisClient) -> None:
    """Refuse to run against a server that may evict keys: evicting a record loses a workflow."""
    reply = await redis.config_get("maxmemory-policy")
    if reply is None:       # managed Redis (or an ACL) may forbid CONFIG
        logger.warning("cannot read maxmemory-policy (CONFIG is refused); make sure it is noeviction")
        return
    policy = reply.get(b"maxmemory-policy") or reply.get("maxmemory-policy")
    policy = policy.decode() if isinstance(policy, bytes) else policy
    if policy and policy not in SAFE_POLICIES:
        raise ConfigError(
            f"Redis maxmemory-policy is {policy!r}: it may evict workflow records and lose requests; "
            "set `maxmemory-policy noeviction` (see deploy/redis/redis.conf)"
        )


async def check_layout(redis: RedisClient, keys: Keys) -> None:
    """Every process of a deployment must agree on its number of cells (`OMNIFLOW_CELLS`), or some
    cells would be served by nobody: the first process to start records it, the others check it."""
    with boundary():
        recorded = await redis.set(keys.layout, keys.cells, nx=True, get=True)
    if recorded is not None and int(recorded) != keys.cells:
        raise ConfigError(
            f"this process would use {keys.cells} cell(s) but the deployment under prefix {keys.prefix!r} uses "
            f"{int(recorded)} ({keys.layout}): set OMNIFLOW_CELLS={int(recorded)} (the count can change only on "
            "an empty deployment: drain it, then delete that key)")
