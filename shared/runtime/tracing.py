"""Optional OpenTelemetry tracing: one trace per request, across gateway, broker, prefill and decode.

The gateway opens a request's root span (`request_span`); every NATS request and publish made while it is current
carries the W3C `traceparent` in the message's headers (`headers`, used by shared/runtime/rpc.py's `call` and
`publish`); the handler on the other side continues the trace in a span named after the subject's role and verb,
`decode.open`, `prefill.prefill`, … (`handling`, used by rpc.py's `endpoint` and `subscriber`). The context lives
in contextvars, so the tasks a handler starts inherit it; work that outlives its handler (decode's generation,
the prefill's pushes after token 1) runs in a child span of its own (`in_span`).

Off by default (`tracing`, SMARTGEN_TRACING). Spans go to `tracing_file` (JSON lines, one span a line) and, when
`opentelemetry-exporter-otlp-proto-http` is installed and OTEL_EXPORTER_OTLP_ENDPOINT (or
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, to that OTLP collector. A message without a `traceparent` starts no
span: the gateway decides which requests are traced. With tracing off every hook is one `if`.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import structlog
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

T = TypeVar("T")
TRACEPARENT = "traceparent"
OTLP_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROPAGATOR = TraceContextTextMapPropagator()  # W3C trace context: `traceparent` (and `tracestate`)
TRACER: trace.Tracer | None = None  # set by `setup` when tracing is on; None = every hook below returns at once
_NO_SPAN = contextlib.nullcontext()
_provider: Any = None  # the SDK's TracerProvider, for `shutdown`
log = structlog.get_logger()


def setup(role: str, worker_id: str, enabled: bool, file: str) -> None:
    """Turn tracing on for this process when `enabled`: spans named for `role` (the resource's service.name) go to
    `file` ("" = none) and to an OTLP collector where one is configured and its exporter installed."""
    global TRACER, _provider
    if not enabled:
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    from shared.runtime.span_file import JsonLinesExporter

    _provider = TracerProvider(resource=Resource.create({"service.name": role, "service.instance.id": worker_id}))
    if file:  # NOTE: written as each span ends (a line per span), so a process that is killed loses none
        _provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(file)))
    if otlp_endpoint():
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("tracing_otlp_unavailable", fix="pip install opentelemetry-exporter-otlp-proto-http, or unset "
                                                        "OTEL_EXPORTER_OTLP_ENDPOINT")
        else:
            _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    TRACER = _provider.get_tracer("smartgen")
    log.info("tracing_on", file=file, otlp_endpoint=otlp_endpoint())


def shutdown() -> None:
    """Flush and close the exporters (on the way out of the process)."""
    global TRACER, _provider
    if _provider is not None:
        _provider.shutdown()
    TRACER = _provider = None


def otlp_endpoint() -> str:
    return next((os.environ[name] for name in OTLP_ENDPOINT_ENVS if os.environ.get(name)), "")


def has_otlp_exporter() -> bool:
    """Whether opentelemetry-exporter-otlp-proto-http is installed (optional: not a SmartGen dependency)."""
    import importlib.util

    try:
        return importlib.util.find_spec("opentelemetry.exporter.otlp.proto.http") is not None
    except ModuleNotFoundError:  # a parent package missing
        return False


def headers() -> dict[str, str] | None:
    """The NATS headers that carry the current span's context to the handler of a message sent now (None when
    tracing is off or no span is current)."""
    if TRACER is None:
        return None
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier)
    return carrier or None


def handling(msg: Any, request_id: str | None = None) -> contextlib.AbstractContextManager:
    """The span of a handler answering `msg` (a nats Msg or nats.micro Request: its `subject` and `headers`) if it
    carries a trace context; no span for a message that carries none (or when tracing is off)."""
    if TRACER is None or not msg.headers or TRACEPARENT not in msg.headers:
        return _NO_SPAN
    attributes = {"messaging.destination.name": msg.subject, **({"smartgen.request_id": request_id} if request_id else {})}
    return TRACER.start_as_current_span(span_name(msg.subject), context=PROPAGATOR.extract(msg.headers),
                                        kind=trace.SpanKind.SERVER, attributes=attributes)


@contextlib.contextmanager
def request_span(name: str, http_headers: Mapping[str, str], **attributes: Any) -> Iterator[trace.Span | None]:
    """The gateway's span of one HTTP request: a trace's root, or the child of the client's own `traceparent`.
    Yields the span (None when tracing is off) so that what is learnt later can be added as attributes."""
    if TRACER is None:
        yield None
        return
    parent = PROPAGATOR.extract({TRACEPARENT: http_headers[TRACEPARENT]}) if TRACEPARENT in http_headers else None
    with TRACER.start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER,
                                      attributes={f"smartgen.{k}": v for k, v in attributes.items()}) as span:
        yield span


def annotate(**attributes: Any) -> None:
    """Add `smartgen.<name>` attributes to the current span (what is learnt after it started)."""
    if TRACER is None:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({f"smartgen.{k}": v for k, v in attributes.items()})


def in_span(name: str, work: Awaitable[T]) -> Awaitable[T]:
    """`work` (a coroutine a task will run) inside a child span `name` of the current span, if any."""
    if TRACER is None or not trace.get_current_span().get_span_context().is_valid:
        return work
    return _traced(name, work)


async def _traced(name: str, work: Awaitable[T]) -> T:
    assert TRACER is not None
    with TRACER.start_as_current_span(name):
        return await work


def span_name(subject: str) -> str:
    """"decode.open" for smartgen[.<namespace>].decode.<worker_id>.open; the subject less its prefix otherwise."""
    from schemas import subjects

    tokens: Sequence[str] = subject.removeprefix(subjects.PREFIX + ".").split(".")
    return f"{tokens[0]}.{tokens[2]}" if len(tokens) == 3 else ".".join(tokens)
