"""Request traces with OpenTelemetry, off unless configured (torch-free: the router uses it too).

Contract:
- `setup(service, endpoint)` installs a TracerProvider with a batching OTLP/HTTP exporter when
  `endpoint` (`--otlp-endpoint`) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_ENDPOINT`
  is set, unless `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. The other standard OTEL_*
  variables (service name, resource attributes, sampler, batch delays, headers) keep their meaning.
  Returns whether tracing is on. Each process calls it once (a service's frontend and worker both).
- Off, `enabled()` is False and neither the SDK nor the exporter is imported (only the API package,
  made to be imported unconditionally: without an SDK its calls do nothing): call sites test
  `enabled()` (or a request's `ReqTrace`, which is None when off) before doing any tracing work.
- Context crosses processes as a W3C `traceparent` string: the router sends it as an HTTP header, a
  service frontend puts its own span's into `GenerateReq.traceparent` for its worker.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_ENV_ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

_tracer: Any = None  # opentelemetry.trace.Tracer once set up
_provider: Any = None


def configured(endpoint: str = "") -> bool:
    """Would `setup` turn tracing on with this flag value and the environment?"""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return bool(endpoint) or any(os.environ.get(k) for k in _ENV_ENDPOINTS)


def traces_url(endpoint: str) -> str:
    """`--otlp-endpoint` as the exporter's URL: a bare http://host:port gets OTLP/HTTP's /v1/traces."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-endpoint must look like http://host:4318, got {endpoint!r}")
    return endpoint.rstrip("/") + "/v1/traces" if parts.path in ("", "/") else endpoint


def setup(service: str, endpoint: str = "") -> bool:
    """Turn tracing on for this process when configured (see the module docstring)."""
    global _tracer, _provider
    if _tracer is not None or not configured(endpoint):
        return _tracer is not None
    # the SDK and the exporter load only when tracing is on (tests/unit/test_tracing.py checks the router)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service}
    _provider = TracerProvider(resource=Resource.create({**attrs, "process.pid": os.getpid()}))
    exporter = OTLPSpanExporter(endpoint=traces_url(endpoint)) if endpoint else OTLPSpanExporter()
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    _tracer = _provider.get_tracer("pdserve")
    return True


def use_provider(provider: Any) -> None:
    """Trace into a TracerProvider of the caller's (tests: one with an in-memory exporter)."""
    global _tracer, _provider
    _provider, _tracer = provider, provider.get_tracer("pdserve")


def shutdown() -> None:
    """Export what is buffered and stop (a process calls this on its way out)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def _context(parent: Any) -> Any:
    """An OpenTelemetry Context from a Span, a traceparent string or None (a new trace)."""
    if parent is None or parent == "":
        return None
    if isinstance(parent, str):
        return TraceContextTextMapPropagator().extract({TRACEPARENT: parent})
    return trace.set_span_in_context(parent)


def start(name: str, parent: Any = None, attrs: dict | None = None, kind: str = "internal",
          start_ns: int | None = None) -> Any:
    """A started span (end it with `.end()`), child of `parent` (Span, traceparent or None); None
    when tracing is off. kind: internal | server | client."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_context(parent), kind=getattr(SpanKind, kind.upper()),
                              attributes=attrs, start_time=start_ns)


def traceparent(span: Any) -> str:
    """The W3C traceparent of `span` ("" for None or a span that is not sampled)."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def trace_id(tp: str) -> str:
    """The trace id (32 hex digits) inside a traceparent, "" when there is none."""
    parts = tp.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


def fail(span: Any, message: str) -> None:
    """Mark `span` failed with `message` (no-op for None)."""
    if span is not None:
        span.set_status(Status(StatusCode.ERROR, message[:500]))
