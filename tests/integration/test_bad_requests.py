"""Requests the API cannot take get a 400 (or 404) with an OpenAI-style error and touch no worker."""
from __future__ import annotations

import pytest

from tests.integration.conftest import get_json, model_workers, post_json

GOOD = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}


def worker_request_counts(stack) -> dict[str, str]:
    """Each model worker's request counter lines: unchanged if no worker was touched."""
    import urllib.request

    counts = {}
    for w in model_workers(stack):
        text = urllib.request.urlopen(w["admin_url"] + "/metrics").read().decode()
        counts[w["id"]] = [line for line in text.splitlines() if line.startswith("smartgen_requests_total")]
    return counts


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    ([1, 2], None),
    ({"max_tokens": 4}, "prompt"),
    ({**GOOD, "prompt": ""}, "prompt"),
    ({**GOOD, "prompt": [-5, 3]}, "prompt"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": "many"}, "max_tokens"),
    ({**GOOD, "max_tokens": 10**6}, "max_tokens"),
    ({**GOOD, "temperature": -1}, "temperature"),
    ({**GOOD, "stop": [1, 2]}, "stop"),
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "n": 2, "stream": True, "echo": True}, "echo"),
    ({**GOOD, "frobnicate": 1}, "frobnicate"),  # an unknown field is refused, never ignored
    ({**GOOD, "suffix": "after"}, "suffix"),
    ({**GOOD, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
    ({**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tools"),
    ({**GOOD, "transfer_mode": "teleport"}, "transfer_mode"),
    ({**GOOD, "transfer_mode": "quantized", "kv_bits": 3}, "kv_bits"),
    ({**GOOD, "transfer_mode": "full", "kv_bits": 2}, "kv_bits"),  # bits are for quantized only
    ({**GOOD, "transfer_mode": "quantized", "selector": "quest"}, "selector"),  # quantized decodes densely
    ({**GOOD, "transfer_mode": "smartgen", "ablate": ["teleport"]}, "ablate"),
    ({**GOOD, "transfer_mode": "full", "ablate": ["background"]}, "ablate"),  # ablation is of smartgen's paths
    ({**GOOD, "selector": "magic"}, "selector"),
    ({**GOOD, "kv_budget": 1.5}, "kv_budget"),
    ({**GOOD, "kv_budget": 0.1}, "kv_budget"),  # a budget needs a selector
    ({**GOOD, "prompt": "word " * 5000}, "prompt"),
])
def test_bad_completion_is_400(clean_stack, body, param):
    """Each malformed body: 400, an OpenAI error object naming the parameter, and no worker touched."""
    before = worker_request_counts(clean_stack)
    status, reply = post_json(clean_stack.gateway_url + "/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]
    assert reply["error"]["param"] == param
    assert worker_request_counts(clean_stack) == before


def test_unknown_values_name_the_valid_ones(clean_stack):
    """An unknown transfer_mode or selector gets a message that lists what is valid."""
    _, reply = post_json(clean_stack.gateway_url + "/v1/completions", {**GOOD, "transfer_mode": "teleport"})
    assert "colocated" in reply["error"]["message"] and "full" in reply["error"]["message"]
    _, reply = post_json(clean_stack.gateway_url + "/v1/completions", {**GOOD, "selector": "magic"})
    assert "oracle" in reply["error"]["message"] and "quest" in reply["error"]["message"]


def test_bad_chat_messages_are_400(clean_stack):
    """Chat without messages, or with a malformed message, is refused."""
    for body in ({"max_tokens": 3}, {"messages": []}, {"messages": [{"role": "wizard", "content": "x"}]},
                 {"messages": [{"role": "user"}]}):
        status, reply = post_json(clean_stack.gateway_url + "/v1/chat/completions", body)
        assert status == 400 and reply["error"]["param"] == "messages", (body, reply)


def test_unknown_model_is_404(clean_stack):
    """Asking for a model this server does not serve is OpenAI's 404 model_not_found."""
    status, reply = post_json(clean_stack.gateway_url + "/v1/completions", {**GOOD, "model": "gpt-9"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"


def test_context_limit_counts_max_tokens(clean_stack, tiny_model_path):
    """prompt + max_tokens beyond the context window is refused before any work starts."""
    max_len = get_json(clean_stack.gateway_url + "/v1/models")["data"][0]["max_model_len"]
    status, reply = post_json(clean_stack.gateway_url + "/v1/completions",
                              {"prompt": [5] * (max_len - 2), "max_tokens": 3})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    status, _ = post_json(clean_stack.gateway_url + "/v1/completions",
                          {"prompt": [5] * (max_len - 2), "max_tokens": 2, "temperature": 0}, timeout=300)
    assert status == 200
