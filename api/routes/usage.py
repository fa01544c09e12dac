"""Usage per tenant: `GET /v1/usage`. An admin key sees every tenant (or the one it asks for); a
tenant's key sees its own only (asking for another tenant is a 403, whether it exists or not)."""
from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from omniflow.api.deps import PrincipalDep, StateDep
from omniflow.api.errors import ApiError
from omniflow.api.schemas import AUTH_ERRORS, ErrorResponse, UsageReport
from omniflow.ops.admin import parse_duration
from omniflow.ops.usage import read_usage

router = APIRouter(prefix="/v1", tags=["usage"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorResponse, "description": "a tenant key asking for another tenant's usage"},
    422: {"model": ErrorResponse, "description": "bad parameters: a bad `since`, a tenant or pipeline never seen"},
    **AUTH_ERRORS}


@router.get("/usage", response_model=UsageReport, responses=_ERRORS,
            summary="Compute seconds, audio seconds and tokens per tenant, pipeline and stage")
async def usage(state: StateDep, principal: PrincipalDep,
                tenant: Annotated[str | None, Query(min_length=1, max_length=256,
                                                    description="one tenant (a tenant key: its own only)")] = None,
                pipeline: Annotated[str | None, Query(min_length=1, max_length=64,
                                                      description="one pipeline")] = None,
                since: Annotated[str, Query(max_length=32, description="the last DURATION: 90m, 12h, 7d (rounded "
                                                                       "down to the hour)")] = "1d") -> Any:
    if not principal.admin:
        if tenant is not None and tenant != principal.tenant:
            raise ApiError(403, "forbidden", "a tenant key sees its own usage only")
        tenant = principal.tenant
    return await read_usage(state.store, tenant=tenant, pipeline=pipeline, since_s=parse_duration(since),
                            tenants=state.api_keys.values())
