"""OpenTelemetry traces: one trace per request, across the API, the workers and the reconciler.

Off unless `OTEL_TRACES_EXPORTER` names an exporter (`otlp`: OTLP over HTTP/protobuf, or
`console`); then `setup` builds the process's tracer provider the standard way (the SDK reads
`OTEL_EXPORTER_OTLP_*`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER[_ARG]`,
`OTEL_BSP_*` itself). While it is off the SDK is never imported and every call site pays one
check, `tracing.tracer is not None`: no span object is ever made.

How the context travels (docs/operations.md, "Traces"):

- an HTTP or WebSocket request: `TraceMiddleware` continues the caller's W3C `traceparent` /
  `tracestate` (a malformed one is ignored: a new trace starts) in a SERVER span that is current
  while the route runs;
- a workflow: `Store.submit_call` writes the current span's `traceparent` (and `tracestate`) into
  the record (fields `trace`, `tracestate`); `claim.lua` hands it to the worker with the record,
  and `stage_event.lua` to the reconciler with its decision, so every process continues the trace
  of the request that made the workflow (its spans are children of the API span);
- what each process records: a span per stage session (`session_span` / `end_session`, chunk
  hops as its events), one per reconciler decision (`decision`), per webhook delivery and per
  batch line (`span`).
"""
from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from omniflow.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

__all__ = ["TraceMiddleware", "aborted", "chunk_event", "decision", "end_session", "exporter_names", "flush", "now_ns",
           "record_fields", "session_span", "setup", "shutdown", "span", "trace_id_of", "tracer"]

#: the process's tracer: None while tracing is off (the one check every call site makes)
tracer: Tracer | None = None
_provider: TracerProvider | None = None

TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
#: request paths that get no span (scraped or polled by machines, never part of a request's story)
UNTRACED_PATHS = ("/metrics", "/healthz", "/readyz", "/ui", "/favicon.ico")
EXPORTERS = ("otlp", "console", "none")


def exporter_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """The exporters `OTEL_TRACES_EXPORTER` names ([] when unset or `none`); ConfigError for one we lack."""
    env = os.environ if environ is None else environ
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: {unknown} not supported; use otlp (OTLP over HTTP), console or none")
    names = [n for n in names if n != "none"]
    if "otlp" in names:
        protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or "http/protobuf")
        if protocol != "http/protobuf":
            raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: omniflow exports OTLP over HTTP only "
                              "(http/protobuf); point it at the collector's HTTP port (4318)")
    return names


def setup(role: str) -> bool:
    """Turn tracing on in this process when the environment asks for it (idempotent: the first call
    decides). `role` names the process (`api`, `worker`, `reconciler`, `jobs`): the default service
    name is `omniflow-<role>` (`OTEL_SERVICE_NAME` overrides it). Returns whether tracing is on."""
    global tracer, _provider
    if tracer is not None:
        return True
    names = exporter_names()
    if not names:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    resource = Resource.create({"service.name": f"omniflow-{role}", "omniflow.role": role})
    provider = TracerProvider(resource=resource)       # the sampler from OTEL_TRACES_SAMPLER
    for name in names:
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    tracer = provider.get_tracer("omniflow")
    logger.info("tracing on: %s as %s", ",".join(names), resource.attributes.get("service.name"))
    return True


def flush(timeout_s: float = 10.0) -> bool:
    """Export every finished span now (tests; a process about to exit)."""
    return _provider.force_flush(int(timeout_s * 1000)) if _provider is not None else True


def shutdown() -> None:
    """Flush and turn tracing off (tests; the SDK also does it at exit)."""
    global tracer, _provider
    provider, tracer, _provider = _provider, None, None
    if provider is not None:
        provider.shutdown()


# ---------------------------------------------------------------- context
def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id a stored `traceparent` names (None when there is none); needs no SDK."""
    if not traceparent:
        return None
    m = TRACEPARENT.match(traceparent)
    return m.group(1) if m and m.group(1) != "0" * 32 else None


def _parent(traceparent: str, tracestate: str = "") -> Context | None:
    """The context a stored `traceparent` continues (None: none, or malformed). Records hold only
    what `record_fields` wrote, so this is a plain parse (the W3C propagator, for what callers
    send, is `TraceMiddleware`'s)."""
    m = TRACEPARENT.match(traceparent)
    if m is None or m.group(1) == "0" * 32:
        return None
    from opentelemetry import trace

    state = trace.TraceState.from_header([tracestate]) if tracestate else None
    ctx = trace.SpanContext(int(m.group(1), 16), int(m.group(2), 16), is_remote=True,
                            trace_flags=trace.TraceFlags(int(m.group(3), 16)), trace_state=state)
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx))


def record_fields(wf_id: str) -> list[str]:
    """The workflow record's trace fields (`trace`, `tracestate`) for workflow `wf_id` submitted now:
    the current span's context (the API request's, a batch line's), which gets the workflow id as
    an attribute; without one (the CLI, the Python client) a `submit` span starts a new trace."""
    from opentelemetry import trace

    assert tracer is not None
    current = trace.get_current_span()
    if current.get_span_context().is_valid:
        current.set_attribute("omniflow.workflow.id", wf_id)
    else:
        current = tracer.start_span("submit", kind=trace.SpanKind.PRODUCER, attributes={"omniflow.workflow.id": wf_id})
        current.end()
    ctx = current.get_span_context()
    fields = ["trace", f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"]
    if ctx.trace_state:
        fields += ["tracestate", ctx.trace_state.to_header()]
    return fields


@contextmanager
def span(name: str, *, traceparent: str = "", tracestate: str = "", kind: str = "internal",
         attributes: Mapping[str, Any] | None = None) -> Iterator[Span | None]:
    """A span around a block, current inside it, child of `traceparent` when given (else of the
    current span); yields None while tracing is off. An exception marks it as an error."""
    if tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    with tracer.start_as_current_span(name, context=_parent(traceparent, tracestate), kind=SpanKind[kind.upper()],
                                      attributes={f"omniflow.{k}": v for k, v in (attributes or {}).items()}) as sp:
        yield sp


def decision(name: str, *, traceparent: str, start_ns: int | None = None, error: str = "",
             **attributes: Any) -> None:
    """A reconciler decision (`completed`, `retry`, `failed`, `abort`, `dead_letter`) as a span of
    the workflow's trace, from `start_ns` (when the reconciler began applying it) to now. A workflow
    submitted untraced gets none; an entry that names no readable workflow (`dead_letter`) is a root."""
    if tracer is None or (not traceparent and name != "dead_letter"):
        return
    from opentelemetry.trace import Status, StatusCode

    sp = tracer.start_span(f"reconcile {name}", context=_parent(traceparent), start_time=start_ns,
                           attributes={"omniflow.decision": name,
                                       **{f"omniflow.{k}": v for k, v in attributes.items() if v is not None}})
    if error:
        sp.set_status(Status(StatusCode.ERROR, error))
    sp.end()


def aborted(wf_id: str, *, traceparent: str, reason: str) -> None:
    """A client's abort of workflow `wf_id` as an `abort` span of the workflow's trace, linked to
    the span that asked for it (the abort request's, in a trace of its own)."""
    if tracer is None or not traceparent:
        return
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode

    current = trace.get_current_span()
    asked = current.get_span_context()
    if asked.is_valid:
        current.set_attribute("omniflow.workflow.id", wf_id)
    sp = tracer.start_span("abort", context=_parent(traceparent), links=[trace.Link(asked)] if asked.is_valid else None,
                           attributes={"omniflow.workflow.id": wf_id, "omniflow.reason": reason})
    sp.set_status(Status(StatusCode.ERROR, reason))
    sp.end()


# ---------------------------------------------------------------- stage sessions
def session_span(*, wf_id: str, stage: str, attempt: int, worker: str, pool: str, traceparent: str,
                 tracestate: str = "") -> Span | None:
    """The span of one stage session (ended by `end_session`); None while tracing is off."""
    if tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return tracer.start_span(f"session {stage}", context=_parent(traceparent, tracestate), kind=SpanKind.CONSUMER,
                             attributes={"omniflow.workflow.id": wf_id, "omniflow.stage": stage,
                                         "omniflow.attempt": attempt, "omniflow.worker.id": worker,
                                         "omniflow.pool": pool})


def chunk_event(sp: Span, direction: str, peer: str, seq: int, nbytes: int | None = None) -> None:
    """One chunk hop as an event of its session's span: `out` to stage `peer`, or `in` from it."""
    attrs: dict[str, Any] = {"omniflow.peer": peer, "omniflow.seq": seq}
    if nbytes is not None:
        attrs["omniflow.bytes"] = nbytes
    sp.add_event(f"chunk.{direction}", attrs)


def end_session(sp: Span, *, outcome: str, detail: str, code: str | None, steps: int,
                usage: Mapping[str, Any] | None) -> None:
    """End a session's span with what it did: outcome, steps emitted, tokens and audio it reported."""
    from opentelemetry.trace import Status, StatusCode

    attrs: dict[str, Any] = {"omniflow.outcome": outcome if code in ("ok", None) else f"{outcome}:{code}",
                             "omniflow.steps": steps}
    for key, value in (usage or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            attrs[f"omniflow.usage.{key}"] = value
    sp.set_attributes(attrs)
    if outcome != "done":
        sp.set_status(Status(StatusCode.ERROR, detail[:200]))
    sp.end()


def now_ns() -> int:
    return time.time_ns()


# ---------------------------------------------------------------- HTTP and WebSocket entry points
class TraceMiddleware:
    """ASGI middleware (installed only while tracing is on): every HTTP request and WebSocket
    connection but the machines' paths (`UNTRACED_PATHS`) runs in a SERVER span that continues
    the caller's `traceparent`/`tracestate`. A malformed header is ignored (W3C): a new trace
    starts, and the request is served as if it had none."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if tracer is None or scope["type"] not in ("http", "websocket") or scope["path"].startswith(UNTRACED_PATHS):
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        for raw_name, raw_value in scope.get("headers") or ():
            name = raw_name.decode("latin-1").lower()
            if name in ("traceparent", "tracestate"):
                carrier[name] = raw_value.decode("latin-1")
        try:
            parent = TraceContextTextMapPropagator().extract(carrier) if carrier else None
        except Exception:  # noqa: BLE001 - a header we cannot read is no header (W3C): a new trace
            parent = None
        method = scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET"
        status: list[int] = []

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(int(message["status"]))
            await send(message)

        with tracer.start_as_current_span(f"{method} {scope['path']}", context=parent, kind=SpanKind.SERVER,
                                          attributes={"http.request.method": method, "url.path": scope["path"]},
                                          record_exception=True) as sp:
            try:
                await self.app(scope, receive, send_status)
            finally:
                route = scope.get("route")
                template = getattr(route, "path", None)
                if template:
                    sp.update_name(f"{method} {template}")
                    sp.set_attribute("http.route", template)
                if status:
                    sp.set_attribute("http.response.status_code", status[0])
                    if status[0] >= 500:
                        sp.set_status(Status(StatusCode.ERROR))
