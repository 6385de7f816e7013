"""The gateway's OpenAPI document against its validation: the same enums, every field described, and
bodies generated from the document (valid and invalid, by schemathesis) judged the same way by parse_job."""
from __future__ import annotations

import functools
import inspect
import re

import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from schemas import FAILURE_POLICIES, PUSH_KV_BITS, SMARTGEN_PATHS, TRANSFER_MODES
from services.gateway import requests as gateway_requests
from services.gateway.api import _error
from services.gateway.openapi import openapi_document
from services.gateway.requests import KV_BITS, SELECTORS, ApiError, parse_job, parse_jobs

MODEL, MAX_POSITIONS, VOCAB = "tiny", 64, 300
DOCUMENT = openapi_document(MODEL, MAX_POSITIONS, VOCAB)
SCHEMAS = DOCUMENT["components"]["schemas"]
BODIES = {"completion": "CompletionRequest", "chat": "ChatCompletionRequest"}
EXAMPLES = 100  # bodies per route and mode (schemathesis generates a few hundred per second)
# Constraints between fields that the schema states in words only: a valid body may still get a 400 for these.
CROSS_FIELD_PARAMS = {"prompt", "messages", "max_tokens", "max_completion_tokens", "kv_budget", "kv_bits", "selector",
                      "ablate", "stream_options",  # stream_options goes with stream: true
                      "top_logprobs", "echo",  # top_logprobs needs logprobs: true; echo is not for stream: true
                      "n",  # prompts × n has a cap
                      "min_tokens", "stop_token_ids",  # at most max_tokens; ids below the vocabulary's size
                      # structured output: a schema, regex or grammar llguidance can enforce, one constraint at a
                      # time; tool_choice with tools, and not 'auto'
                      "response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice",
                      "structured_outputs", "tools", "tool_choice", "parallel_tool_calls",
                      "continue_final_message"}  # with add_generation_prompt: false and an assistant message last


class FakeTokenizer:
    """One token per character; like the real (Rust) tokenizer it refuses text that is not valid Unicode."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        text.encode("utf-8")  # the real one raises TypeError on lone surrogates; this raises too
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def __len__(self) -> int:
        return VOCAB

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool, **_) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@functools.cache
def loaded() -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_dict(DOCUMENT)


def is_integral_float(value: object) -> bool:
    """5.0: an integer to JSON Schema, but parse_job wants JSON integers where the schema says integer."""
    return isinstance(value, float) and value.is_integer()


def parse(body: object, kind: str):
    jobs = parse_jobs(body, kind, FakeTokenizer(), MAX_POSITIONS, MODEL, "full", 16)
    return jobs[0] if len(jobs) == 1 else jobs


def test_enums_come_from_the_validation_constants():
    """transfer_mode, selector, kv_bits, ablate and failure_policy list exactly what parse_job accepts."""
    fields = SCHEMAS["CompletionRequest"]["properties"]
    assert fields["transfer_mode"]["enum"] == list(TRANSFER_MODES)
    assert fields["selector"]["enum"] == [*SELECTORS, None]
    assert fields["kv_bits"]["enum"] == [0, *sorted({*KV_BITS, *PUSH_KV_BITS}), None]  # 0: smartgen's exact KV
    assert fields["ablate"]["items"]["enum"] == list(SMARTGEN_PATHS)
    assert fields["failure_policy"]["enum"] == list(FAILURE_POLICIES)


def test_every_field_parse_job_reads_is_described():
    """Each body field parse_job reads (body.get("…"), or the max_tokens names) is a property of both bodies."""
    source = inspect.getsource(gateway_requests.parse_job)
    read = set(re.findall(r'body\.get\("(\w+)"', source)) | {"max_tokens", "max_completion_tokens"}
    assert {"transfer_mode", "kv_budget", "ignore_eos"} <= read  # the pattern still finds what it should
    for kind, name in BODIES.items():
        described = set(SCHEMAS[name]["properties"])
        prompt_field = {"completion": "prompt", "chat": "messages"}[kind]
        assert read - {"prompt", "messages"} <= described and prompt_field in described, read - described


def test_schemathesis_loads_every_operation():
    """The document is valid OpenAPI to schemathesis: every operation loads."""
    operations = [result.ok() for result in loaded().get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                                               "GET /health", "GET /workers", "GET /stats", "GET /metrics"}


@pytest.mark.parametrize("kind", BODIES)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_parse_job_judges_generated_bodies_as_the_schema_does(kind, mode):
    """Bodies schemathesis generates from the document: one the schema refuses gets a 400/404 ApiError; one it
    accepts is parsed, or refused for a constraint between fields; parse_job never raises anything else."""
    route = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}[kind]
    operation = loaded()[route]["POST"]
    validator = jsonschema_rs.validator_for(SCHEMAS[BODIES[kind]])

    def fits(body: object) -> bool:
        try:
            return validator.is_valid(body)
        except (TypeError, ValueError):  # no body at all (schemathesis's NOT_SET), or not JSON data
            return False

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        body = case.body
        try:
            parse(body, kind)
        except ApiError as exc:
            assert exc.status in (400, 404), exc.message
            assert not fits(body) or exc.param in CROSS_FIELD_PARAMS or is_integral_float(body.get(exc.param)), \
                (body, exc.param, exc.message)
            return
        assert fits(body), body

    run()


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "seed": 2**70}, "seed"),  # did not fit msgpack: a 500 after the workers were asked
    ({"prompt": "x", "selector": "quest", "kv_budget": 10**400}, "kv_budget"),  # float() overflowed: a 500
    ({"prompt": "x\ud800"}, "prompt"),  # the tokenizer's TypeError: a 500
    ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages"),
    ({"prompt": "x", "n": True}, "n"),  # True == 1 slipped through
    ({"prompt": "x", "top_p": 10**400}, "top_p"),  # math.isnan overflowed: a 500
    ({"prompt": "x", "logit_bias": {"5": 10**400}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"1" * 5000: 1}}, "logit_bias"),  # int() refuses over 4,300 digits: a 500
    ({"prompt": "x", "stop": 0}, "stop"),  # falsy values slipped through as "no stop"
    ({"prompt": "x", "max_tokens": 4, "max_completion_tokens": "no"}, "max_completion_tokens"),  # max_tokens hid it
])
def test_values_that_slipped_through_are_400(body, param):
    """Values that used to pass validation (or crash past it) are a 400 naming the parameter."""
    kind = "chat" if "messages" in body else "completion"
    with pytest.raises(ApiError) as raised:
        parse(body, kind)
    assert raised.value.status == 400 and raised.value.param == param


@pytest.mark.parametrize("status, retry_after", [(429, "1"), (503, "5")])
def test_busy_and_unavailable_answers_say_when_to_retry(status, retry_after):
    """429 and 503 error responses carry a Retry-After header in seconds (a default, or the error's own); a 400
    has none."""
    assert _error(ApiError(status, "busy")).headers["Retry-After"] == retry_after
    assert _error(ApiError(status, "busy", retry_after_s=30)).headers["Retry-After"] == "30"
    assert "Retry-After" not in _error(ApiError(400, "bad")).headers


def test_chat_content_may_be_a_list_of_text_parts():
    """What OpenAI clients (guidellm, the SDK with parts) send: text parts are read as the text, one per line;
    another part type is a 400 that names it."""
    as_text = parse({"messages": [{"role": "user", "content": "hello\nworld"}]}, "chat")
    as_parts = parse({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                                                 {"type": "text", "text": "world"}]}]}, "chat")
    assert as_parts.prompt_ids == as_text.prompt_ids
    with pytest.raises(ApiError, match="'image_url'"):
        parse({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "chat")


def test_sampling_options_are_checked_and_carried():
    """top_p in (0, 1], top_k ≥ 0 (or -1, vLLM's "no limit", taken as 0), presence and frequency penalties in
    [-2, 2], repetition_penalty in (0, 10] reach the job; other values are a 400 naming the option."""
    job = parse({"prompt": "x", "top_p": 0.9, "top_k": 40}, "completion")
    assert (job.top_p, job.top_k) == (0.9, 40)
    assert (parse({"prompt": "x", "top_k": -1}, "completion").top_k, parse({"prompt": "x"}, "completion").top_p) == (0, 1.0)
    job = parse({"prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2},
                "completion")
    assert (job.presence_penalty, job.frequency_penalty, job.repetition_penalty) == (0.5, -1.0, 1.2)
    for name, bad in [("top_p", 0), ("top_p", 1.5), ("top_p", True), ("top_k", -2), ("top_k", 2.5),
                      ("presence_penalty", 2.5), ("frequency_penalty", "1"), ("repetition_penalty", 0),
                      ("repetition_penalty", 11)]:
        with pytest.raises(ApiError) as refused:
            parse({"prompt": "x", name: bad}, "completion")
        assert refused.value.param == name


@pytest.mark.parametrize("name, off, on", [("best_of", 1, 2)])
def test_unsupported_options_are_refused_unless_off(name, off, on):
    """Never silently ignored: the value that means "off" is accepted, any other is a 400 naming the option."""
    parse({"prompt": "x", name: off}, "completion")
    with pytest.raises(ApiError) as refused:
        parse({"prompt": "x", name: on}, "completion")
    assert refused.value.param == name and name in refused.value.message


def test_logit_bias_is_checked():
    """logit_bias: token ids as strings of digits below the vocabulary, biases from -100 to 100, at most
    MAX_LOGIT_BIAS entries; null and {} mean none; anything else is a 400 naming it."""
    from services.gateway.requests import MAX_LOGIT_BIAS

    assert parse({"prompt": "x", "logit_bias": {"5": 10, "7": -100}}, "completion").logit_bias == {"5": 10.0, "7": -100.0}
    assert parse({"prompt": "x", "logit_bias": None}, "completion").logit_bias == {}
    assert parse({"prompt": "x", "logit_bias": {}}, "completion").logit_bias == {}
    too_many = {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}
    for bad in ([5], {"x": 1}, {"-1": 1}, {"07": 1}, {"²": 1}, {str(VOCAB): 1}, {"5": 101}, {"5": True}, {"5": "1"}, {"5": float("nan")},
                too_many):
        with pytest.raises(ApiError) as refused:
            parse({"prompt": "x", "logit_bias": bad}, "completion")
        assert refused.value.param == "logit_bias", bad


def test_a_list_of_prompts_is_one_job_each():
    """completions: a list of texts, or of token-id lists, is one job per prompt (ids <id>-<i>); a list of one is
    that prompt; a list of token ids is one prompt; several prompts stream as interleaved choices."""
    jobs = parse_jobs({"prompt": ["ab", "cde"]}, "completion", FakeTokenizer(), MAX_POSITIONS, MODEL, "full", 16,
                      request_id="batch")
    assert [(j.request_id, len(j.prompt_ids)) for j in jobs] == [("batch-0", 2), ("batch-1", 3)]
    assert [j.prompt_ids for j in parse({"prompt": [[1, 2], [3]]}, "completion")] == [[1, 2], [3]]
    assert parse({"prompt": [[1, 2]]}, "completion").prompt_ids == [1, 2]
    assert parse({"prompt": [1, 2, 3]}, "completion").prompt_ids == [1, 2, 3]
    for body in ({"prompt": ["a", [1]]}, {"prompt": ["a"] * 33}):
        with pytest.raises(ApiError) as refused:
            parse(body, "completion")
        assert refused.value.param == "prompt", body


def test_logprobs_and_echo_per_route():
    """completions: logprobs is the number of alternatives (0–20), echo a boolean (not with stream); chat:
    logprobs a boolean, top_logprobs the alternatives (only with logprobs), no echo."""
    assert (parse({"prompt": "x"}, "completion").logprobs, parse({"prompt": "x", "logprobs": 0}, "completion").logprobs) == (-1, 0)
    job = parse({"prompt": "x", "logprobs": 5, "echo": True}, "completion")
    assert (job.logprobs, job.echo) == (5, True)
    assert parse({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3}, "chat").logprobs == 3
    assert parse({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "chat").logprobs == 0
    assert parse({"messages": [{"role": "user", "content": "x"}], "logprobs": False}, "chat").logprobs == -1
    for body, kind, param in [({"prompt": "x", "logprobs": 21}, "completion", "logprobs"),
                              ({"prompt": "x", "logprobs": True}, "completion", "logprobs"),
                              ({"prompt": "x", "echo": True, "stream": True}, "completion", "echo"),
                              ({"prompt": "x", "top_logprobs": 2}, "completion", "top_logprobs"),
                              ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "chat", "top_logprobs"),
                              ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "chat", "logprobs"),
                              ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "chat", "echo")]:
        with pytest.raises(ApiError) as refused:
            parse(body, kind)
        assert refused.value.param == param, body


def test_stream_options_and_request_ids():
    """include_usage only with stream; an X-Request-Id becomes the request id if it can stand in a subject."""
    job = parse_job({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}, "completion",
                    FakeTokenizer(), MAX_POSITIONS, MODEL, "full", 16, request_id="client-42")
    assert job.include_usage and job.request_id == "client-42"
    with pytest.raises(ApiError, match="stream: true"):
        parse({"prompt": "x", "stream_options": {"include_usage": True}}, "completion")
    with pytest.raises(ApiError, match="X-Request-Id"):
        parse_job({"prompt": "x"}, "completion", FakeTokenizer(), MAX_POSITIONS, MODEL, "full", 16, request_id="a.b")
