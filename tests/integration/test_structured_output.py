"""Structured output and tool calls through the whole stack with the openai SDK: the tiny random model for the
shapes (under the mask alone even a random model must give valid JSON), the real SmolLM2 for valid answers."""
from __future__ import annotations

import json

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from tools.nats_server import free_port
from tools.stack import Stack, StackSpec
from tests.integration.conftest import assert_no_leaks

NUM_REQUESTS = 5
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
                                           "sky": {"enum": ["sunny", "cloudy", "rainy"]}},
          "required": ["city", "temperature_c", "sky"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris? Answer as JSON with city, temperature_c, sky."}]


class Client:
    """The openai SDK's client, with the stack's model filled in."""

    def __init__(self, stack: Stack):
        self.sdk = OpenAI(base_url=stack.gateway_url + "/v1", api_key="unused", max_retries=0)
        self.model = self.sdk.models.list().data[0].id

    def chat(self, **kwargs):
        return self.sdk.chat.completions.create(model=self.model, **kwargs)


def client_of(stack: Stack) -> Client:
    return Client(stack)


def check_json_schema_answers(client: Client, mode: str, temperature: float, num_requests: int = NUM_REQUESTS) -> None:
    """`num_requests` json_schema answers, then one streamed: each parses and validates; each ends by itself."""
    for seed in range(num_requests):
        chat = client.chat(messages=QUESTION, response_format=FORMAT, max_tokens=80,
                                              temperature=temperature, seed=seed, extra_body={"transfer_mode": mode})
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        assert chat.choices[0].finish_reason == "stop", (mode, seed, chat.choices[0].message.content)
        if seed == 0:
            print(mode, "json_schema:", chat.choices[0].message.content)
    chunks = list(client.chat(messages=QUESTION, response_format=FORMAT, max_tokens=80,
                                                 temperature=temperature, seed=1, stream=True,
                                                 extra_body={"transfer_mode": mode}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def check_named_tool_calls(client: Client, mode: str, temperature: float, num_requests: int = NUM_REQUESTS) -> None:
    """A named tool_choice: tool_calls with that name and arguments that validate, streamed and not."""
    for seed in range(num_requests):
        chat = client.chat(messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                              max_tokens=80, temperature=temperature, seed=seed,
                                              extra_body={"transfer_mode": mode})
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
        if seed == 0:
            print(mode, "tool call:", call.function.name, call.function.arguments)
    chunks = list(client.chat(messages=QUESTION, tools=TOOLS, tool_choice=NAMED,
                                                 max_tokens=80, temperature=temperature, seed=2, stream=True,
                                                 extra_body={"transfer_mode": mode}))
    deltas = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and all(d.index == 0 for d in deltas)
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("mode", ["full", "smartgen", "colocated"])
def test_json_schema_and_named_tool_calls_hold_under_the_mask_in_every_mode(clean_stack, mode):
    """The tiny random model, sampling at temperature 1: the grammar alone makes every answer valid, whichever side
    (prefill or decode) samples each token."""
    client = client_of(clean_stack)
    check_json_schema_answers(client, mode, temperature=1.0)
    check_named_tool_calls(client, mode, temperature=1.0)


def test_each_row_of_a_batch_gets_its_own_requests_mask(clean_stack):
    """Continuous batching: a json_schema request, a guided_choice one and a free-text one at once share decode's
    forward passes; each gets exactly the tokens it gets alone (its own mask, or none, on its own row)."""
    import concurrent.futures

    from tests.integration.conftest import get_json, model_workers, post_json

    base = {"messages": QUESTION, "max_tokens": 40, "temperature": 1.0, "seed": 5}
    bodies = [base | {"response_format": FORMAT, "transfer_mode": "full"},
              base | {"guided_choice": ["sunny today", "cloudy", "rain later"], "transfer_mode": "smartgen"},
              base | {"ignore_eos": True, "transfer_mode": "colocated"}]
    url = clean_stack.gateway_url + "/v1/chat/completions"
    alone = [post_json(url, body)[1] for body in bodies]
    decode = next(w for w in model_workers(clean_stack) if w["role"] == "decode")
    before = get_json(decode["admin_url"] + "/stats")["batching"]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: post_json(url, body)[1], bodies + bodies))
    after = get_json(decode["admin_url"] + "/stats")["batching"]
    assert [r["smartgen"]["token_ids"] for r in together] == [r["smartgen"]["token_ids"] for r in alone] * 2
    jsonschema.validate(json.loads(alone[0]["choices"][0]["message"]["content"]), SCHEMA)
    assert alone[1]["choices"][0]["message"]["content"] in ("sunny today", "cloudy", "rain later")
    steps = sum(len(r["smartgen"]["token_ids"]) - 1 for r in together)
    assert after["batches"] - before["batches"] < steps  # some steps shared a forward pass


def test_required_tool_choice_and_json_object_and_refusals(clean_stack):
    """`required`: a list of calls of the given tools, streamed whole at the end; json_object: a JSON object;
    `auto` and a schema that cannot be enforced: a 400 naming the field, and nothing leaks."""
    client = client_of(clean_stack)
    chat = client.chat(messages=QUESTION, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=3)
    assert chat.choices[0].finish_reason == "tool_calls", chat.choices[0]
    [call] = chat.choices[0].message.tool_calls
    tool = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), tool["parameters"])
    chunks = list(client.chat(messages=QUESTION, tools=TOOLS, tool_choice="required",
                                                 max_tokens=120, temperature=1.0, seed=3, stream=True,
                                                 parallel_tool_calls=False))
    streamed = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in streamed] == [(call.function.name, call.function.arguments)]
    chat = client.chat(messages=QUESTION, response_format={"type": "json_object"},
                                          max_tokens=60, temperature=0)
    if chat.choices[0].finish_reason == "stop":  # a random model may run out of tokens inside the object
        assert isinstance(json.loads(chat.choices[0].message.content), dict)
    else:
        assert chat.choices[0].message.content.startswith("{")
    for kwargs, param in [({"tools": TOOLS}, "tool_choice"), ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
                          ({"response_format": {"type": "json_schema", "json_schema": {
                              "name": "x", "schema": {"type": "object", "minProperties": "many"}}}}, "response_format")]:
        with pytest.raises(BadRequestError) as refused:
            client.chat(messages=QUESTION, max_tokens=5, **kwargs)
        error = refused.value.body.get("error", refused.value.body)
        assert error["param"] == param, error


@pytest.mark.real_model
def test_real_model_answers_json_schema_and_tool_calls_validly(real_model_path, tmp_path):
    """SmolLM2, sampled, in full and smartgen: json_schema answers that validate, named tool calls whose arguments
    validate, streamed the same (two seeds each: the tiny model's tests above sample NUM_REQUESTS in every mode)."""
    log_file = tmp_path / "stack.log"
    spec = StackSpec(gateway_port=free_port(), log_file=log_file, env={"SMARTGEN_KV_CACHE_MB": "256"})
    with Stack(spec) as stack:
        try:
            stack.wait_ready(240)
            client = client_of(stack)
            for mode in ("full", "smartgen"):
                check_json_schema_answers(client, mode, temperature=0.7, num_requests=2)
                check_named_tool_calls(client, mode, temperature=0.7, num_requests=2)
            assert_no_leaks(stack)
        except BaseException:
            print(log_file.read_text()[-4000:])
            raise


def test_a_tool_loop_sends_the_call_and_its_result_back(clean_stack):
    """Turn 2 of a tool loop with the openai SDK: the assistant's tool_calls message (as the SDK got it) and a `tool`
    message go back; the prompt shows the call's JSON and the result (this template has no tool_calls of its own);
    a tool_calls field on a user message is a 400."""
    from tests.integration.conftest import post_json

    client = client_of(clean_stack)
    first = client.chat(messages=QUESTION, tools=TOOLS, tool_choice=NAMED, max_tokens=80, temperature=1.0, seed=4)
    message = first.choices[0].message
    call = message.tool_calls[0]
    turns = [*QUESTION, message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    second = client.chat(messages=turns, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0)
    assert second.choices[0].message.content is not None and second.choices[0].message.tool_calls is None
    status, shown = post_json(clean_stack.gateway_url + "/tokenize", {"messages": turns})
    prompt = post_json(clean_stack.gateway_url + "/detokenize", {"tokens": shown["tokens"]})[1]["prompt"]
    assert '"name": "get_weather"' in prompt and "18 C and sunny" in prompt
    with pytest.raises(BadRequestError):
        client.chat(messages=[{"role": "user", "content": "hi", "tool_calls": [call.model_dump()]}], max_tokens=2)
