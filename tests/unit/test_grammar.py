"""Structured output's pieces without services: the gateway's grammars from request fields, the token mask in the
sampler (random logits as the model: the mask alone must make the answer valid), a matcher following tokens
sampled elsewhere, and tool calls from the answer's text."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from schemas import Sampling
from services.gateway.errors import ApiError
from services.gateway.structured import Structure, ToolCallStream, structure_of, tool_calls
from shared.compute.grammar import GrammarCache, GrammarError, TokenGrammar
from shared.compute.sampling import sample

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "rain": {"type": "boolean"},
                                           "level": {"enum": ["low", "high"]}},
          "required": ["city", "rain", "level"], "additionalProperties": False}
JSON_SCHEMA_BODY = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "ping"}}]


@pytest.fixture(scope="module")
def end_id(tiny_model_path) -> int:
    return AutoTokenizer.from_pretrained(tiny_model_path).eos_token_id


def generate(path, grammar: str, end_id: int, seed: int, temperature: float = 1.0, limit: int = 200) -> list[int]:
    """Sample from random logits (a 'model' that knows nothing) under `grammar` until it is complete or ends."""
    state = TokenGrammar(path, 49152, [end_id], grammar)
    sampling, gen, out = Sampling(temperature, seed), torch.Generator().manual_seed(seed), []
    while len(out) < limit and not state.is_complete(out):
        token = sample(torch.randn(49152, generator=gen) * 5, sampling, len(out), (), out, state)
        if token == end_id:
            break
        out.append(token)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_mask_alone_makes_random_logits_follow_a_json_schema(tiny_model_path, end_id, seed):
    """Random logits under a json_schema grammar: every answer parses and validates (and it ends by itself)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    grammar = structure_of(JSON_SCHEMA_BODY, "chat").grammar
    tokens = generate(tiny_model_path, grammar, end_id, seed)
    jsonschema.validate(json.loads(tokenizer.decode(tokens)), SCHEMA)
    unmasked = [sample(torch.randn(49152, generator=torch.Generator().manual_seed(seed)) * 5, Sampling(1.0, seed), 0)]
    assert not tokenizer.decode(unmasked).startswith("{")  # without the mask the same draw is no JSON at all


def test_a_matcher_follows_tokens_sampled_elsewhere_and_refuses_a_token_off_grammar(tiny_model_path, end_id):
    """Decode's matcher catches up on the prefill's first token; a token the grammar forbids is a GrammarError."""
    grammar = structure_of(JSON_SCHEMA_BODY, "chat").grammar
    tokens = generate(tiny_model_path, grammar, end_id, seed=7)
    late = TokenGrammar(tiny_model_path, 49152, [end_id], grammar)
    assert late.allowed(tokens[:1])[tokens[1]] and late.num_consumed == 1
    assert late.is_complete(tokens) and late.num_consumed == len(tokens)
    with pytest.raises(GrammarError):
        TokenGrammar(tiny_model_path, 49152, [end_id], grammar).follow(tokens[1:2])  # a JSON object starts with {


def test_the_grammar_cache_compiles_a_grammar_once_and_hands_out_fresh_matchers(tiny_model_path, end_id):
    """Two requests with the same schema: one compile; each matcher starts at the beginning."""
    cache, grammar = GrammarCache(size=2), structure_of(JSON_SCHEMA_BODY, "chat").grammar
    first = TokenGrammar(tiny_model_path, 49152, [end_id], grammar, cache)
    prefix = generate(tiny_model_path, grammar, end_id, seed=1)[:3]
    second = TokenGrammar(tiny_model_path, 49152, [end_id], grammar, cache)
    assert cache.num_compiled == 1 and second.num_consumed == 0
    assert not torch.equal(first.allowed(prefix), second.allowed([]))  # '{' first, then one of the keys
    with pytest.raises(GrammarError):
        TokenGrammar(tiny_model_path, 49152, [end_id], '{"grammars": [{"lark_grammar": "start: nope"}]}', cache)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "minProperties": "x"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": TOOLS}, "tool_choice"),  # auto, OpenAI's default with tools: no parser for the model's format
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", **JSON_SCHEMA_BODY}, "tool_choice"),
    ({"guided_json": SCHEMA, **JSON_SCHEMA_BODY}, "guided_json"),
])
def test_bad_structured_output_fields_get_a_400_naming_the_field(body, param):
    """Each bad or conflicting structured-output field is refused by name, before any worker sees it."""
    with pytest.raises(ApiError) as refused:
        structure_of(body, "chat")
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message


def test_tool_calls_come_from_the_answer_text_in_openai_shape():
    """A named call's text is its arguments; a `required` list gives one call per item; cut-short text gives none."""
    named = structure_of({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "ping"}}}, "chat")
    assert named.tool_mode == "named" and named.grammar
    [call] = tool_calls(named, "{}")
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"] == {"name": "ping", "arguments": "{}"}
    required = structure_of({"tools": TOOLS, "tool_choice": "required"}, "chat")
    calls = tool_calls(required, '[{"name": "ping", "arguments": {}}, {"name": "get_weather", "arguments": {"rain": true}}]')
    assert [c["function"]["name"] for c in calls] == ["ping", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"rain": True}
    assert tool_calls(required, '[{"name": "pi') is None
    stream = ToolCallStream(named)
    first, second = stream.delta('{"a'), stream.delta('": 1}')
    assert first["tool_calls"][0]["function"]["name"] == "ping" and "name" not in second["tool_calls"][0]["function"]
    assert stream.finish('{"a": 1}', "") == ({}, True)
    assert ToolCallStream(required).finish('[{"name": "pi', "")[1] is False
    assert structure_of({"tools": TOOLS, "tool_choice": "none"}, "chat") == Structure(tools=TOOLS)


def test_a_grammar_with_no_way_on_ends_the_answer_instead_of_failing_it(tiny_model_path, end_id):
    """A regex no text matches passes validation; its first mask allows only the end tokens (finish: stop)."""
    grammar = structure_of({"guided_regex": "[^\\s\\S]"}, "completion").grammar
    allowed = TokenGrammar(tiny_model_path, 49152, [end_id], grammar).allowed([])
    assert allowed.nonzero().flatten().tolist() == [end_id]
    with pytest.raises(GrammarError):
        TokenGrammar(tiny_model_path, 49152, [], grammar).allowed([])


def test_the_end_is_the_requests_end_ids_and_only_where_the_answer_is_complete(tiny_model_path, end_id):
    """guided_choice ["yes", "yes sir"]: no end token before "yes", the request's end ids (EOS and a stop id) after
    it, never the tokenizer's other special tokens; another set of end ids reuses the worker's tokenizer."""
    from shared.compute.grammar import grammar_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    grammar = structure_of({"guided_choice": ["yes", "yes sir"]}, "completion").grammar
    stop_id = tokenizer.convert_tokens_to_ids("!")
    state = TokenGrammar(tiny_model_path, 49152, [end_id, stop_id], grammar)
    builds = grammar_tokenizer.cache_info().misses
    assert not state.allowed([])[[end_id, stop_id]].any()
    yes = tokenizer("yes", add_special_tokens=False)["input_ids"]
    after = state.allowed(yes)
    assert after[end_id] and after[stop_id] and after.sum() > 2  # the end, or " sir"
    other_specials = [i for i in (tokenizer.bos_token_id, 0, 1) if i not in (end_id, stop_id)]
    assert not after[other_specials].any()
    TokenGrammar(tiny_model_path, 49152, [end_id], grammar)
    assert grammar_tokenizer.cache_info().misses == builds


def test_a_token_the_mask_lets_through_but_the_parser_refuses_is_drawn_again(tiny_model_path, end_id):
    """A regex with control characters (found by the API fuzz test): llguidance's mask allows a token its parser
    refuses; the sampler never hands such a token out (it draws again, or ends the answer), so no request fails."""
    regex = json.loads('"\\udba6\\udd470\\udaaa\\udd5f\\ud847\\udc85|0\\u0007\\u0014\\u00e6x\\u00cc"')
    grammar = structure_of({"guided_regex": regex}, "completion").grammar
    refused = 0
    for seed in range(6):
        state, out = TokenGrammar(tiny_model_path, 49152, [end_id], grammar), []
        gen = torch.Generator().manual_seed(seed)
        while len(out) < 12 and not state.is_complete(out):
            allowed = state.allowed(out).nonzero().flatten().tolist()
            refused += sum(t != end_id and state.matcher.validate_tokens([t]) != 1 for t in allowed)
            token = sample(torch.randn(49152, generator=gen), Sampling(1.0, seed), len(out), (), out, state)
            if token == end_id:
                break
            out.append(token)  # is_complete follows it: a refused token would raise GrammarError here
    assert refused > 0  # the case still arises (else this test no longer tests anything)
