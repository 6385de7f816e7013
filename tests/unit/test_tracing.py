"""shared/runtime/tracing.py with rpc.py over a real nats-server: a request's trace context goes out in the NATS
headers of `call` and `publish` and comes back as the parent of the handler's span; no trace context, no span;
tracing off, no span, no file, no header."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import nats
import pytest
from nats.micro import add_service
from nats.micro.service import ServiceConfig as MicroConfig

from schemas import Ack, subjects
from shared.runtime import tracing
from shared.runtime.config import ConfigError, ServiceConfig
from shared.runtime.rpc import call, endpoint, publish, subscriber
from shared.runtime.span_file import read_spans

OPEN = subjects.worker("decode", "decode-1", "open")
EVENT = subjects.worker("broker", "broker-1", "event")


@dataclass(frozen=True, slots=True)
class Hello:
    request_id: str


@pytest.fixture
def traced(tmp_path):
    """Tracing on in this process, to a file; off again afterwards."""
    path = tmp_path / "spans.jsonl"
    tracing.setup("gateway", "gateway-1", True, str(path))
    yield path
    tracing.shutdown()


async def serve(nc, seen: list[dict | None]) -> tuple:
    """decode.open answers and, while handling, publishes broker.event; `seen` gets the headers each received."""
    events = asyncio.Queue()

    async def on_event(message: Hello) -> None:
        await events.put(message)

    async def on_open(message: Hello) -> Ack:
        await publish(nc, EVENT, message)
        return Ack()

    async def recording(msg) -> None:
        seen.append(msg.headers)
        await subscriber(Hello, on_event)(msg)

    service = await add_service(nc, MicroConfig(name="tracing-test", version="0.0.1"))
    await service.add_endpoint(name="open", subject=OPEN, handler=endpoint(Hello, on_open))
    await nc.subscribe(EVENT, cb=recording)
    return service, events


async def test_the_trace_context_travels_in_nats_headers_and_parents_the_handlers_spans(nats_server, traced):
    """Under a request span, `call` → the endpoint's span `decode.open` and, from its handler, `publish` → the
    subscriber's span `broker.event`: one trace, each span the child of the one that sent its message."""
    nc = await nats.connect(**nats_server.connect_options())
    seen: list[dict | None] = []
    service, events = await serve(nc, seen)
    try:
        with tracing.request_span("POST /v1/completions", {}, request_id="r1") as root:
            assert await call(nc, OPEN, Hello("r1"), Ack, 5.0) == Ack()
        await asyncio.wait_for(events.get(), 5.0)
    finally:
        await service.stop()
        await nc.close()
    spans = {span["name"]: span for span in read_spans(traced)}
    assert set(spans) == {"POST /v1/completions", "decode.open", "broker.event"}
    trace_id = f"0x{root.get_span_context().trace_id:032x}"
    assert {span["context"]["trace_id"] for span in spans.values()} == {trace_id}
    assert spans["POST /v1/completions"]["parent_id"] is None
    assert spans["decode.open"]["parent_id"] == spans["POST /v1/completions"]["context"]["span_id"]
    assert spans["broker.event"]["parent_id"] == spans["decode.open"]["context"]["span_id"]
    assert spans["decode.open"]["attributes"]["smartgen.request_id"] == "r1"
    # the header broker.event arrived with names decode.open's span: version-trace_id-span_id-flags
    assert seen[0]["traceparent"].startswith(f"00-{trace_id[2:]}-{spans['decode.open']['context']['span_id'][2:]}-")
    assert spans["POST /v1/completions"]["resource"]["attributes"]["service.name"] == "gateway"


async def test_a_message_without_a_trace_context_starts_no_span(nats_server, traced):
    """Tracing on, but the call is made outside any span (a heartbeat, a tool): no header, no span anywhere."""
    nc = await nats.connect(**nats_server.connect_options())
    seen: list[dict | None] = []
    service, events = await serve(nc, seen)
    try:
        assert await call(nc, OPEN, Hello("r2"), Ack, 5.0) == Ack()
        await asyncio.wait_for(events.get(), 5.0)
    finally:
        await service.stop()
        await nc.close()
    assert not (seen[0] or {}).get("traceparent")
    assert read_spans(traced) == []


async def test_a_client_traceparent_on_the_http_request_is_the_root_spans_parent(traced):
    """A client that traces its own calls: the gateway's span joins the client's trace as a child."""
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.request_span("POST /v1/completions", {"traceparent": client}):
        pass
    (span,) = read_spans(traced)
    assert span["context"]["trace_id"] == "0x0af7651916cd43dd8448eb211c80319c"
    assert span["parent_id"] == "0xb7ad6b7169203331"


async def test_with_tracing_off_nothing_is_traced_or_written(tmp_path):
    """Off: no header, the handler span and the task span are no-ops (the coroutine itself), and no file."""
    path = tmp_path / "spans.jsonl"
    tracing.setup("decode", "decode-1", False, str(path))
    assert tracing.TRACER is None and tracing.headers() is None
    with tracing.request_span("POST /v1/completions", {}) as span:
        assert span is None and tracing.headers() is None
    traced_msg = SimpleNamespace(subject=OPEN, headers={"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    with tracing.handling(traced_msg, "r1") as span:
        assert span is None  # the no-op context
    work = asyncio.sleep(0)
    assert tracing.in_span("decode.generation", work) is work
    await work
    assert not path.exists()


def test_span_names_are_the_subjects_role_and_verb():
    """A worker subject's span is <role>.<verb>, whatever the worker id; other subjects lose only the prefix."""
    assert tracing.span_name(subjects.worker("prefill", "prefill-ab12", "prefill")) == "prefill.prefill"
    assert tracing.span_name(subjects.dataplane_connect("decode-1")) == "dataplane.connect"
    assert tracing.span_name(subjects.PROFILE_STATS) == "profile.stats"


def test_tracing_on_needs_somewhere_to_send_spans(monkeypatch, tmp_path):
    """A file, or an OTLP endpoint with its exporter installed; neither is a config error that says what to set."""
    for name in tracing.OTLP_ENDPOINT_ENVS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="SMARTGEN_TRACING_FILE"):
        ServiceConfig(tracing=True).validate()
    ServiceConfig(tracing=True, tracing_file=str(tmp_path / "spans.jsonl")).validate()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    monkeypatch.setattr("shared.runtime.config.has_otlp_exporter", lambda: False)
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-http"):
        ServiceConfig(tracing=True).validate()  # an endpoint, but nothing installed to send to it
    monkeypatch.setattr("shared.runtime.config.has_otlp_exporter", lambda: True)
    ServiceConfig(tracing=True).validate()
