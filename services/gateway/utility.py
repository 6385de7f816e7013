"""The gateway's routes that generate nothing: the model list and one model (OpenAI), /tokenize, /detokenize and
/version (vLLM's shapes). Bad bodies get the same OpenAI-style 400 as the generation routes."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from services.gateway.errors import ApiError, error_response
from services.gateway.chat import chat_options, chat_prompt, check_text
from services.gateway.structured import structure_of
from shared import __version__

BODY_TIMEOUT_S = 30.0  # a request body that has not fully arrived after this long: 408 (a slow sender holds no slot)


async def read_json(request: web.Request) -> Any:
    """The request's body, parsed: ApiError 408 if it has not all arrived within BODY_TIMEOUT_S, 400 if it is not
    JSON."""
    try:
        # NOTE: not wait_for, which on Python 3.11 returns the body and drops the cancellation of a client that
        # leaves as its body arrives: the request then ran for nobody (completion.py)
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    try:
        # NOTE: JSON is UTF-8 (json.loads detects UTF-16/32): a made-up charset must not become a 500
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not text, or nested deeper than the parser goes
        raise ApiError(400, "the request body is not valid JSON") from None


def utility_routes(gw) -> list[web.RouteDef]:
    """`gw`: the gateway (api.Gateway)."""
    def model_card() -> dict[str, Any]:
        return {"id": gw.model_id, "object": "model", "created": int(gw.started_unix), "owned_by": "smartgen",
                "max_model_len": gw.max_positions}

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card()]})

    async def model(request: web.Request) -> web.Response:
        if request.match_info["model_id"] != gw.model_id:
            return error_response(_unknown_model(request.match_info["model_id"], gw.model_id))
        return web.json_response(model_card())

    async def tokenize(request: web.Request) -> web.Response:
        try:
            body = await _body(request, gw.model_id)
            ids = tokenized(body, gw.tokenizer)
        except ApiError as exc:
            return error_response(exc)
        answer = {"count": len(ids), "max_model_len": gw.max_positions, "tokens": ids, "token_strs": None}
        if body.get("return_token_strs"):
            answer["token_strs"] = gw.tokenizer.convert_ids_to_tokens(ids)
        return web.json_response(answer)

    async def detokenize(request: web.Request) -> web.Response:
        try:
            body = await _body(request, gw.model_id)
            _only(body, {"model", "tokens"})
            ids = body.get("tokens")
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                    and 0 <= t < len(gw.tokenizer) for t in ids):
                raise ApiError(400, f"tokens must be a list of token ids in 0..{len(gw.tokenizer) - 1}", "tokens")
        except ApiError as exc:
            return error_response(exc)
        return web.json_response({"prompt": gw.tokenizer.decode(ids)})

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    return [web.get("/v1/models", models), web.get(r"/v1/models/{model_id:[\s\S]+}", model),
            web.post("/tokenize", tokenize), web.post("/detokenize", detokenize), web.get("/version", version)]


def tokenized(body: dict[str, Any], tokenizer) -> list[int]:
    """vLLM's /tokenize: a `prompt` (add_special_tokens, default true) or chat `messages` (through the chat
    template: add_generation_prompt, continue_final_message, tools; add_special_tokens, default false)."""
    common = {"model", "add_special_tokens", "return_token_strs"}
    add_special = body.get("add_special_tokens")
    if add_special is not None and not isinstance(add_special, bool):
        raise ApiError(400, "add_special_tokens must be true or false", "add_special_tokens")
    if not isinstance(body.get("return_token_strs", False), (bool, type(None))):
        raise ApiError(400, "return_token_strs must be true or false", "return_token_strs")
    if "messages" in body:
        _only(body, common | {"messages", "add_generation_prompt", "continue_final_message", "tools"})
        tools = structure_of({"tools": body.get("tools"), "tool_choice": "none"}, "chat").tools  # checked
        ids = chat_prompt(body["messages"], tokenizer, tools, *chat_options(body))
        if add_special:  # the template's text with the tokenizer's own special tokens around it, as vLLM does
            ids = list(tokenizer(tokenizer.decode(ids), add_special_tokens=True)["input_ids"])
        return ids
    _only(body, common | {"prompt"})
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string (or send chat messages)", "prompt")
    check_text(prompt, "prompt")
    return list(tokenizer(prompt, add_special_tokens=add_special is not False)["input_ids"])


def _only(body: dict[str, Any], known: set[str]) -> None:
    for name, value in body.items():
        if name not in known and value is not None:
            raise ApiError(400, f"unknown field {name!r} for this route", name, "unknown_parameter")


async def _body(request: web.Request, model_id: str) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") is not None and body["model"] != model_id:
        raise _unknown_model(body["model"], model_id)
    return body


def _unknown_model(name: Any, model_id: str) -> ApiError:
    return ApiError(404, f"The model '{name}' does not exist; this server serves '{model_id}'", "model",
                    "model_not_found")
