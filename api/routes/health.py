"""Liveness, readiness and metrics."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from omniflow.api.deps import StateDep
from omniflow.api.metrics import CONTENT_TYPE, render
from omniflow.api.schemas import Health, Readiness
from omniflow.errors import RedisError

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="The process is up")
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness,
            responses={503: {"model": Readiness, "description": "Redis unreachable or a stage has no live worker"}},
            summary="Redis is reachable and every stage has a live worker that is not drained")
async def readyz(state: StateDep) -> Any:
    stages = list(state.store.stage_queues())      # every stage of every pipeline served
    try:
        await state.store.ping()
        counts = await state.store.live_workers(claiming=True)      # a drained worker takes no new work
    except RedisError as exc:
        body = Readiness(status="unready", redis=False, stages=dict.fromkeys(stages, 0), missing=list(stages),
                         message=f"Redis unreachable: {exc}")
        return JSONResponse(body.model_dump(), status_code=503)
    missing = [name for name in stages if counts[name] == 0]
    if missing:
        body = Readiness(status="unready", redis=True, stages=counts, missing=missing,
                         message="no live worker for stage(s): " + ", ".join(missing))
        return JSONResponse(body.model_dump(), status_code=503)
    return Readiness(status="ready", redis=True, stages=counts)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition"}},
            summary="Prometheus metrics")
async def metrics(state: StateDep) -> Response:
    return Response(await render(state), media_type=CONTENT_TYPE)
