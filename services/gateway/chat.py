"""Chat `messages` → the prompt's token ids, through the model's chat template: the roles, text parts, and the turns
of a tool loop (an assistant turn with `tool_calls`, a `tool` turn with the result), checked; a 400 names
`messages` otherwise."""
from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import ApiError

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id"}  # `name` goes to the template as it is


def chat_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """vLLM's add_generation_prompt (default true) and continue_final_message (default false): the template either
    opens the assistant's turn or leaves the last (assistant) message open for the answer to continue."""
    add = body.get("add_generation_prompt")
    add = True if add is None else add
    cont = body.get("continue_final_message")
    cont = False if cont is None else cont
    for name, value in (("add_generation_prompt", add), ("continue_final_message", cont)):
        if not isinstance(value, bool):
            raise ApiError(400, f"{name} must be true or false", name)
    if add and cont:
        raise ApiError(400, "continue_final_message continues the last message: send add_generation_prompt: false",
                       "continue_final_message")
    if cont and not (isinstance(body.get("messages"), list) and body["messages"]
                     and isinstance(body["messages"][-1], dict) and body["messages"][-1].get("role") == "assistant"):
        raise ApiError(400, "continue_final_message needs an assistant message last", "continue_final_message")
    return add, cont


def chat_prompt(messages: Any, tokenizer, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> list[int]:
    """The chat template over `messages` (and the request's `tools`, for a template that shows them)."""
    if messages is None:
        raise ApiError(400, "missing required field 'messages'", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    shows_calls = "tool_calls" in str(getattr(tokenizer, "chat_template", "") or "")
    turns = [_turn(m, i, shows_calls) for i, m in enumerate(messages)]
    options = ({"tools": tools} if tools else {}) | ({"continue_final_message": True} if continue_final_message else {})
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt, **options)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _turn(m: Any, i: int, shows_calls: bool) -> dict[str, Any]:
    """One message as the template takes it. An assistant turn with `tool_calls` may have no content: for a template
    that does not show tool calls (`shows_calls` false), the calls become its content, as the JSON the model wrote."""
    role = m.get("role") if isinstance(m, dict) else None
    calls = m.get("tool_calls") if role == "assistant" else None
    content = m.get("content") if isinstance(m, dict) else None
    if isinstance(m, dict):
        taken = MESSAGE_FIELDS - ({"tool_calls"} if role != "assistant" else set()) - ({"tool_call_id"} if role != "tool" else set())
        extra = [k for k, v in m.items() if v is not None and k not in taken]
        if extra:
            raise ApiError(400, f"messages[{i}].{extra[0]} is not taken on a {role!r} message (fields: role, content, "
                                "name; tool_calls on assistant turns, tool_call_id on tool turns)", "messages")
        if not isinstance(m.get("name", ""), (str, type(None))):
            raise ApiError(400, f"messages[{i}].name must be a string", "messages")
    if role not in ROLES or not (isinstance(content, (str, list)) or (content is None and calls)):
        raise ApiError(400, f"messages[{i}] must be an object with role {'/'.join(ROLES)} and string content (or a "
                            "list of text parts; an assistant turn with tool_calls may have none)", "messages")
    text = "" if content is None else content if isinstance(content, str) else _text_parts(content, i)
    check_text(text, "messages")
    turn: dict[str, Any] = {"role": role, "content": text} | ({"name": m["name"]} if m.get("name") else {})
    if calls is not None:
        turn["tool_calls"] = _calls(calls, i)
        if not text and not shows_calls:
            turn["content"] = json.dumps([c["function"] for c in turn["tool_calls"]])
    if role == "tool" and m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise ApiError(400, f"messages[{i}].tool_call_id must be a string", "messages")
        turn["tool_call_id"] = m["tool_call_id"]
    return turn


def _calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant turn's tool_calls (OpenAI's shape: arguments as JSON text), with arguments parsed, as chat
    templates take them."""
    problem = (f'messages[{i}].tool_calls must be a list of {{"id": …, "type": "function", "function": {{"name": …, '
               '"arguments": "<JSON>"}}')
    if not isinstance(calls, list) or not calls:
        raise ApiError(400, problem, "messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and call.get("type", "function") == "function"
                and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), str)
                and isinstance(call.get("id", ""), str)):
            raise ApiError(400, problem, "messages")
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            raise ApiError(400, f"messages[{i}].tool_calls: arguments must be JSON text", "messages") from None
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
    return out


def _text_parts(parts: list, i: int) -> str:
    """Chat content as a list of parts: the text of its {"type": "text", "text": …} parts, one per line; any other
    part type is a 400 that names it, and so is an empty list."""
    if not parts:
        raise ApiError(400, f"messages[{i}].content is an empty list of parts: give a string or at least one text part",
                       "messages")
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"messages[{i}].content has a part of type {kind!r}: this server takes text parts "
                                '({"type": "text", "text": …}) only', "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def check_text(text: str, param: str) -> None:
    """JSON may escape lone surrogates (\\ud800) that are no Unicode text: the tokenizer cannot take them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} holds a lone surrogate (\\ud800–\\udfff), not Unicode text", param) from None
