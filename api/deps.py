"""Shared dependencies of every router: the service state, the caller (auth + tenant), limits."""
from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry
from omniflow.storage.client import RedisClient

from omniflow.api.errors import ApiError, retry_after
from omniflow.api.hub import LogHub
from omniflow.client.bulk import Completions
from omniflow.api.limits import RateLimiter
from omniflow.api.metrics import StageLatency
from omniflow.config import Settings
from omniflow.ops.fleet import collect_stats
from omniflow.pipeline import Pipeline
from omniflow.client.store import Store

DEFAULT_TENANT = "default"
ADMIN_TENANT = "admin"
POOLS_MAX_AGE_S = 0.5


def parse_api_keys(raw: str) -> dict[str, str]:
    """'key:tenant,key2:tenant2' -> {key: tenant}; a key without a tenant is its own tenant."""
    keys: dict[str, str] = {}
    for item in (x.strip() for x in raw.split(",")):
        if item:
            key, _, tenant = item.partition(":")
            keys[key.strip()] = tenant.strip() or key.strip()
    return keys


def parse_admin_keys(raw: str) -> frozenset[str]:
    return frozenset(x.strip() for x in raw.split(",") if x.strip())


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant, and whether it may see every tenant's workflows."""

    tenant: str
    admin: bool = False

    @property
    def scope(self) -> str | None:
        """The tenant filter for store calls: None (everything) for admins."""
        return None if self.admin else self.tenant


class PoolsCache:
    """The pools snapshot (`omniflow.ops.fleet.collect_stats`), read at most once per `max_age_s` however
    many dashboards and SSE streams of this API process watch it."""

    def __init__(self, max_age_s: float = POOLS_MAX_AGE_S) -> None:
        self.max_age_s = max_age_s
        self._value: dict[str, Any] | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()

    async def get(self, store: Store) -> dict[str, Any]:
        async with self._lock:
            if self._value is None or time.monotonic() - self._at > self.max_age_s:
                self._value = await collect_stats(store)
                self._at = time.monotonic()
            return self._value


@dataclass
class ApiState:
    """Everything a request needs, built by the app's lifespan."""

    settings: Settings
    pipeline: Pipeline
    redis: RedisClient
    store: Store
    hub: LogHub
    api_keys: dict[str, str]
    admin_keys: frozenset[str]
    submit_limiter: RateLimiter
    registry: CollectorRegistry
    latency: StageLatency
    completions: Completions | None = None      # the ends of the workflows `POST ?wait=` waits for (one read)
    pools: PoolsCache = field(default_factory=PoolsCache)
    background: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` detached from the request (it survives the request's cancellation)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


async def pipeline_for(state: ApiState, model: str | None, *, param: str = "model") -> Pipeline:
    """The pipeline an OpenAI `model` (or a workflow's `pipeline`) names: `name` or `name@version`;
    None: the default. One registered since this process started is found too (the registry);
    an unknown one is `UnknownPipeline` (HTTP 404 naming the known ones)."""
    if not model:
        return state.pipeline
    return await state.store.pipeline_named(model, param=param)


def pipeline_ref(pipe: Pipeline) -> str:
    """What a submit names to run on exactly this version."""
    return f"{pipe.name}@{pipe.digest}"


def get_state(request: Request) -> ApiState:
    state: ApiState = request.app.state.api
    return state


bearer = HTTPBearer(auto_error=False, description="an API key from OMNIFLOW_API_KEYS or OMNIFLOW_ADMIN_KEYS")


def get_principal(state: Annotated[ApiState, Depends(get_state)],
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
    usable = credentials is not None and credentials.scheme.lower() == "bearer"
    return principal_for(state, credentials.credentials if credentials is not None and usable else None)


def principal_for(state: ApiState, token: str | None) -> Principal:
    """The caller a bearer token names (None: no token); ApiError 401 when auth is on and it names none."""
    if not state.auth_enabled:
        return Principal(DEFAULT_TENANT, admin=True)
    if token is None:
        raise ApiError(401, "unauthorized", "missing API key: send 'Authorization: Bearer <key>'",
                       headers={"WWW-Authenticate": "Bearer"})
    for key in state.admin_keys:
        if hmac.compare_digest(key, token):
            return Principal(ADMIN_TENANT, admin=True)
    for key, tenant in state.api_keys.items():
        if hmac.compare_digest(key, token):
            return Principal(tenant)
    raise ApiError(401, "unauthorized", "unknown API key", headers={"WWW-Authenticate": "Bearer"})


def get_store(state: Annotated[ApiState, Depends(get_state)]) -> Store:
    return state.store


def check_submit_rate(state: Annotated[ApiState, Depends(get_state)],
                      principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    wait_s = state.submit_limiter.acquire(principal.tenant)
    if wait_s > 0:
        raise ApiError(429, "rate_limited",
                       f"tenant {principal.tenant!r} is over its submit rate of "
                       f"{state.submit_limiter.rate_per_s:g}/s; retry in {wait_s:.2f}s",
                       headers=retry_after(wait_s))
    return principal


def require_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    """The admin routes (the dashboard's reads and actions on the fleet) need an admin key."""
    if not principal.admin:
        raise ApiError(403, "forbidden", "this route needs an admin key (OMNIFLOW_ADMIN_KEYS)")
    return principal


StateDep = Annotated[ApiState, Depends(get_state)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
AdminDep = Annotated[Principal, Depends(require_admin)]
SubmitterDep = Annotated[Principal, Depends(check_submit_rate)]
StoreDep = Annotated[Store, Depends(get_store)]
