"""A stack of real processes (embedded nats-server + five services) on the tiny model, shared by the
integration tests, and a leak check after every test that uses it."""
from __future__ import annotations

from pathlib import Path

import pytest

from tools.client import get_json, list_workers, open_stream, post_json  # noqa: F401 (tests import these from here)
from tools.leaks import find_leaks
from tools.nats_server import free_port
from tools.stack import Stack, StackSpec, started_stack


# The bare budget, no floor (schemas/constants.py BudgetFloor): these stacks test the sparse mechanics (remote
# reads, selections, transfer) on prompts far shorter than the floor's dense threshold of 1,024 tokens
NO_FLOOR_ENV = {"SMARTGEN_SELECTIVE_MIN_TOKENS": "0", "SMARTGEN_MIN_BUDGET_TOKENS": "1", "SMARTGEN_SINK_TOKENS": "0",
                "SMARTGEN_RECENT_TOKENS": "0", "SMARTGEN_SELECTION_STICK": "0"}


def post_sse(url: str, body: dict, timeout: float = 120.0) -> list[dict]:
    """POST with stream=true; returns the parsed `data:` chunks, checking the stream ends with [DONE]."""
    chunks, done = [], False
    with open_stream(url, body, timeout) as events:
        assert events.headers["Content-Type"].startswith("text/event-stream")
        for item in events:
            if item == "[DONE]":
                done = True
                continue
            chunks.append(item)
    assert not events.other_lines, events.other_lines[0]  # every line a `data:` line
    assert done, "the stream did not end with data: [DONE]"
    return chunks


def model_workers(stack: Stack) -> list[dict]:
    return [w for w in list_workers(stack.gateway_url, stack.admin_token) if w["role"] in ("prefill", "decode")]


def assert_no_leaks(stack: Stack, timeout_s: float = 10.0) -> None:
    """Every prefill and decode worker holds no request, no page, no lease and no ticket; the broker holds no
    open transfer plan (tools/leaks.py)."""
    leaks = find_leaks(stack.gateway_url, timeout_s, stack.admin_token)
    if leaks:
        pytest.fail(f"leak check: workers still hold request state: {leaks}")


SPANS_FILE = "spans.jsonl"  # the shared stack's tracing file: set, with tracing off (test_tracing.py)


@pytest.fixture(scope="session")
def stack(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    """The whole system on the tiny model: NATS, gateway, broker, kvprofile, 1 prefill, 1 decode."""
    log_file = tmp_path_factory.mktemp("logs") / "stack.log"
    # NOTE: fp32 KV here, since these tests hold tokens against plain transformers (whose cache is fp32); the
    # default 16-bit KV runs in test_smartgen.py, test_faults.py and the CLI tests
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=log_file,
                     env={"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_KV_DTYPE": "float32",
                          **NO_FLOOR_ENV, "SMARTGEN_TRACING_FILE": str(log_file.parent / SPANS_FILE)})
    with started_stack(spec, 180) as running:
        yield running


@pytest.fixture
def clean_stack(stack: Stack):
    """The shared stack, checked for leaks after the test."""
    yield stack
    assert not stack.dead(), f"services died: {stack.dead()}"
    assert_no_leaks(stack)
