"""API fuzzing with schemathesis against the live gateway's own /openapi.json, on the tiny-model stack:
bodies that fit the schema and bodies that do not, for every operation. No 5xx, only documented status codes,
content types, headers and bodies, every body outside the schema refused, and no leak afterwards."""
from __future__ import annotations

from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

EXAMPLES_PER_MODE = 50  # per operation: the POST routes run real completions, a few hundred ms each
MAX_FUZZ_TOKENS = 8  # completions the fuzzer asks for are cut to this many tokens (see keep_short)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]
FUZZ = settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def keep_short(case: schemathesis.Case, max_positions: int) -> None:
    """Cut a valid max_tokens (or a missing one) to MAX_FUZZ_TOKENS: the schema rightly allows the whole context,
    but a thousand decode steps per example would make the run minutes long. Invalid values stay as generated,
    so a body outside the schema stays outside it."""
    body = case.body
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_FUZZ_TOKENS < value < max_positions:
            body[name] = MAX_FUZZ_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_FUZZ_TOKENS


def fuzz(operation, mode: GenerationMode, base_url: str, session: requests.Session, max_positions: int,
         statuses: Counter) -> None:
    @FUZZ
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        keep_short(case, max_positions)
        response = case.call_and_validate(base_url=base_url, session=session, checks=CHECKS, timeout=60)
        statuses[(operation.label, mode.value, response.status_code)] += 1

    run()


def test_gateway_survives_schemathesis(clean_stack):
    """Every operation of /openapi.json, fuzzed with valid and invalid data: schemathesis's checks pass (no 5xx,
    documented status codes, content types, Retry-After headers and bodies; invalid bodies get 4xx), the POST
    routes complete at least one valid request, and the leak check passes afterwards (clean_stack)."""
    base_url = clean_stack.gateway_url
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    max_positions = requests.get(base_url + "/v1/models", timeout=5).json()["data"][0]["max_model_len"]
    statuses: Counter = Counter()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            fuzz(operation, GenerationMode.POSITIVE, base_url, session, max_positions, statuses)
            if operation.body:  # the GET routes take nothing that could be invalid
                fuzz(operation, GenerationMode.NEGATIVE, base_url, session, max_positions, statuses)
    print("schemathesis cases by (operation, mode, status):", dict(sorted(statuses.items())))
    for route in ("POST /v1/completions", "POST /v1/chat/completions"):
        assert statuses[(route, "positive", 200)] >= 1, statuses
        assert sum(n for (label, mode, _), n in statuses.items() if (label, mode) == (route, "negative")) >= 10
    assert not [key for key in statuses if key[2] >= 500], statuses


@pytest.mark.parametrize("body, content_type, status", [
    (b"[" * 100_000, "application/json", 400),  # nested deeper than json.loads goes: RecursionError
    (b'{"prompt": "x", "max_tokens": 2}', "application/json; charset=no-such-charset", 200),  # LookupError
    (b'{"prompt": "\\ud800 lone surrogate"}', "application/json", 400),  # the tokenizer's TypeError
    (b'{"prompt": "x", "seed": 100000000000000000000000}', "application/json", 400),  # msgpack's OverflowError
    (b'{"prompt": "x", "selector": "quest", "kv_budget": 1' + b"0" * 400 + b"}", "application/json", 400),  # float()
])
def test_bodies_that_were_500s_are_answered(clean_stack, body, content_type, status):
    """Bodies that used to end in a 500 (an exception past the validation) get a 400, or a 200 where the body is
    good JSON under a made-up charset (JSON is UTF-8)."""
    response = requests.post(clean_stack.gateway_url + "/v1/completions", data=body,
                             headers={"Content-Type": content_type}, timeout=30)
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["type"] == "invalid_request_error"
