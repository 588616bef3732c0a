"""OpenTelemetry tracing, configured by the standard ``OTEL_*`` variables.

Off unless ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``) or
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set; ``file`` writes spans as JSON lines to
``SLOGATE_TRACE_FILE`` (what the tests use to see spans from several processes). When off,
every helper here returns before touching the OpenTelemetry API, so tracing costs nothing.
Every exporter gets its spans in batches, on the processor's own thread (a file's within
0.1 s, all of them at shutdown): written as each span ended, on the event loop, a file's held
up the requests they traced (in four alternating pairs of the serving-path benchmark on a
noisy 2-core host, the traced 16-stream TTFT P99 was 25-58 ms that way, 15-51 ms batched).

The trace context travels inside the queued message (W3C ``traceparent``), so a worker's
spans join the gateway's trace.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ContextManager

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None


def enabled() -> bool:
    return _tracer is not None


def setup(service_name: str, env: dict[str, str] | None = None) -> bool:
    """Install a tracer provider if the environment asks for one; True when tracing is on."""
    global _tracer
    env = dict(os.environ if env is None else env)
    exporter_name = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not exporter_name and (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        exporter_name = "otlp"
    if exporter_name in ("", "none"):
        _tracer = None
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", service_name)}))
    if exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        name = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
        if name not in env:
            name = "OTEL_EXPORTER_OTLP_PROTOCOL"
        protocol = env.get(name, "http/protobuf").strip().lower()
        if protocol != "http/protobuf":
            raise ValueError(f"{name}={protocol!r}: spans are exported over OTLP/HTTP only "
                             "(http/protobuf, a collector's port 4318)")

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter_name in ("console", "file"):
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        path = env.get("SLOGATE_TRACE_FILE")
        out = open(path, "a", buffering=1) if exporter_name == "file" and path else None  # noqa: SIM115
        exporter = ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n") if out \
            else ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: use otlp, console, file or none")
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("slogate")
    return True


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    if _tracer is not None and hasattr(provider, "shutdown"):
        provider.shutdown()


OFF = contextlib.nullcontext()
"""The context a span helper returns when tracing is off."""


def span(name: str, kind: SpanKind = SpanKind.INTERNAL, **attributes: Any) -> ContextManager[Span | None]:
    """A child of the current span; when tracing is off, one shared do-nothing context."""
    if _tracer is None:
        return OFF
    return _tracer.start_as_current_span(name, kind=kind, attributes=attributes)


def set_http_status(span: Span | None, status: int) -> None:
    """The answer's status on a server span, an error from 500 up (OpenTelemetry's rule for
    servers: a 4xx is the client's), so that 429s, 499s and 504s can be searched for."""
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(StatusCode.ERROR)


def set_stream_error(span: Span | None, status: int, code: str | None) -> None:
    """A failure a stream told in an error event, its 200 already sent: the span says it as the
    status would have (an error from 500 up), with the error's code, so that a stream that failed
    is not searched for as a success."""
    if span is None:
        return
    span.set_attribute("error.type", code or str(status))
    if status >= 500:
        span.set_status(StatusCode.ERROR, code)


def inject() -> dict[str, str]:
    """The current trace context, to carry inside a queued message."""
    if _tracer is None:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


def record(name: str, carrier: dict[str, str], start_s: float, end_s: float, **attributes: Any) -> None:
    """A finished span with explicit times, under the trace of ``carrier`` (a worker reports
    queue wait, prefill and decode this way once a request settles)."""
    if _tracer is None or not carrier:
        return
    parent = _propagator.extract(carrier)
    s = _tracer.start_span(name, context=parent, start_time=int(start_s * 1e9), attributes=attributes)
    s.end(end_time=int(max(end_s, start_s) * 1e9))


def current_trace_id() -> str | None:
    if _tracer is None:
        return None
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None

