"""Errors as JSON, in the OpenAI error shape: ``{"error": {"message", "type", "code", "param"}}``
(+ ``fields`` for a 422: every bad field).

omniflow's exception tree (`omniflow.errors`) is mapped to HTTP statuses here and
only here; every `code` is stable (clients switch on it, not on the message). `type` is
OpenAI's class of the error (`invalid_request_error`, `authentication_error`, ...), derived
from the status; `param` names the request field at fault (null when none is).
"""
from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omniflow.errors import (
    AdmissionRefused,
    DeadlineUnmeetable,
    PriorityNotAllowed,
    ConfigError,
    IdempotencyConflict,
    InputClosed,
    InvalidRequest,
    NotReady,
    OmniflowError,
    RedisUnavailable,
    UnknownPipeline,
    WorkflowError,
    WorkflowNotFound,
    WorkflowRetired,
)

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: tuple[tuple[type[OmniflowError], int], ...] = (
    (InvalidRequest, 422),
    (WorkflowNotFound, 404),
    (UnknownPipeline, 404),
    (WorkflowRetired, 409),
    (IdempotencyConflict, 409),
    (NotReady, 409),
    (InputClosed, 409),
    (AdmissionRefused, 429),
    (PriorityNotAllowed, 403),
    (DeadlineUnmeetable, 503),
    (RedisUnavailable, 503),
    (ConfigError, 500),
)

HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
              405: "method_not_allowed", 406: "not_acceptable", 409: "conflict", 413: "body_too_large",
              415: "unsupported_media_type", 422: "invalid_request", 429: "rate_limited",
              503: "unavailable"}


class ApiError(Exception):
    """An HTTP error raised by the API itself (auth, limits, bad values); `param` names the field at fault."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers, self.param = status, code, message, headers or {}, param


def error_type(status: int) -> str:
    """OpenAI's `error.type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(code: str, message: str, *, status: int = 400, param: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(status), "code": code, "param": param, **extra}}


def error_response(status: int, code: str, message: str, *, headers: dict[str, str] | None = None,
                   param: str | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(code, message, status=status, param=param, **extra), status_code=status,
                        headers=headers)


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def _status_of(exc: OmniflowError) -> int:
    own = getattr(exc, "http_status", None)     # an error class may name its own status (KnobUnsupported: 400)
    if isinstance(own, int):
        return own
    for cls, status in STATUS_BY_ERROR:
        if isinstance(exc, cls):
            return status
    return 400 if isinstance(exc, WorkflowError) else 500


async def _omniflow_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OmniflowError)
    status = _status_of(exc)
    code = getattr(exc, "code", None) or ("redis_unavailable" if isinstance(exc, RedisUnavailable) else "internal")
    headers = retry_after(exc.retry_after_s) if isinstance(exc, (AdmissionRefused, DeadlineUnmeetable)) else None
    if isinstance(exc, RedisUnavailable):
        headers = retry_after(1)
    if status >= 500:
        logger.warning("request failed: %s", exc)
    return error_response(status, code, str(exc), headers=headers, param=getattr(exc, "param", None))


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.message, headers=exc.headers, param=exc.param)


def _loc(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(p) for p in loc)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    fields = [{"loc": _loc(e.get("loc", ())), "message": str(e.get("msg", "invalid"))} for e in exc.errors()]
    message = "; ".join(f"{f['loc']}: {f['message']}" for f in fields[:5]) or "invalid request"
    param = fields[0]["loc"].removeprefix("body.").removeprefix("query.") if fields else None
    return error_response(422, "invalid_request", message, param=param or None, fields=fields)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = HTTP_CODES.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), headers=dict(exc.headers or {}))


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error: %s", exc)
    return error_response(500, "internal", "internal error; see the server log")


def install(app: FastAPI) -> None:
    app.add_exception_handler(OmniflowError, _omniflow_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
