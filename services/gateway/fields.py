"""Every request field the gateway knows, and what it does with each: no field is silently ignored.

A body field is one of:
- handled: parse_job (requests.py) or structure_of (structured.py) reads and checks it;
- noted: it cannot change the answer (an end-user id, metadata): checked for its type and written to the
  request's log line (`request_received`);
- off-only: an option not implemented here, accepted only at the values that mean "off" (the first is the default);
  any other value is a 400 naming it;
- refused: a 400 naming it and saying why, whatever its value (null is always "not set");
- unknown: a 400 naming it.
The test that walks the openai package's own request types (tests/integration/test_request_fields.py) holds this
table against OpenAI's completions and chat APIs; vLLM's documented extensions are listed here by name.
"""
from __future__ import annotations

from typing import Any

from services.gateway.errors import ApiError

HANDLED_BOTH = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "seed", "top_p", "n", "stream", "stream_options",
    "stop", "logprobs", "top_logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias",
    "response_format",
    # vLLM's sampling extensions
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "truncate_prompt_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
    # SmartGen's own
    "transfer_mode", "selector", "kv_budget", "kv_bits", "ablate", "failure_policy",
})
HANDLED = {
    "completion": HANDLED_BOTH | {"prompt"},
    "chat": HANDLED_BOTH | {"messages", "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
                            "continue_final_message"},
}
NOTED = {"user": str, "safety_identifier": str, "prompt_cache_key": str, "metadata": dict}
# field → the values that mean "off" (the first is the default)
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",), "store": (False,), "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    # vLLM's
    "use_beam_search": (False,), "length_penalty": (1.0,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "priority": (0,),
    "return_tokens_as_token_ids": (False,), "return_token_ids": (False,), "bad_words": ([],),
    "guided_decoding_backend": ("auto", "guidance"), "logits_processors": ([],),
}
OFF_BY_ROUTE = {"completion": {"add_special_tokens": (True,)}, "chat": {"add_special_tokens": (False,)}}  # as done
REFUSED = {
    "functions": "the deprecated functions API: send tools (and tool_choice)",
    "function_call": "the deprecated functions API: send tool_choice (with tools)",
    "audio": "this server answers with text only",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "this model does not reason before it answers",
    "verbosity": "not supported: ask for length with max_tokens",
    "web_search_options": "this server has no web search",
    "moderation": "this server has no moderation",
    "prompt_cache_retention": "the prefix cache here is not kept per request",
    "prompt_cache_options": "the prefix cache here is not kept per request",
    # vLLM's
    "request_id": "send the request id as the X-Request-Id header",
    "prompt_logprobs": "send echo with logprobs (completions) for the prompt's log-probabilities",
    "allowed_token_ids": "not supported: logit_bias -100 bans tokens",
    "guided_whitespace_pattern": "JSON here has fixed separators (docs/structured-output.md)",
    "structural_tag": "not supported: send response_format or tools",
    "chat_template": "the model's own chat template is used",
    "chat_template_kwargs": "the model's own chat template is used, as it is",
    "documents": "the model's own chat template is used, as it is",
    "mm_processor_kwargs": "this server takes text only",
    "prompt_embeds": "this server takes text or token ids only",
    "cache_salt": "the prefix cache is not shared between tenants here",
    "kv_transfer_params": "SmartGen moves KV itself: see transfer_mode",
    "vllm_xargs": "not supported",
}


def check_fields(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """A 400 naming the first field of `body` that is not honoured; else the noted fields (for the log line)."""
    noted = {}
    for name, value in body.items():
        if value is None or name in HANDLED[kind]:
            continue
        if name in NOTED:
            if not isinstance(value, NOTED[name]):
                raise ApiError(400, f"{name} must be a{'n object' if NOTED[name] is dict else ' string'}", name)
            noted[name] = value
        elif (off := OFF_BY_ROUTE[kind].get(name) or OFF_VALUES.get(name)) is not None:
            if not any(value == v and type(value) is type(v) or _same_number(value, v) for v in off):
                raise ApiError(400, f"{name}={value!r} is not supported: leave it out or send "
                                    f"{' or '.join(repr(v) for v in off)}", name, "unsupported_parameter")
        elif name in REFUSED:
            raise ApiError(400, f"{name} is not supported: {REFUSED[name]}", name, "unsupported_parameter")
        elif name in HANDLED["chat"] | HANDLED["completion"]:
            other = "/v1/chat/completions" if kind == "completion" else "/v1/completions"
            raise ApiError(400, f"{name} is for {other}", name, "unsupported_parameter")
        else:
            raise ApiError(400, f"unknown field {name!r}: this server neither takes nor ignores it", name,
                           "unknown_parameter")
    return noted


def _same_number(value: Any, off: Any) -> bool:
    """1 and 1.0 are the same length_penalty; True is no number."""
    numbers = (int, float)
    return isinstance(value, numbers) and isinstance(off, numbers) and not isinstance(value, bool) \
        and not isinstance(off, bool) and value == off
