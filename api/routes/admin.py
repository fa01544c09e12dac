"""The fleet, for operators (and the dashboard at /ui): pools, workers, drain. Admin key only."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from omniflow.ops import admin, fleet
from omniflow.api.deps import AdminDep, ApiState, StateDep
from omniflow.api.errors import ApiError
from omniflow.fairness import MAX_WEIGHT, MIN_WEIGHT
from omniflow.storage import fairshare
from omniflow.api.schemas import AUTH_ERRORS, ErrorResponse, Pools, WorkerView
from omniflow.api.sse import EventStreamResponse, event_schema, sse_event
from omniflow.errors import RedisUnavailable

router = APIRouter(prefix="/v1/admin", tags=["admin"])

E = ErrorResponse
ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": E, "description": "the key is not an admin key"}, **AUTH_ERRORS}
WorkerId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.:+-]{1,200}$", description="worker id (`omniflow workers`)")]


@router.get("/pools", response_model=Pools, responses=ADMIN_ERRORS, summary="Every stage pool at a glance")
async def pools(state: StateDep, _: AdminDep) -> Any:
    return await state.pools.get(state.store)


@router.get(
    "/pools/events", response_class=EventStreamResponse,
    responses={200: {"content": {"text/event-stream": {"schema": event_schema(
                         ["pools", "unavailable"], {"$ref": "#/components/schemas/Pools"})}},
                     "description": "Server-sent events: `pools` (the same document as GET /v1/admin/pools) "
                                    "every `interval` seconds"},
               403: {"description": "the key is not an admin key",
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}},
               422: {"description": "bad parameters",
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}},
    summary="Stream the pools snapshot (SSE)",
)
async def pools_events(state: StateDep, _: AdminDep,
                       interval: Annotated[float, Query(ge=0.5, le=30, description="seconds between events")] = 1.0,
                       count: Annotated[int | None, Query(ge=1, le=100_000,
                                                          description="end after this many events")] = None,
                       ) -> EventStreamResponse:
    return EventStreamResponse(_pools_stream(state, interval, count))


async def _pools_stream(state: ApiState, interval: float, count: int | None) -> AsyncIterator[bytes]:
    sent = 0
    while count is None or sent < count:
        try:
            snapshot = await state.pools.get(state.store)
            yield sse_event(json.dumps(snapshot), event="pools")
        except RedisUnavailable as exc:          # say so and keep the stream: the dashboard shows it
            yield sse_event(json.dumps({"error": str(exc)}), event="unavailable")
        sent += 1
        if count is None or sent < count:
            await asyncio.sleep(interval)


@router.get("/workers", response_model=list[WorkerView], responses=ADMIN_ERRORS,
            summary="Every registered worker: stages, host, heartbeat age, sessions held, drain flag")
async def workers(state: StateDep, _: AdminDep) -> Any:
    return await fleet.list_workers(state.store)


_DRAIN_ERRORS = {422: {"model": E, "description": "no live worker with this id"}, **ADMIN_ERRORS}


@router.post("/workers/{worker_id}/drain", response_model=WorkerView, responses=_DRAIN_ERRORS,
             summary="Drain a worker: it claims nothing new and finishes what it holds")
async def drain(worker_id: WorkerId, state: StateDep, _: AdminDep) -> Any:
    return await admin.set_drain(state.store, worker_id, drain=True)


@router.post("/workers/{worker_id}/undrain", response_model=WorkerView, responses=_DRAIN_ERRORS,
             summary="Lift a worker's drain: it claims again")
async def undrain(worker_id: WorkerId, state: StateDep, _: AdminDep) -> Any:
    return await admin.set_drain(state.store, worker_id, drain=False)


# ---------------------------------------------------------------- tenants (fair share)
TenantName = Annotated[str, Path(pattern=r"^[^,=: \t\n]{1,128}$", description="a tenant (as OMNIFLOW_API_KEYS names it)")]


class TenantWeight(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight: float | None = Field(..., description=f"{MIN_WEIGHT:g} to {MAX_WEIGHT:g}; null: back to the configured one")


class TenantRow(BaseModel):
    tenant: str
    weight: float
    source: str = Field(description="live (set here or with `omniflow tenants weight`), config or default")
    live: int = Field(description="its live workflows")
    share: int = Field(description="the live workflows it may hold once the deployment is busy")


@router.get("/tenants", response_model=list[TenantRow], responses=ADMIN_ERRORS,
            summary="Fair share: every tenant's weight, live workflows and share")
async def tenants(state: StateDep, _: AdminDep) -> Any:
    return await fairshare.weights_table(state.redis, state.settings, state.store.keys)


@router.put("/tenants/{tenant}/weight", response_model=TenantRow,
            responses={422: {"model": E, "description": "a weight out of range"}, **ADMIN_ERRORS},
            summary="Set a tenant's fair-share weight live (every process follows within a refresh)")
async def set_tenant_weight(tenant: TenantName, body: TenantWeight, state: StateDep, _: AdminDep) -> Any:
    try:
        await fairshare.set_weight(state.redis, state.store.keys, tenant, body.weight)
    except ValueError as exc:
        raise ApiError(422, "invalid_value", str(exc), param="weight") from None
    rows = await fairshare.weights_table(state.redis, state.settings, state.store.keys)
    return next((r for r in rows if r["tenant"] == tenant),
                {"tenant": tenant, "weight": 1.0, "source": "default", "live": 0, "share": 0})
