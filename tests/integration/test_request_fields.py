"""No silently ignored field: every field of the openai package's own request types (completions and chat) and of
vLLM's documented extensions, sent alone with a plausible value, is answered with a 200 or a 400 that names it;
and the routes beside generation: /tokenize, /detokenize, /version, /v1/models/{id}, n with stream."""
from __future__ import annotations

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from tests.integration.conftest import get_json, post_json, post_sse

SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
# field → a value a client could plausibly send ("MODEL": the served model's id)
PLAUSIBLE = {
    "model": "MODEL", "prompt": "Hello", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2,
    "max_completion_tokens": 2, "temperature": 0.5, "top_p": 0.9, "n": 2, "stream": True, "seed": 7,
    "stop": ["\n\n"], "logprobs": True, "top_logprobs": 2, "echo": True, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "logit_bias": {"42": -100}, "user": "user-1", "best_of": 2, "suffix": " the end",
    "stream_options": {"include_usage": True}, "audio": {"voice": "alloy", "format": "wav"},
    "function_call": "auto", "functions": [{"name": "f", "parameters": SCHEMA}], "metadata": {"team": "a"},
    "modalities": ["text"], "moderation": {"model": "omni-moderation-latest"}, "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "Hello"}, "prompt_cache_key": "k1",
    "prompt_cache_options": {"mode": "auto"}, "prompt_cache_retention": "24h", "reasoning_effort": "low",
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    "safety_identifier": "hash-1", "service_tier": "flex", "store": True, "tool_choice": "required", "tools": TOOLS,
    "verbosity": "low", "web_search_options": {"search_context_size": "low"},
    # vLLM's documented extensions (docs: "Extra parameters" of the completions and chat APIs)
    "use_beam_search": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "length_penalty": 0.5,
    "stop_token_ids": [2], "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 1,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 3,
    "allowed_token_ids": [1, 2, 3], "prompt_logprobs": 1, "add_special_tokens": True, "guided_json": SCHEMA,
    "guided_regex": "[ab]{2}", "guided_choice": ["yes", "no"], "guided_grammar": 'start: "yes" | "no"',
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ?", "structural_tag": "{}",
    "structured_outputs": {"choice": ["yes", "no"]}, "priority": 1, "request_id": "r-1", "cache_salt": "salt",
    "logits_processors": ["my.module:Proc"], "return_tokens_as_token_ids": True, "return_token_ids": True,
    "bad_words": ["bad"], "kv_transfer_params": {"do_remote_decode": True}, "vllm_xargs": {"x": 1},
    "add_generation_prompt": False, "continue_final_message": True, "documents": [{"title": "t", "text": "x"}],
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": False},
    "mm_processor_kwargs": {"fps": 1}, "prompt_embeds": "AAAA",
}
VLLM_COMPLETION = ["use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
                   "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
                   "spaces_between_special_tokens", "truncate_prompt_tokens", "allowed_token_ids", "prompt_logprobs",
                   "add_special_tokens", "response_format", "guided_json", "guided_regex", "guided_choice",
                   "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
                   "structured_outputs", "priority", "request_id", "cache_salt", "logits_processors",
                   "return_tokens_as_token_ids", "return_token_ids", "bad_words", "kv_transfer_params", "vllm_xargs",
                   "prompt_embeds"]
VLLM_CHAT = [f for f in VLLM_COMPLETION if f != "prompt_embeds"] + [
    "echo", "add_generation_prompt", "continue_final_message", "documents", "chat_template", "chat_template_kwargs",
    "mm_processor_kwargs"]


def fields_of(module) -> list[str]:
    """The request fields of an openai `*_create_params` module: its base TypedDict and the stream variants."""
    names: set[str] = set()
    for cls in (module.CompletionCreateParamsBase, module.CompletionCreateParamsStreaming,
                module.CompletionCreateParamsNonStreaming):
        names |= set(cls.__annotations__)
    return sorted(names)


ROUTES = {"completion": ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
                         fields_of(completion_params) + VLLM_COMPLETION),
          "chat": ("/v1/chat/completions", {"messages": PLAUSIBLE["messages"], "max_tokens": 2, "temperature": 0},
                   fields_of(chat_params) + VLLM_CHAT)}


@pytest.mark.parametrize("kind", ROUTES)
def test_every_openai_and_vllm_field_works_or_is_refused_by_name(clean_stack, kind):
    """Each field alone on a good body: a 200, or a 400 whose error names it (param or message); never a 200 that
    drops it silently (an unknown field is a 400 too: the last check)."""
    path, base, fields = ROUTES[kind]
    model = get_json(clean_stack.gateway_url + "/v1/models")["data"][0]["id"]
    assert {"tools", "response_format", "stream"} <= set(fields) or kind == "completion"
    outcomes = {}
    for name in sorted(set(fields)) + ["no_such_field"]:
        value = model if PLAUSIBLE.get(name) == "MODEL" else PLAUSIBLE.get(name, 1)
        assert name in PLAUSIBLE or name == "no_such_field", f"the openai package has a new field {name!r}: add it"
        body = {**base, name: value}
        if name == "stream":
            chunks = post_sse(clean_stack.gateway_url + path, body)
            outcomes[name] = 200 if chunks and "error" not in chunks[-1] else chunks[-1]
            continue
        status, reply = post_json(clean_stack.gateway_url + path, body)
        if status == 400:
            error = reply["error"]
            assert error["param"] == name or name in error["message"], (name, error)
        else:
            assert status == 200 and name != "no_such_field", (name, status, reply)
        outcomes[name] = status
    print(kind, {status: sorted(n for n, s in outcomes.items() if s == status) for status in (200, 400)})
    assert outcomes["no_such_field"] == 400
    assert outcomes["response_format"] == 200 and outcomes["n"] == 200 and outcomes["user"] == 200


def test_n_with_stream_interleaves_choices_by_index(clean_stack):
    """n = 3 streamed: chunks of choices 0, 1, 2 on one stream with one id, each choice ending with its own
    finish_reason; each choice's text is what the same seed gives unstreamed; include_usage adds them up."""
    url = clean_stack.gateway_url + "/v1/chat/completions"
    body = {"messages": PLAUSIBLE["messages"], "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3}
    chunks = post_sse(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
    whole = post_json(url, body)[1]
    assert len({c["id"] for c in chunks}) == 1
    texts, finished = {}, {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finished[choice["index"]] = choice["finish_reason"]
    assert sorted(texts) == [0, 1, 2] and sorted(finished) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


def test_tokenize_detokenize_version_and_one_model(clean_stack, tiny_model_path):
    """vLLM's /tokenize (text and chat) and /detokenize round-trip the tokenizer; /version; /v1/models/{id} is the
    model card, an unknown id a 404."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    gw = clean_stack.gateway_url
    status, reply = post_json(gw + "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and reply["tokens"] == tokenizer("Hello world")["input_ids"] and reply["count"] == len(reply["tokens"])
    assert reply["token_strs"] == tokenizer.convert_ids_to_tokens(reply["tokens"]) and reply["max_model_len"] > 0
    status, chat = post_json(gw + "/tokenize", {"messages": PLAUSIBLE["messages"]})
    template = tokenizer.apply_chat_template(PLAUSIBLE["messages"], tokenize=False, add_generation_prompt=True)
    assert status == 200 and chat["tokens"] == tokenizer(template, add_special_tokens=False)["input_ids"]
    status, back = post_json(gw + "/detokenize", {"tokens": reply["tokens"]})
    assert status == 200 and back["prompt"] == tokenizer.decode(reply["tokens"])
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "nope": 1}, "nope")]:
        status, refused = post_json(gw + path, body)
        assert status == 400 and refused["error"]["param"] == param, refused
    assert get_json(gw + "/version")["version"]
    model = get_json(gw + "/v1/models")["data"][0]
    assert get_json(gw + f"/v1/models/{model['id']}") == model
    missing = get_json(gw + "/v1/models/no-such-model")
    assert missing["_status"] == 404 and missing["error"]["code"] == "model_not_found"
