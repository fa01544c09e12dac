"""The application factory and the blocking server entry point."""
from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from omniflow import tracing
from omniflow.api import errors
from omniflow.api.deps import ApiState, parse_admin_keys, parse_api_keys
from omniflow.api.hub import LogHub
from omniflow.client.bulk import Completions
from omniflow.api.limits import BodySizeLimit, RateLimiter
from omniflow.api.metrics import StageLatency
from omniflow.api.routes import admin, audio, health, openai, realtime, transcriptions, ui, usage, workflows
from omniflow.config import Settings
from omniflow.catalog import Catalog
from omniflow.errors import ConfigError, OmniflowError
from omniflow.pipeline import Pipeline
from omniflow.storage import registry as pipeline_registry
from omniflow.storage.batcher import Batcher
from omniflow.storage.redisio import REDIS_ERRORS, translate
from omniflow.client.store import Store, connect

logger = logging.getLogger(__name__)

DESCRIPTION = """Durable multi-stage model serving: submit a workflow, poll or stream it,
download its audio, or use the OpenAI-compatible chat API.

Errors are JSON `{"error": {"code", "message"}}` with a stable `code`.
Authenticate with `Authorization: Bearer <key>` when the server has keys configured."""


def create_app(settings: Settings, pipeline: Pipeline | Catalog, *, redis_url: str) -> FastAPI:
    """A FastAPI app serving `pipeline` (or every pipeline of a catalog, the first the default) from
    the Redis at `redis_url`; pipelines other processes register later are served too."""
    catalog = pipeline if isinstance(pipeline, Catalog) else Catalog.of(pipeline)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = connect(redis_url)
        submits = Batcher(redis)            # concurrent POSTs' submits: one round trip while one is on the wire
        store = Store(redis, settings, Catalog.of(list(catalog)), batcher=submits)
        try:
            for pipe in catalog:
                await pipeline_registry.register(redis, store.keys, pipe)
        except OmniflowError as exc:          # Redis not there yet: /readyz says so; the workers register them
            logger.warning("could not register the pipelines: %s", exc)
        except REDIS_ERRORS as exc:
            logger.warning("could not register the pipelines: %s", translate(exc))
        hub = LogHub(store)
        hub.start()
        completions = Completions(store)
        registry = CollectorRegistry(auto_describe=False)
        app.state.api = ApiState(
            settings=settings, pipeline=catalog.default, redis=redis, store=store, hub=hub, completions=completions,
            api_keys=parse_api_keys(settings.api_keys), admin_keys=parse_admin_keys(settings.admin_keys),
            submit_limiter=RateLimiter(settings.submit_rate_per_s), registry=registry,
            latency=StageLatency(registry),
        )
        try:
            yield
        finally:
            state: ApiState = app.state.api
            for task in list(state.background):     # detached aborts: let them land
                await task
            await hub.close()
            await completions.close()
            await submits.drain()                   # a submit whose request went away is still written
            await redis.aclose()

    app = FastAPI(title="omniflow", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    errors.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes, upload_bytes=settings.max_upload_bytes,
                       upload_paths=("/v1/audio/transcriptions", "/v1/chat/completions"))
    if tracing.tracer is not None:     # outermost: the request's span covers everything below
        app.add_middleware(tracing.TraceMiddleware)
    app.include_router(workflows.router)
    app.include_router(openai.router)
    app.include_router(audio.router)
    app.include_router(transcriptions.router)
    app.include_router(realtime.router)
    app.include_router(admin.router)
    app.include_router(usage.router)
    app.include_router(health.router)
    app.include_router(ui.router)
    return app


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(settings: Settings, pipeline: Pipeline | Catalog, redis_url: str, host: str | None = None,
          port: int | None = None) -> None:
    """Run the API until interrupted. Without API keys it only binds to loopback."""
    host = host or settings.api_host
    port = port if port is not None else settings.api_port
    if not (settings.api_keys or settings.admin_keys):
        if not is_loopback(host):
            raise ConfigError(
                f"refusing to bind {host}: no API keys are configured (set OMNIFLOW_API_KEYS='key:tenant' "
                "or bind 127.0.0.1)")
        logger.warning("no API keys configured: authentication is off, serving on loopback %s:%d only", host, port)
    tracing.setup("api")
    app = create_app(settings, pipeline, redis_url=redis_url)
    uvicorn.run(app, host=host, port=port, log_level="info", proxy_headers=False, timeout_graceful_shutdown=5)
