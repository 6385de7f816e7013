"""The gateway's OpenAPI 3.1 description, served at GET /openapi.json.

It says what the gateway takes and what it answers, for clients and for the API fuzz test
(tests/integration/test_api_fuzz.py): a body outside these schemas gets a 400 (or the 404 of an unknown
model). Enums come from the constants the validation itself uses, so the two cannot drift.
Constraints between fields (kv_bits only for `quantized` and `smartgen`, prompt + max_tokens within the context, …) are
in the descriptions, not the schemas: a body that breaks one is still answered with a 400. So is 5.0 where
an integer is due: JSON Schema counts it as an integer; the gateway wants a JSON integer.
"""
from __future__ import annotations

from typing import Any

from schemas import (AUTO_KV_BITS, DEFAULT_KV_BITS, FAILURE_POLICIES, SELECTIVE_DEFAULTS,
                     KV_BITS, PUSH_KV_BITS, SELECTORS, SMARTGEN_PATHS, TRANSFER_MODES)
from services.gateway.requests import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PROMPTS, MAX_REPETITION_PENALTY, MAX_SEED,
                                       MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOP_K)
from services.gateway.fields import NOTED, OFF_BY_ROUTE, OFF_VALUES, REFUSED
from services.gateway.structured import GUIDED, MAX_TOOLS
from shared import __version__

Schema = dict[str, Any]


def openapi_document(model_id: str, max_positions: int, vocab_size: int) -> Schema:
    """The whole document for a gateway serving `model_id` (context of `max_positions` tokens)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "SmartGen gateway", "version": __version__,
                 "description": "OpenAI-compatible completions over prefill/decode disaggregated workers. "
                                "Every response carries a `smartgen` object with latency and transfer figures."},
        "paths": {
            "/v1/completions": {"post": _generation("Create a completion", "CompletionRequest",
                                                    "CompletionResponse")},
            "/v1/chat/completions": {"post": _generation("Create a chat completion", "ChatCompletionRequest",
                                                         "ChatCompletionResponse")},
            "/v1/models": {"get": _read("The served model", "ModelList")},
            "/v1/models/{model_id}": {"get": _model_read()},
            "/tokenize": {"post": _post("vLLM's: a prompt or chat messages as token ids", "TokenizeRequest",
                                        "TokenizeResponse")},
            "/detokenize": {"post": _post("vLLM's: token ids as text", "DetokenizeRequest", "DetokenizeResponse")},
            "/version": {"get": _read("The server's version", "Version")},
            "/health": {"get": _read("200 once a prefill, a decode and a broker worker are registered", "Health",
                                     unavailable=True)},
            "/ready": {"get": _read("Like /health, as {ready: bool}", "Ready", unavailable=True)},
            "/live": {"get": _read("200 while the process answers, whatever NATS or the workers do (liveness)", "Live")},
            "/workers": {"get": _admin_read("The workers this gateway hears heartbeats from (pids and internal "
                                            "addresses: with the admin token)", "WorkerList")},
            "/stats": {"get": _read("This gateway's counters", "Stats")},
            "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics",
                                 "responses": {"200": {"description": "Prometheus text format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": _read("This document", "OpenApi")},
        },
        "components": {
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer",
                                               "description": "SMARTGEN_ADMIN_TOKEN(_FILE), for /workers"}},
            "schemas": {
                "CompletionRequest": _request({
                    "prompt": {"description": "text or token ids, or a list of several of either (one choice each; "
                                              "streamed, their chunks interleave by choice index)",
                               "anyOf": [{"type": "string", "minLength": 1},
                                         {"type": "array", "items": {"type": "string", "minLength": 1},
                                          "minItems": 1, "maxItems": MAX_PROMPTS},
                                         {"type": "array", "minItems": 1, "maxItems": max_positions - 1,
                                          "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}},
                                         {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
                                          "items": {"type": "array", "minItems": 1, "maxItems": max_positions - 1,
                                                    "items": {"type": "integer", "minimum": 0,
                                                              "maximum": vocab_size - 1}}}]},
                    "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS,
                                 "description": "each token's log-probability with this many alternatives"},
                    "echo": {"type": "boolean", "description": "the prompt comes back before the completion (with "
                                                               "its logprobs, if asked); not with stream"},
                    "top_logprobs": {"type": "null", "description": "chat only (here: logprobs)"},
                    **_off(OFF_BY_ROUTE["completion"]),
                }, ["prompt"], model_id, max_positions, vocab_size),
                "ChatCompletionRequest": _request({
                    "messages": _MESSAGES,
                    "logprobs": {"type": "boolean", "description": "each token's log-probability"},
                    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS,
                                     "description": "with logprobs: this many alternatives per token"},
                    "echo": {"enum": [False, None], "description": "completions only"},
                    "tools": {"type": ["array", "null"], "maxItems": MAX_TOOLS, "items": _object({
                        "type": {"const": "function"}, "function": _object({
                            "name": {"type": "string", "minLength": 1}, "description": _STR,
                            "parameters": {"type": "object", "description": "a JSON schema"}, "strict": {"type": "boolean"}},
                            ["name"])})},
                    "tool_choice": {"description": "with tools: 'none', 'required' or a named function ('auto', the "
                                                   "default with tools, is a 400: no parser for this model's format)",
                                    "anyOf": [{"enum": ["none", "required", None]},
                                              _object({"type": {"const": "function"},
                                                       "function": _object({"name": _STR})})]},
                    "parallel_tool_calls": {"type": ["boolean", "null"],
                                            "description": "false: tool_choice 'required' makes exactly one call"},
                    "add_generation_prompt": {"type": ["boolean", "null"],
                                              "description": "vLLM: the template opens the assistant's turn (default)"},
                    "continue_final_message": {"type": ["boolean", "null"], "description": "vLLM: the answer continues "
                                               "the last (assistant) message; with add_generation_prompt: false"},
                    **_off(OFF_BY_ROUTE["chat"]),
                }, ["messages"], model_id, max_positions, vocab_size),
                "CompletionResponse": _response("text_completion", {
                    "type": "object", "required": ["index", "text", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "text": {"type": "string"},
                                   "finish_reason": {"enum": ["stop", "length"]},
                                   "logprobs": {"anyOf": [{"type": "null"}, _object({
                                       "tokens": {"type": "array", "items": _STR},
                                       "token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
                                       "top_logprobs": {"type": "array", "items": {"type": ["object", "null"]}},
                                       "text_offset": {"type": "array", "items": _INT}})]}}}),
                "ChatCompletionResponse": _response("chat.completion", {
                    "type": "object", "required": ["index", "message", "finish_reason"],
                    "properties": {"index": {"type": "integer"}, "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
                                   "message": {"type": "object", "required": ["role", "content"],
                                               "properties": {"role": {"const": "assistant"},
                                                              "content": _STR_OR_NULL,
                                                              "tool_calls": {"type": "array", "items": _object({
                                                                  "id": _STR, "type": {"const": "function"},
                                                                  "function": _object({"name": _STR,
                                                                                       "arguments": _STR})})}}},
                                   "logprobs": {"anyOf": [{"type": "null"}, _object({"content": {
                                       "type": "array", "items": _object({"token": _STR, "logprob": {"type": "number"},
                                                                          "bytes": {"type": "array", "items": _INT},
                                                                          "top_logprobs": {"type": "array"}})}})]}}}),
                "Usage": _object({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                                  "prompt_tokens_details": _object({"cached_tokens": _INT})},
                                 required=["prompt_tokens", "completion_tokens", "total_tokens"]),
                "SmartGen": _smartgen_object(),
                "Error": _object({"error": _object({"message": _STR, "type": _STR, "param": _STR_OR_NULL,
                                                    "code": _STR_OR_NULL}, required=["message", "type"])}),
                "ModelList": _object({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}),
                "Model": _object({"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                                  "max_model_len": _INT}),
                "TokenizeRequest": {"anyOf": [
                    {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
                        "model": {"enum": [model_id, None]}, "prompt": _STR,
                        "add_special_tokens": {"type": ["boolean", "null"], "description": "default true"},
                        "return_token_strs": {"type": ["boolean", "null"]}}},
                    {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": {
                        "model": {"enum": [model_id, None]}, "messages": _MESSAGES,
                        "add_generation_prompt": {"type": ["boolean", "null"], "description": "default true"},
                        "continue_final_message": {"type": ["boolean", "null"]},
                        "add_special_tokens": {"type": ["boolean", "null"], "description": "default false"},
                        "return_token_strs": {"type": ["boolean", "null"]}, "tools": {"type": ["array", "null"]}}}]},
                "TokenizeResponse": _object({"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT},
                                             "token_strs": {"type": ["array", "null"], "items": _STR}}),
                "DetokenizeRequest": {"type": "object", "required": ["tokens"], "additionalProperties": False,
                                      "properties": {"model": {"enum": [model_id, None]}, "tokens": {
                                          "type": "array", "items": {"type": "integer", "minimum": 0,
                                                                     "maximum": vocab_size - 1}}}},
                "DetokenizeResponse": _object({"prompt": _STR}),
                "Version": _object({"version": _STR}),
                "Health": _object({"status": _STR, "role": _STR, "worker_id": _STR,
                                   "workers": {"type": "object", "additionalProperties": _INT}},
                                  required=["status"]),
                "Ready": _object({"ready": {"type": "boolean"}}),
                "Live": _object({"live": {"type": "boolean"}, "role": _STR, "worker_id": _STR}),
                "WorkerList": _object({"workers": {"type": "array", "items": _object(
                    {"role": _STR, "id": _STR, "pid": _INT, "host": _STR, "admin_url": _STR, "dataplane_addr": _STR,
                     "active_requests": _INT, "kv_pages_free": _INT, "kv_pages_total": _INT},
                    required=["role", "id"])}}),
                "Stats": _object({"role": _STR, "worker_id": _STR, "model": _STR,
                                  "workers": {"type": "object", "additionalProperties": _INT},
                                  "requests_done": {"type": "object"}}, required=["role", "worker_id"]),
                "OpenApi": _object({"openapi": _STR, "info": {"type": "object"}, "paths": {"type": "object"}}),
            },
            "headers": {"Retry-After": {"description": "seconds to wait before trying again", "required": True,
                                        "schema": {"type": "integer", "minimum": 0}}},
        },
    }


_INT: Schema = {"type": "integer"}
_STR: Schema = {"type": "string"}
_STR_OR_NULL: Schema = {"type": ["string", "null"]}
_NUMBER_OR_NULL: Schema = {"type": ["number", "null"]}
# One server-sent event (before OpenAPI 3.2 a stream's `schema` describes each event): its `data` is a JSON
# chunk (the last one with `usage` and `smartgen`, or an error object), then the literal [DONE].
_CONTENT: Schema = {"anyOf": [_STR, {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["type", "text"], "properties": {"type": {"enum": ["text"]}, "text": _STR}}}]}
_TOOL_CALLS: Schema = {"type": "array", "minItems": 1, "description": "the assistant's calls, as this API answered them",
                       "items": {"type": "object", "required": ["function"], "properties": {
                           "id": _STR, "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name", "arguments"], "properties": {
                               "name": _STR, "arguments": {"type": "string", "description": "JSON text"}}}}}}


def _message(roles: list[str], content: Schema, required: list[str], **extra: Schema) -> Schema:
    return {"type": "object", "required": ["role", *required], "additionalProperties": False,
            "properties": {"role": {"enum": roles}, "content": content, "name": _STR_OR_NULL, **extra}}


# One chat message per role: an assistant turn with tool_calls may have no content; a tool turn has tool_call_id
_MESSAGES: Schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
    _message(["system", "user"], _CONTENT, ["content"]),
    _message(["assistant"], _CONTENT, ["content"], tool_calls={"type": ["array", "null"], **{
        k: v for k, v in _TOOL_CALLS.items() if k != "type"}}),
    _message(["assistant"], {"anyOf": [_CONTENT, {"type": "null"}]}, ["tool_calls"], tool_calls=_TOOL_CALLS),
    _message(["tool"], _CONTENT, ["content"], tool_call_id=_STR_OR_NULL)]}}
_SSE_EVENT: Schema = {"type": "object", "required": ["data"], "properties": {"data": _STR, "event": _STR}}


def _object(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    return {"type": "object", "required": list(properties) if required is None else required,
            "properties": properties}


def integers_below(n: int) -> str:
    """A regex for the decimal integers 0 … n-1 without leading zeros (the JSON Schema of a token id as a map key)."""
    top = str(n - 1)
    alternatives = ["0"] + [f"[1-9][0-9]{{{w - 1}}}" for w in range(1, len(top)) if w > 1] + (["[1-9]"] if len(top) > 1 else [])
    for i, digit in enumerate(top):  # as long as top: top's first i digits, then a smaller digit, then any
        low = 1 if i == 0 else 0
        if int(digit) > low:
            rest = len(top) - i - 1
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    alternatives.append(top)
    return "^(?:" + "|".join(dict.fromkeys(alternatives)) + ")$"


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _request(prompt_fields: dict[str, Schema], required: list[str], model_id: str, max_positions: int,
             vocab_size: int) -> Schema:
    """A generation body: the prompt fields, OpenAI's sampling fields, then SmartGen's extras.
    Options not implemented here are described at the values that mean "off", refused ones as null only, and
    any other field is a 400 (services/gateway/fields.py): no field is silently ignored."""
    room = max_positions - 1
    max_tokens = {"type": ["integer", "null"], "minimum": 1, "maximum": room,
                  "description": "completion tokens; prompt + max_tokens must fit the context"}
    json_schema = {"type": ["object", "boolean"], "description": "a JSON schema the answer must follow"}
    return {"type": "object", "required": required, "additionalProperties": False, "properties": {
        **prompt_fields,
        "model": {"enum": [model_id, None], "description": "the served model (any other is a 404)"},
        "max_tokens": max_tokens,
        "max_completion_tokens": {**max_tokens, "description": "OpenAI's newer name; max_tokens wins if both"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 2, "description": "0 = greedy"},
        "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_SEED},
        "n": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_PROMPTS,
              "description": "answers per prompt, each sampled alone (with a seed: answer j uses seed + j); streamed, "
                             f"their chunks interleave by choice index; prompts × n ≤ {MAX_PROMPTS}"},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1,
                  "description": "nucleus sampling: the most likely tokens whose probabilities reach top_p (1 = all)"},
        "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                  "description": "vLLM: at temperature > 0, drop tokens less likely than min_p × the most likely"},
        "min_tokens": {"type": ["integer", "null"], "minimum": 0,
                       "description": "vLLM: no end-of-sequence or stop token before this many tokens (≤ max_tokens)"},
        "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0},
                           "maxItems": MAX_STOP_TOKEN_IDS, "description": "vLLM: more token ids that end the answer"},
        "include_stop_str_in_output": {"type": ["boolean", "null"],
                                       "description": "vLLM: keep a matched stop string at the end of the text"},
        "top_k": {"type": ["integer", "null"], "minimum": -1, "maximum": MAX_TOP_K,
                  "description": "sample among the top_k most likely tokens (0 or -1 = all)"},
        "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2,
                             "description": "subtracted from the logit of every token the completion already has"},
        "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2,
                              "description": "subtracted per occurrence of the token in the completion so far"},
        "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY,
                               "description": "logits of tokens in the prompt or completion ÷ it (× if negative); 1 = off"},
        "logit_bias": {"type": ["object", "null"], "maxProperties": MAX_LOGIT_BIAS,
                       "propertyNames": {"pattern": integers_below(vocab_size)},
                       "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                       "description": "token id → added to its logit before sampling (-100 bans it, 100 forces it); "
                                      f"ids below {vocab_size}"},
        "stream": {"type": "boolean", "description": "server-sent events, one chunk per token, ending with `data: [DONE]`"},
        "stream_options": {"anyOf": [{"type": "null"}, _object({"include_usage": {"type": "boolean"}}, [])],
                           "description": "with stream: include_usage adds a last chunk with `choices: []` and the usage"},
        **_off(OFF_VALUES),
        **{name: {"type": "null", "description": f"not supported: {why}"} for name, why in REFUSED.items()},
        **{name: {"type": [{str: "string", dict: "object"}[kind], "null"],
                  "description": "recorded in the request's log line; it does not change the answer"}
           for name, kind in NOTED.items()},
        "truncate_prompt_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": max_positions,
                                   "description": "vLLM: only the prompt's last this many tokens"},
        "response_format": {"description": "structured output (docs/structured-output.md)", "anyOf": [
            {"type": "null"}, _object({"type": {"enum": ["text", "json_object"]}}),
            _object({"type": {"const": "json_schema"}, "json_schema": _object(
                {"name": _STR, "schema": json_schema, "strict": {"type": ["boolean", "null"]},
                 "description": _STR}, [])}, ["type", "json_schema"])]},
        "guided_json": {"anyOf": [{"type": "null"}, json_schema, _STR], "description": "vLLM: a JSON schema (or its text)"},
        "guided_regex": {"type": ["string", "null"], "description": "vLLM: a regular expression the answer matches"},
        "guided_choice": {"type": ["array", "null"], "minItems": 1, "items": {"type": "string", "minLength": 1},
                          "description": "vLLM: the answer is one of these strings"},
        "guided_grammar": {"type": ["string", "null"], "description": "vLLM: a Lark grammar the answer follows"},
        "structured_outputs": {"anyOf": [{"type": "null"}, {
            "type": "object", "minProperties": 1, "maxProperties": 1,
            "properties": {kind: {} for kind in GUIDED}, "additionalProperties": False}],
            "description": "vLLM: one of json, regex, choice, grammar, as the guided_* fields"},
        "stop": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": MAX_STOP_CHARS},
                           {"type": "array", "items": {"type": "string", "maxLength": MAX_STOP_CHARS},
                            "maxItems": MAX_STOP_STRINGS}]},
        "transfer_mode": {"enum": list(TRANSFER_MODES), "description": "how the KV moves (default: the gateway's)"},
        "selector": {"enum": [*SELECTORS, None],
                     "description": "selective attention (partial, smartgen and auto default by the prompt's length: "
                                    + "; ".join(f"from {d.from_tokens} tokens {d.selector} at {d.kv_budget}"
                                                for d in SELECTIVE_DEFAULTS) + ")"},
        "kv_budget": {"description": "with a selector: a fraction of the cached tokens, or a token count",
                      "anyOf": [{"type": "null"}, {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                                {"type": "integer", "minimum": 1, "maximum": max_positions}]},
        "kv_bits": {"enum": [0, *sorted({*KV_BITS, *PUSH_KV_BITS}), None],
                    "description": f"transfer_mode quantized: its codes, {KV_BITS} (default {DEFAULT_KV_BITS}); smartgen: its "
                                   f"push and reads as {PUSH_KV_BITS}-bit codes (default "
                                   + ", ".join(f"{d.push_bits} from {d.from_tokens} tokens" for d in SELECTIVE_DEFAULTS)
                                   + f"; 0: exact KV); auto: {AUTO_KV_BITS} "
                                   f"lets the broker choose quantized or smartgen's low-bit push (default: exact KV "
                                   f"only, full or smartgen)"},
        "ablate": {"type": "array", "items": {"enum": list(SMARTGEN_PATHS)},
                   "description": "smartgen (or auto) paths to switch off"},
        "ignore_eos": {"type": "boolean", "description": "generate max_tokens even past the end-of-sequence token"},
        "failure_policy": {"enum": list(FAILURE_POLICIES),
                           "description": "when the KV cannot come from the prefill node: fail, or recompute"},
    }}


def _off(values: dict[str, tuple[Any, ...]]) -> dict[str, Schema]:
    """Options not implemented: only the values that mean "off" (or leaving them out)."""
    return {name: {"anyOf": [{"type": "null"}, *({"const": v} for v in off)],
                   "description": "not supported: only this value (or leaving it out) is accepted"}
            for name, off in values.items()}


def _response(kind: str, choice: Schema) -> Schema:
    return _object({"id": _STR, "object": {"const": kind}, "created": _INT, "model": _STR,
                    "choices": {"type": "array", "items": choice}, "usage": _ref("Usage"),
                    "smartgen": _ref("SmartGen")})


def _smartgen_object() -> Schema:
    """The `smartgen` object (docs/api.md, "The `smartgen` object"); only the figures every response has are required."""
    return {"type": "object", "required": ["ttft_s", "token_times_s", "kv_bytes", "transfer_mode", "token_ids"],
            "properties": {
                "ttft_s": _NUMBER_OR_NULL, "ttst_s": _NUMBER_OR_NULL, "tbt_s": _NUMBER_OR_NULL,
                "ttst_bound_s": _NUMBER_OR_NULL, "queue_s": {"type": "number"},
                "token_times_s": {"type": "array", "items": {"type": "number"}},
                "kv_bytes": {"type": "object", "additionalProperties": _INT},
                "transfer_mode": _STR, "requested_mode": _STR, "attention": {"enum": ["dense", "selective"]},
                "token_ids": {"type": "array", "items": _INT}, "prompt_tokens": _INT,
                "plan": {"type": ["object", "null"]}}}


def _read(summary: str, schema: str, unavailable: bool = False) -> Schema:
    responses = {"200": {"description": "OK", "content": {"application/json": {"schema": _ref(schema)}}}}
    if unavailable:
        responses["503"] = {"description": "not ready", "content": {"application/json": {"schema": _ref(schema)}}}
    return {"summary": summary, "operationId": schema[0].lower() + schema[1:], "responses": responses}


def _admin_read(summary: str, schema: str) -> Schema:
    """A GET that needs the admin token (shared/runtime/admin_auth.py): 401 without it, 403 where none is set."""
    refused = {"content": {"application/json": {"schema": _object({"error": _STR})}}}
    operation = _read(summary, schema)
    operation["responses"] |= {"401": {"description": "no or wrong admin token", **refused},
                               "403": {"description": "this gateway has no admin token", **refused}}
    return {**operation, "security": [{"adminToken": []}]}


def _error_answer(why: str) -> Schema:
    return {"description": why, "content": {"application/json": {"schema": _ref("Error")}}}


def _model_read() -> Schema:
    """GET /v1/models/{model_id}: the served model's card; any other id is a 404."""
    operation = _read("One model (the served one; any other id is a 404)", "Model")
    operation["responses"]["404"] = _error_answer("no model of that id is served here")
    return {**operation, "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": _STR}]}


def _post(summary: str, request: str, response: str) -> Schema:
    """A POST that computes its answer on the gateway alone (no worker)."""
    return {"summary": summary, "operationId": request[0].lower() + request[1:].removesuffix("Request"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": _ref(response)}}},
                          "400": _error_answer("the body does not fit this route"),
                          "404": _error_answer("an unknown model")}}


def _generation(summary: str, request: str, response: str) -> Schema:
    def error(why: str, retry: bool = False) -> Schema:
        answer: Schema = {"description": why, "content": {"application/json": {"schema": _ref("Error")}}}
        if retry:
            answer["headers"] = {"Retry-After": {"$ref": "#/components/headers/Retry-After"}}
        return answer

    return {
        "summary": summary, "operationId": request[0].lower() + request[1:].removesuffix("Request"),
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the completion: one JSON body, or server-sent events with `stream`",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _SSE_EVENT}}},
            "400": error("the body does not fit this API (nothing reached a worker)"),
            "404": error("an unknown model"),
            "429": error("the admission queue is full, or holds as many of your client's requests as one client may",
                         retry=True),
            "502": error("a worker failed the request"),
            "503": error("no worker of a needed role is registered", retry=True),
        },
    }
