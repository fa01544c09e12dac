"""A bounded property-based run of the OpenAPI document (schemathesis): no 5xx, no schema violations."""
from __future__ import annotations

import asyncio

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from apiserver import ADMIN_KEY, api_factory, auth_settings  # noqa: F401 - fixture

MAX_EXAMPLES = 6
CALLS: list[str] = []          # operations called (the test checks all were)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz(base_url: str) -> list[str]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    failures: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case: schemathesis.Case) -> None:
            if case.path in ("/v1/workflows/{wf_id}", "/v1/workflows") and isinstance(case.query, dict):
                case.query["wait"] = 0                 # a long-poll on a live workflow is not a bug
            if case.path == "/v1/admin/pools/events":
                case.query = {**(case.query or {}), "count": 1}     # an endless stream is not a bug either
            CALLS.append(f"{case.method} {case.path}")
            case.call_and_validate(base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                   checks=CHECKS, timeout=20)

        try:
            check()
        except Exception as exc:  # noqa: BLE001 - collect every operation's failure
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    return failures


@pytest.mark.slow
async def test_openapi_fuzz_finds_no_server_errors(api_factory):
    async with api_factory(**auth_settings()) as (_engine, server):
        failures = await asyncio.to_thread(fuzz, server.url)
    assert not failures, "\n\n".join(failures)
    assert len(set(CALLS)) == 25                     # every operation was exercised (the dashboard's, audio's and usage's and the tenants' included)
