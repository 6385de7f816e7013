"""Tracing through the real stack (five processes, the tiny model): with SMARTGEN_TRACING on, one trace per request
covers the gateway, broker, prefill and decode, linked by the context in NATS headers; with it off, no span file."""
from __future__ import annotations

from pathlib import Path

from shared.runtime.span_file import read_spans
from tests.integration.conftest import NO_FLOOR_ENV, SPANS_FILE, assert_no_leaks, post_json
from tools.nats_server import free_port
from tools.stack import Stack, StackSpec, started_stack

PROMPT = "The river city grew from a small settlement where traders met. " * 6
ROOT = "POST /v1/completions"
# what every disaggregated request's trace holds: the gateway's span and each handler's on the way
EXPECTED = {("gateway", ROOT), ("decode", "decode.open"), ("broker", "broker.open"), ("prefill", "prefill.prefill"),
            ("decode", "decode.generate"), ("decode", "decode.generation"), ("prefill", "prefill.pushes")}


def spec(tmp_path: Path, tiny_model_path: Path, **env: str) -> StackSpec:
    return StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1", **NO_FLOOR_ENV, **env})


def complete(stack: Stack, mode: str) -> str:
    """One completion in `mode`; its request id."""
    status, body = post_json(stack.gateway_url + "/v1/completions",
                             {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "transfer_mode": mode})
    assert status == 200, body
    return body["id"]


def test_one_trace_per_request_spans_every_service(tiny_model_path, tmp_path):
    """A smartgen and a full request: each has one trace, rooted at the gateway's span for it, holding the
    handlers' spans of broker, prefill and decode (service.name = role); every other span's parent is in the same
    trace, and no span of one request is in the other's trace."""
    spans_file = tmp_path / "spans.jsonl"
    with started_stack(spec(tmp_path, tiny_model_path, SMARTGEN_TRACING="true",
                            SMARTGEN_TRACING_FILE=str(spans_file)), 180) as stack:
        request_ids = {mode: complete(stack, mode) for mode in ("smartgen", "full")}
        assert_no_leaks(stack)  # every request's work has ended, so have its spans
    spans = read_spans(spans_file)
    trace_ids = set()
    for mode, request_id in request_ids.items():
        (root,) = [s for s in spans if s["name"] == ROOT and s["attributes"]["smartgen.request_id"] == request_id]
        assert root["parent_id"] is None and root["attributes"]["smartgen.transfer_mode"] == mode
        assert root["attributes"]["smartgen.prompt_tokens"] > 0
        trace_id = root["context"]["trace_id"]
        trace = [s for s in spans if s["context"]["trace_id"] == trace_id]
        found = {(s["resource"]["attributes"]["service.name"], s["name"]) for s in trace}
        assert EXPECTED <= found, f"{mode}: missing {EXPECTED - found}"
        span_ids = {s["context"]["span_id"] for s in trace}
        assert [s for s in trace if s["parent_id"] is None] == [root]
        assert all(s["parent_id"] in span_ids for s in trace if s is not root), f"{mode}: a parent outside the trace"
        assert {s["attributes"].get("smartgen.request_id", request_id) for s in trace} == {request_id}
        trace_ids.add(trace_id)
    assert len(trace_ids) == 2


def test_with_tracing_off_no_span_is_written(clean_stack):
    """SMARTGEN_TRACING_FILE set but tracing off (the default), on the shared stack: a request is served and no file
    appears (nor did one for any request the tests before this one sent it)."""
    complete(clean_stack, "smartgen")
    assert not (Path(clean_stack.spec.log_file).parent / SPANS_FILE).exists()
