"""Structured output on the gateway: `response_format`, `tools` + `tool_choice` and vLLM's `guided_*` → the
llguidance grammar the workers mask the logits with (Sampling.grammar); the generated text → OpenAI's `tool_calls`.

Checked here, so a bad schema is a 400 that touches no worker. The workers compile the grammar text against the
model's tokenizer (shared/compute/grammar.py); the design and the choice of llguidance: docs/structured-output.md.

Tool calls, as vLLM does them without a model-specific parser:
- a named function (`tool_choice: {"type": "function", "function": {"name": …}}`): the grammar is the function's
  parameters schema; the whole answer is its `arguments`.
- `required`: the answer is a JSON list of at least one `{"name": …, "arguments": {…}}`, each name one of the tools
  (at most one item with `parallel_tool_calls: false`).
- `none`: free text (the tools still reach the chat template).
- `auto` (OpenAI's default when tools are given) needs a parser for the model's own tool-call format: a 400.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import llguidance

from services.gateway.errors import ApiError

# NOTE: fixed separators, no free whitespace: a small model left free to emit whitespace can fill max_tokens with it
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 64 * 1024  # a schema (or regex, choice list) travels in every Sampling: keep NATS messages small
MAX_TOOLS = 128
GUIDED = ("json", "regex", "choice", "grammar")  # vLLM's guided_<kind> fields (and structured_outputs' keys)
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class Structure:
    """What a request's answer must look like."""

    grammar: str = ""  # llguidance grammar text ("" = free text)
    tool_mode: str = ""  # "" (content), "named" (the answer is `tool_name`'s arguments) or "required" (a call list)
    tool_name: str = ""
    tools: list[dict] | None = None  # the request's tools, for the chat template


def structure_of(body: dict[str, Any], kind: str) -> Structure:
    """The answer's grammar and tool-call shape from the body's response_format, tools, tool_choice,
    parallel_tool_calls and guided_json / guided_regex / guided_choice. ApiError (400) names the field at fault."""
    tools = _tools(body) if kind == "chat" else None
    if kind != "chat":
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise ApiError(400, f"{name} is for /v1/chat/completions", name)
    grammars = [(name, g) for name, g in _format_grammars(body) if g]
    tool_mode, tool_name, tool_grammar = _tool_choice(body, tools)
    if tool_grammar:
        grammars.append(("tool_choice", tool_grammar))
    if len(grammars) > 1:
        raise ApiError(400, f"{grammars[1][0]} and {grammars[0][0]} each constrain the answer: send one of them",
                       grammars[1][0])
    name, grammar = grammars[0] if grammars else ("", "")
    if grammar:
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise ApiError(400, f"{name}: its grammar is over {MAX_GRAMMAR_CHARS} characters", name)
        if problem := llguidance.LLMatcher.validate_grammar(grammar):
            raise ApiError(400, f"{name} cannot be enforced: {problem}", name)
    return Structure(grammar, tool_mode, tool_name, tools)


def _format_grammars(body: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, grammar) for each output-format field the body sets."""
    out, kinds = [], {}
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            out.append(("response_format", _json_grammar({"type": "object"}, "response_format")))
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict) \
                and isinstance(fmt["json_schema"].get("name", ""), str) \
                and isinstance(fmt["json_schema"].get("description", ""), str) \
                and isinstance(fmt["json_schema"].get("strict", False), (bool, type(None))):
            schema = fmt["json_schema"].get("schema", {})
            out.append(("response_format", _json_grammar(schema, "response_format")))
        elif kind != "text":
            raise ApiError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                                '{"type": "json_schema", "json_schema": {"name": …, "schema": {…}}}', "response_format")
    guided = {f"guided_{kind}": body.get(f"guided_{kind}") for kind in GUIDED}
    outputs = body.get("structured_outputs")  # vLLM's newer spelling: {"json" | "regex" | "choice" | "grammar": …}
    if outputs is not None:
        if not isinstance(outputs, dict) or len(outputs) != 1 or not outputs.keys() <= set(GUIDED):
            raise ApiError(400, f"structured_outputs takes exactly one of {', '.join(GUIDED)}", "structured_outputs")
        guided |= {"structured_outputs": next(iter(outputs.values()), None)}
        kinds = {"structured_outputs": next(iter(outputs), "json")}
    for name, value in guided.items():
        if value is not None:
            out.append((name, _guided(name, kinds.get(name) or name.removeprefix("guided_"), value)))
    return out


def _guided(name: str, kind: str, value: Any) -> str:
    """vLLM's guided decoding: `kind` json (a schema or its text), regex, choice (the answer is one of the strings)
    or grammar (Lark, as vLLM's guidance backend takes it)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ApiError(400, f"{name} must be a JSON schema (an object or its JSON text)", name) from None
        return _json_grammar(value, name)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, f"{name} must be a non-empty list of non-empty strings", name)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str):
        raise ApiError(400, f"{name} must be a string ({'a regular expression' if kind == 'regex' else 'a Lark grammar'})",
                       name)
    return (llguidance.LLMatcher.grammar_from_regex if kind == "regex" else llguidance.LLMatcher.grammar_from_lark)(value)


def _json_grammar(schema: Any, name: str) -> str:
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"{name}: the schema must be a JSON object", name)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise ApiError(400, f"{name}: not a usable JSON schema: {exc}", name) from None


def _tools(body: dict[str, Any]) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)
                and isinstance(function.get("name"), str) and function["name"]
                and isinstance(function.get("parameters", {}), dict)
                and isinstance(function.get("description", ""), str)
                and isinstance(function.get("strict", False), bool)):
            raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{"name": …, "parameters": '
                                '{…JSON schema…}}}}', "tools")
    return tools


def _tool_choice(body: dict[str, Any], tools: list[dict] | None) -> tuple[str, str, str]:
    """(tool_mode, tool_name, grammar) for the body's tool_choice."""
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return "", "", ""
    choice = "auto" if choice is None else choice
    functions = {t["function"]["name"]: t["function"].get("parameters") or NO_PARAMETERS for t in tools}
    if choice == "none":
        return "", "", ""
    if choice == "auto":
        raise ApiError(400, "tool_choice 'auto' (the default when tools are given) needs a parser for this model's own "
                            "tool-call format, which SmartGen does not have: send tool_choice 'required', 'none' or "
                            '{"type": "function", "function": {"name": …}}', "tool_choice")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, parameters in functions.items()]
        schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1} | ({"maxItems": 1} if parallel is False else {})
        return "required", "", _json_grammar(schema, "tools")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or "
                            '{"type": "function", "function": {"name": …}}', "tool_choice")
    if name not in functions:
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return "named", name, _json_grammar(functions[name], "tools")


def tool_calls(structure: Structure, text: str) -> list[dict] | None:
    """OpenAI's `message.tool_calls` for a tool-call answer's text; None when the text holds no complete call (it
    was cut short: max_tokens, a stop string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if structure.tool_mode == "named":
        return [_call(structure.tool_name, text)]
    if not isinstance(value, list) or not all(isinstance(c, dict) and "name" in c for c in value):
        return None
    return [_call(c["name"], json.dumps(c.get("arguments", {}))) for c in value]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """A tool-call answer as stream deltas (`delta.tool_calls`): a named call's arguments as their text comes; a
    `required` list, which is only known to be calls once it is complete, whole at the end."""

    def __init__(self, structure: Structure):
        self.structure = structure
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.num_pieces = 0

    def delta(self, piece: str) -> dict[str, Any]:
        """The delta for one token's text."""
        if self.structure.tool_mode != "named":
            return {}
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
        if self.num_pieces == 0:  # the first delta names the call
            call = {"index": 0, "id": self.call_id, "type": "function",
                    "function": {"name": self.structure.tool_name, "arguments": piece}}
        self.num_pieces += 1
        return {"tool_calls": [call]}

    def finish(self, text: str, tail: str) -> tuple[dict[str, Any], bool]:
        """At the end, given the whole answer's `text` and its `tail` not sent yet: the delta still to send ({} if
        none), and whether the text is complete calls (finish_reason `tool_calls`)."""
        calls = tool_calls(self.structure, text)
        if self.structure.tool_mode == "named":  # its arguments went out piece by piece
            return (self.delta(tail) if tail else {}), calls is not None
        if calls is None:  # cut short (max_tokens, a stop string): the text as it is
            return ({"content": text} if text else {}), False
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}, True
