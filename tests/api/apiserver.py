"""The API over real HTTP: uvicorn in a background thread (its own event loop) in front of a
real engine (reconciler + workers in the test's loop) on the session's Valkey."""
from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from omniflow.api.app import create_app
from omniflow.ops.embedded import free_port
Engine = Any  # tests/conftest.py:Engine (not importable: tests/ is not a package)

ADMIN_KEY = "admin-secret"
KEYS = {"alice": "key-alice", "bob": "key-bob"}


class ApiServer:
    """uvicorn serving `create_app(...)` on a free loopback port, in a thread."""

    def __init__(self, engine: Engine, *, port: int | None = None, **overrides: Any) -> None:
        self.settings = engine.settings.model_copy(update=overrides)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = create_app(self.settings, engine.pipeline, redis_url=engine.url)
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn:{self.port}", daemon=True)

    def start(self) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def client(self, key: str | None = None, **kwargs: Any) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=30, verify=False, **kwargs)


@pytest.fixture
def api_factory(engine_factory: Callable[..., Any]):
    """`async with api_factory(spec, engine=..., **api_settings) as (engine, server)`."""

    @asynccontextmanager
    async def make(spec: dict[str, Any] | None = None, *, workers: bool = True, engine_settings: dict[str, Any] | None = None,
                   **api_settings: Any) -> AsyncIterator[tuple[Engine, ApiServer]]:
        async with engine_factory(spec, workers=workers, **(engine_settings or {})) as engine:
            server = ApiServer(engine, **api_settings).start()
            try:
                yield engine, server
            finally:
                server.stop()

    return make


def auth_settings(**extra: Any) -> dict[str, Any]:
    return {"api_keys": ",".join(f"{key}:{tenant}" for tenant, key in KEYS.items()), "admin_keys": ADMIN_KEY,
            **extra}
