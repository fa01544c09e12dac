"""Shared fixtures: a real Redis-protocol server per test session, and an
in-process engine (reconciler + one worker per stage) per test, each test on
its own key prefix so tests never see each other's keys."""
from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.asyncio import Redis

from omniflow.config import DEFAULT_PIPELINE, Settings
from omniflow.dataplane import DataPlane
from omniflow.dataplane.shm import DEFAULT_SHM_DIR, name_part, parse_arena, parse_name
from omniflow.ops.embedded import EmbeddedServer, redis_server_binaries
from omniflow.pipeline import Pipeline, build_pipeline
from omniflow.engine.reconciler import Reconciler
from omniflow.client.store import Store, connect
from omniflow.engine.worker import Worker

SERVERS = redis_server_binaries()
# Key prefixes this test session used (`settings_factory`, `shm_prefix`): none of their shared-memory
# segments may outlive the session (see `no_leftover_segments`).
SESSION_PREFIXES: set[str] = set()


MODELS_DIR = Path(__file__).parent / "models"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test` runs on several xdist processes (`--dist loadgroup`): every test of tests/models runs on the
    same one, so each real model is still loaded once per test session."""
    for item in items:
        if MODELS_DIR in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.xdist_group("models"))


def leftover_segments(prefixes: set[str], directory: Path = DEFAULT_SHM_DIR) -> list[str]:
    """Names of the segments and arenas in `directory` that belong to one of `prefixes`."""
    parts = {name_part(p) for p in prefixes}
    try:
        names = [entry.name for entry in directory.iterdir()]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if (seg := parse_name(n) or parse_arena(n)) is not None and seg.prefix in parts)


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """After the whole session, /dev/shm holds no segment or arena of ours (removed, and reported)."""
    yield
    leftovers = leftover_segments(SESSION_PREFIXES)
    for name in leftovers:
        (DEFAULT_SHM_DIR / name).unlink(missing_ok=True)
    assert not leftovers, f"{len(leftovers)} shared-memory segment(s) outlived the test session: {leftovers[:10]}"


def _start(tmp: Path, binary: str) -> EmbeddedServer:
    return EmbeddedServer(data_dir=tmp, binary=binary, appendonly=True, appendfsync="everysec").start()


@pytest.fixture(scope="session")
def valkey_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = _start(tmp_path_factory.mktemp("valkey"), SERVERS["valkey"])
    yield server.url
    server.stop()


@pytest.fixture(scope="session", params=sorted(SERVERS))
def any_server_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Every Redis-protocol server on this machine: Valkey always, redis-server when on PATH."""
    server = _start(tmp_path_factory.mktemp(request.param), SERVERS[request.param])
    yield server.url
    server.stop()


def toy_spec(**stage_params: dict[str, Any]) -> dict[str, Any]:
    """The shipped toy pipeline as a dict, with per-stage param overrides and fast defaults."""
    raw = yaml.safe_load(Path(DEFAULT_PIPELINE).read_text())
    raw = copy.deepcopy(raw)
    for name, stage in raw["stages"].items():
        stage["params"].update({"token_delay_s": 0.0, "chunk_delay_s": 0.0, "max_words": 8})
        stage["params"].update(stage_params.get(name, {}))
        stage["retry"] = {"max_attempts": 3, "backoff_s": 0.01, "backoff_max_s": 0.05}
    return raw


def toy_audio_spec(**stage_params: dict[str, Any]) -> dict[str, Any]:
    """The toy pipeline taking audio as well as text: audio -> ToyASR -> Thinker -> Talker -> Code2Wav."""
    raw = toy_spec(**stage_params)
    asr = {"executor": "omniflow.workers.toy:ToyASR", "replicas": 1, "max_sessions": 32,
           "params": {"word_s": 0.5, "chunk_delay_s": 0.0, **stage_params.get("asr", {})},
           "retry": {"max_attempts": 3, "backoff_s": 0.01, "backoff_max_s": 0.05}}
    raw["stages"] = {"asr": asr, **raw["stages"]}
    raw["inputs"] = {"text": "thinker", "audio": "asr"}
    raw["edges"] = [{"from": "asr", "to": "thinker", "mode": "chunk"}, *raw["edges"]]
    return raw


@pytest.fixture
def settings_factory() -> Callable[..., Settings]:
    def make(url: str, **overrides: Any) -> Settings:
        base = {"redis_url": url, "prefix": f"t{uuid.uuid4().hex[:10]}", "heartbeat_interval_s": 0.2,
                "lease_timeout_s": 1.0, "sweep_interval_s": 0.2, "block_ms": 1000}
        base.update(overrides)
        SESSION_PREFIXES.add(str(base["prefix"]))
        return Settings(**base)
    return make


@pytest.fixture
def shm_prefix() -> str:
    """A fresh key prefix whose segments the session-end check covers."""
    prefix = f"t{uuid.uuid4().hex[:10]}"
    SESSION_PREFIXES.add(prefix)
    return prefix


@pytest.fixture
async def plane_of(valkey_url: str, shm_prefix: str) -> AsyncIterator[Callable[..., DataPlane]]:
    """`plane_of(worker_id, **settings)`: a data plane of this test's prefix on the session's Valkey;
    at the end every payload it holds is released and every key of the prefix deleted."""
    made: list[DataPlane] = []
    redis = connect(valkey_url)

    def make(worker_id: str, **settings: Any) -> DataPlane:
        dp = DataPlane(redis, Settings(redis_url=valkey_url, prefix=shm_prefix, **settings), worker_id=worker_id)
        made.append(dp)
        return dp

    try:
        yield make
        for dp in made:
            assert dp.shm is not None
            dp.shm.release_all()
        keys = [k async for k in redis.scan_iter(match=f"{shm_prefix}:*")]
        if keys:
            await redis.delete(*keys)
    finally:
        await redis.aclose()


class Engine:
    """A reconciler and one worker per stage as tasks in the test's event loop."""

    def __init__(self, url: str, settings: Settings, pipeline: Pipeline) -> None:
        self.url, self.settings, self.pipeline = url, settings, pipeline
        self.redis: Redis = connect(url)
        self.store = Store(self.redis, settings, pipeline)
        self.workers: dict[str, list[Worker]] = {}
        self.reconcilers: list[Reconciler] = []
        self._tasks: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def add_worker(self, stage: str, *, grace_s: float = 10.0, settings: Settings | None = None,
                         **kwargs: Any) -> Worker:
        worker = Worker(settings=settings or self.settings, pipeline=self.pipeline, stage=stage, redis_url=self.url,
                        **kwargs)
        await self._spawn(lambda stop: worker.run(stop, grace_s=grace_s), worker.started)
        self.workers.setdefault(stage, []).append(worker)
        return worker

    async def add_reconciler(self) -> Reconciler:
        rec = Reconciler(settings=self.settings, pipeline=self.pipeline, redis_url=self.url)
        await self._spawn(rec.run, rec.started)
        self.reconcilers.append(rec)
        return rec

    async def _spawn(self, run: Any, started: asyncio.Event) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(run(stop))
        self._tasks.append((stop, task))
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()

    async def close(self) -> None:
        for stop, _ in self._tasks:
            stop.set()
        await asyncio.gather(*(t for _, t in self._tasks), return_exceptions=True)
        await self.redis.aclose()


@pytest.fixture
def engine_factory(valkey_url: str, settings_factory: Callable[..., Settings]):
    engines: list[Engine] = []

    @asynccontextmanager
    async def make(spec: dict[str, Any] | None = None, *, url: str | None = None, workers: bool = True,
                   reconciler: bool = True, **settings_overrides: Any) -> AsyncIterator[Engine]:
        url = url or valkey_url
        pipeline = build_pipeline(spec or toy_spec())
        engine = Engine(url, settings_factory(url, **settings_overrides), pipeline)
        engines.append(engine)
        try:
            if reconciler:
                await engine.add_reconciler()
            if workers:
                for stage in pipeline.order:
                    await engine.add_worker(stage)
            yield engine
        finally:
            await engine.close()

    return make
