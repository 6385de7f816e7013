"""SIGTERM drains instead of dropping: a decode worker or the gateway told to stop mid-stream takes nothing new,
lets the stream it serves finish with every token it would have had, then exits 0 (a rolling restart loses no
request); meanwhile new requests go to the other decode worker, or get the gateway's 503 `draining`."""
from __future__ import annotations

import signal
import time

import pytest

from tools.client import DONE, open_stream
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack
from tests.integration.conftest import assert_no_leaks, get_json, list_workers, post_json

BODY = {"prompt": "Tell me a long story about a river city and the people who live by it.", "max_tokens": 600,
        "temperature": 0, "ignore_eos": True, "transfer_mode": "full"}


@pytest.fixture
def two_decoders(tiny_model_path, tmp_path):
    spec = StackSpec(model=str(tiny_model_path), num_decode=2, gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_WORKER_TTL_S": "2"})
    with started_stack(spec, 120, may_die={"decode-0", "decode-1", "gateway"}) as stack:
        yield stack


def stream_tokens(url: str, body: dict, on_token=None) -> tuple[list[int], str]:
    """The streamed completion's token ids (from its final `smartgen` object) and finish_reason; `on_token(i)` is
    called as each chunk arrives."""
    final, reason, count = None, None, 0
    with open_stream(url + "/v1/completions", body, timeout=120) as events:
        for payload in events:
            if payload is DONE:
                break
            assert "error" not in payload, payload["error"]
            if payload["choices"]:
                count += 1
                reason = payload["choices"][0].get("finish_reason") or reason
                if on_token:
                    on_token(count)
            final = payload.get("smartgen", final)
    assert final is not None
    return final["token_ids"], reason


def test_a_decode_worker_told_to_stop_finishes_its_stream_and_the_other_takes_new_requests(two_decoders):
    stack = two_decoders
    url = stack.gateway_url
    _, reference = post_json(url + "/v1/completions", BODY | {"transfer_mode": "colocated"})
    serving: dict[str, str] = {}

    def on_token(i: int) -> None:
        if i == 30 and not serving:  # mid-stream: SIGTERM the decode worker serving this request
            busy = [w for w in list_workers(url, stack.admin_token)
                    if w["role"] == "decode" and get_json(w["admin_url"] + "/stats")["active_requests"]]
            assert len(busy) == 1
            name = next(n for n, p in stack.processes.items() if p.pid == busy[0]["pid"])
            serving["name"], serving["id"] = name, busy[0]["id"]
            stack.processes[name].send_signal(signal.SIGTERM)

    tokens, reason = stream_tokens(url, BODY | {"stream": True}, on_token)
    assert serving, "the stream ended before the worker could be told to stop"
    assert reason == "length" and tokens == reference["smartgen"]["token_ids"]  # every token, the same ones
    assert stack.processes[serving["name"]].wait(30) == 0  # then it stopped cleanly
    deadline = time.monotonic() + 10
    while serving["id"] in {w["id"] for w in list_workers(url, stack.admin_token)}:  # its last heartbeat has expired
        assert time.monotonic() < deadline, "the gateway still lists the stopped decode worker"
        time.sleep(0.1)
    status, body = post_json(url + "/v1/completions", {**BODY, "max_tokens": 4})
    assert status == 200 and body["smartgen"]["decode_worker_id"] != serving["id"]
    assert_no_leaks(stack)


def test_the_gateway_told_to_stop_finishes_its_stream_and_refuses_new_ones(two_decoders):
    stack = two_decoders
    url = stack.gateway_url
    _, reference = post_json(url + "/v1/completions", BODY | {"transfer_mode": "colocated"})
    refused: list[tuple[int, dict]] = []

    def on_token(i: int) -> None:
        if i == 30:
            stack.processes["gateway"].send_signal(signal.SIGTERM)
        if i == 60:  # while it drains: a new request gets 503 `draining`, with when to retry
            refused.append(post_json(url + "/v1/completions", {**BODY, "max_tokens": 4}))

    tokens, reason = stream_tokens(url, BODY | {"stream": True}, on_token)
    assert reason == "length" and tokens == reference["smartgen"]["token_ids"]
    assert refused and refused[0][0] == 503 and refused[0][1]["error"]["code"] == "draining"
    assert stack.processes["gateway"].wait(30) == 0
