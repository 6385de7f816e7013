"""OpenAI request bodies → a validated CompletionJob, or an ApiError (400/404) that touches no worker."""
from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from schemas import (AUTO_KV_BITS, DEFAULT_KV_BITS, DEFAULT_KV_BUDGET, FAILURE_POLICIES, KV_BITS, PUSH_KV_BITS,
                     SELECTORS, SMARTGEN_PATHS, TRANSFER_MODES, kv_budget_problem, mode_of, modes_where,
                     selective_default)
from schemas.subjects import is_token
from services.gateway.errors import ApiError  # noqa: F401 (routes import it from here)
from services.gateway.chat import chat_options, chat_prompt, check_text
from services.gateway.fields import check_fields
from services.gateway.structured import Structure, structure_of

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_CHARS = 256  # per stop string: the stop check costs O(this) per token on the gateway's event loop
MAX_PROMPTS = 32  # choices a body may ask for (a completions list of prompts × n), each a job
MAX_SEED = 2**63 - 1  # seeds travel as msgpack integers (and seed torch generators)
MAX_TOP_K = 2**31 - 1  # any top_k past the vocabulary means no limit; beyond this it could not travel (msgpack)
MAX_REQUEST_ID_CHARS = 128  # an X-Request-Id becomes the request id, which goes into NATS subjects
MAX_LOGIT_BIAS = 1024  # entries of a logit_bias map
MAX_REPETITION_PENALTY = 10.0
MAX_LOGPROBS = 20  # OpenAI's limit on (top_)logprobs alternatives


@dataclass
class CompletionJob:
    request_id: str
    kind: str  # "completion" or "chat"
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stop: list[str]
    stream: bool
    transfer_mode: str
    selector: str | None
    kv_budget: float | None
    kv_bits: int = 0  # quantized
    ablate: list[str] = field(default_factory=list)  # smartgen paths switched off
    ignore_eos: bool = False  # generate max_tokens even past the end-of-sequence token (benchmarks)
    failure_policy: str = "fail"  # when the KV cannot come from the prefill node: fail, or recompute on decode
    include_usage: bool = False  # stream_options.include_usage: a last chunk with `choices: []` and the usage
    logprobs: int = -1  # ≥ 0: each token's log-probability and this many alternatives (completions `logprobs`,
                        # chat `logprobs` + `top_logprobs`)
    echo: bool = False  # completions: the prompt comes back before the completion (with its logprobs, if asked)
    top_p: float = 1.0  # nucleus sampling (1 = off)
    top_k: int = 0  # top-k sampling (0 = off; -1, vLLM's "off", is taken as 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = field(default_factory=dict)  # token id → added to its logit
    min_p: float = 0.0  # vLLM: drop tokens less likely than min_p × the most likely (at temperature > 0)
    min_tokens: int = 0  # vLLM: no end token (EOS, stop_token_ids) before this many completion tokens
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM: more token ids that end the answer
    include_stop_str_in_output: bool = False  # vLLM: a matched stop string stays at the end of the text
    structure: Structure = field(default_factory=Structure)  # response_format, tools: the answer's grammar and shape
    noted: dict[str, Any] = field(default_factory=dict)  # user, metadata, …: fields for the log line (fields.py)
    arrival: float = field(default_factory=time.monotonic)  # t0 of every latency figure
    created: int = field(default_factory=lambda: int(time.time()))


def parse_jobs(body: Any, kind: str, tokenizer, max_positions: int, model_id: str, default_mode: str,
               default_max_tokens: int, default_selector: str = "",
               request_id: str | None = None) -> list[CompletionJob]:
    """Several jobs when the body asks for several choices: a completions `prompt` that is a list of several texts
    or of several token-id lists, and/or `n` > 1 (both routes). Choice p·n + j is the j-th answer to prompt p,
    request id `<id>-<p·n + j>`; with a `seed`, answer j samples with seed + j (answer 0 is what n = 1 gives).
    Any other body is one job (`parse_job`)."""
    if not isinstance(body, dict):
        return [parse_job(body, kind, tokenizer, max_positions, model_id, default_mode, default_max_tokens,
                          default_selector, request_id)]
    n = 1 if body.get("n") is None else body["n"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_PROMPTS:
        raise ApiError(400, f"n must be an integer from 1 to {MAX_PROMPTS}", "n")
    prompts = body.get("prompt") if kind == "completion" else None
    several = (isinstance(prompts, list) and len(prompts) > 1
               and (all(isinstance(p, str) for p in prompts) or all(isinstance(p, list) for p in prompts)))
    if not several and n == 1:
        return [parse_job(body, kind, tokenizer, max_positions, model_id, default_mode, default_max_tokens,
                          default_selector, request_id)]
    if (len(prompts) if several else 1) * n > MAX_PROMPTS:
        raise ApiError(400, f"prompts × n may be at most {MAX_PROMPTS} choices", "n" if n > 1 else "prompt")
    base = request_id or f"cmpl-{uuid.uuid4().hex[:24]}"
    if len(base) > MAX_REQUEST_ID_CHARS - 3:
        raise ApiError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS - 3} characters with several choices",
                       "X-Request-Id")
    seed = body.get("seed")
    derive = isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= MAX_SEED
    jobs = []
    for p, prompt in enumerate(prompts if several else [body.get("prompt")]):
        for j in range(n):
            one = {**body, "n": 1} | ({"prompt": prompt} if several else {}) | ({"seed": (seed + j) % (MAX_SEED + 1)} if derive else {})
            jobs.append(parse_job(one, kind, tokenizer, max_positions, model_id, default_mode, default_max_tokens,
                                  default_selector, f"{base}-{p * n + j}"))
    return jobs


def parse_job(body: Any, kind: str, tokenizer, max_positions: int, model_id: str, default_mode: str,
              default_max_tokens: int, default_selector: str = "",
              request_id: str | None = None) -> CompletionJob:
    """`default_max_tokens` applies when the body has none (capped by the context left after the prompt);
    `default_selector` when a selective mode (partial, smartgen, auto) names none ("": by the prompt's length,
    schemas' SELECTIVE_DEFAULTS, as are the budget and smartgen's kv_bits a request leaves out); `request_id` is the client's
    X-Request-Id, if it sent one (else a fresh id)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if request_id is not None and (len(request_id) > MAX_REQUEST_ID_CHARS or not is_token(request_id)):
        raise ApiError(400, f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} letters, digits, '-' or '_'",
                       "X-Request-Id")
    model = body.get("model")
    if model is not None and model != model_id:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{model_id}'", "model", "model_not_found")
    noted = check_fields(body, kind)
    structure = structure_of(body, kind)
    if kind == "chat":
        prompt_ids = chat_prompt(body.get("messages"), tokenizer, structure.tools, *chat_options(body))
    else:
        prompt_ids = _completion_prompt(body.get("prompt"), tokenizer)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    prompt_ids = _truncated(prompt_ids, body.get("truncate_prompt_tokens"), max_positions)

    room = max_positions - len(prompt_ids)
    if room < 1:
        raise ApiError(400, f"This model's maximum context length is {max_positions} tokens; the prompt has "
                            f"{len(prompt_ids)} tokens", "prompt", "context_length_exceeded")
    given = {name: body[name] for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None}
    for name, value in given.items():  # NOTE: both checked, so that max_tokens cannot hide a bad alias
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= room:
            raise ApiError(400, f"{name} must be an integer from 1 to {room} (the context left after the prompt)",
                           name, "context_length_exceeded" if isinstance(value, int) and value > room else None)
    max_tokens = next(iter(given.values()), min(default_max_tokens, room))  # max_tokens first, as before

    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature <= 2 \
            or math.isnan(temperature):
        raise ApiError(400, "temperature must be a number from 0 to 2", "temperature")
    seed = body.get("seed")
    if seed is None:
        seed = uuid.uuid4().int % 2**31
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"seed must be an integer from 0 to {MAX_SEED}", "seed")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, above=True)
    top_k = body.get("top_k")
    top_k = 0 if top_k is None or top_k == -1 else top_k
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise ApiError(400, f"top_k must be an integer from 1 to {MAX_TOP_K} (or 0 or -1: no limit)", "top_k")
    penalties = {"presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
                 "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                 "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY, above=True)}
    logit_bias = _logit_bias(body.get("logit_bias"), len(tokenizer))
    min_p = _number(body, "min_p", 0.0, 0.0, 1.0)
    stop_token_ids = body.get("stop_token_ids")
    stop_token_ids = [] if stop_token_ids is None else stop_token_ids
    if not isinstance(stop_token_ids, list) or len(stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < len(tokenizer) for t in stop_token_ids):
        raise ApiError(400, f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids below "
                            f"{len(tokenizer)}", "stop_token_ids")
    include_stop = body.get("include_stop_str_in_output")
    include_stop = False if include_stop is None else include_stop
    if not isinstance(include_stop, bool):
        raise ApiError(400, "include_stop_str_in_output must be true or false", "include_stop_str_in_output")
    n = body.get("n", 1)
    if isinstance(n, bool) or n not in (1, None):  # NOTE: parse_jobs turns n > 1 into n jobs of n = 1
        raise ApiError(400, f"n must be an integer from 1 to {MAX_PROMPTS}", "n")  # parse_jobs splits n > 1 into jobs
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and (not isinstance(stream_options, dict) or not stream
                                       or not isinstance(stream_options.get("include_usage", False), bool)):
        raise ApiError(400, "stream_options goes with stream: true, as {\"include_usage\": true|false}",
                       "stream_options")

    logprobs, echo = _logprobs_and_echo(body, kind)
    if echo and stream:
        raise ApiError(400, "echo is not supported with stream: true", "echo")

    stop = body.get("stop")
    stop = [] if stop is None else stop
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"each stop string may have at most {MAX_STOP_CHARS} characters", "stop")

    mode = body.get("transfer_mode", default_mode)
    if mode not in TRANSFER_MODES:
        raise ApiError(400, f"transfer_mode {mode!r} is not one of {', '.join(TRANSFER_MODES)}", "transfer_mode")
    spec = mode_of(mode)
    selector = body.get("selector")
    if selector is not None and selector not in SELECTORS:
        raise ApiError(400, f"selector {selector!r} is not one of {', '.join(SELECTORS)}", "selector")
    kv_budget = body.get("kv_budget")
    if kv_budget is not None and kv_budget_problem(kv_budget, max_positions):
        raise ApiError(400, kv_budget_problem(kv_budget, max_positions), "kv_budget")
    by_length = selective_default(len(prompt_ids))  # what the fields left out default to at this prompt's length
    if selector is None and spec.needs_selector:
        selector = default_selector or by_length.selector
    if kv_budget is not None and selector is None:
        raise ApiError(400, f"kv_budget needs a selector (one of {', '.join(SELECTORS)})", "kv_budget")
    if selector is not None and kv_budget is None:
        kv_budget = by_length.kv_budget if selector == by_length.selector else DEFAULT_KV_BUDGET
    if selector is not None and not spec.allows_selector:
        raise ApiError(400, f"{mode} transfer decodes densely over the dequantized KV; drop the selector", "selector")
    # quantized: its codes' width (default 4); smartgen: its push and reads' width (default 8; 0 asks for exact KV)
    push_bits = by_length.push_bits if spec.default_push_bits else 0
    kv_bits = body.get("kv_bits", DEFAULT_KV_BITS if spec.kv_bits else push_bits or None)
    exact_asked = kv_bits == 0 and bool(spec.push_bits) and not isinstance(kv_bits, bool)
    if kv_bits is not None and not exact_asked and (not isinstance(kv_bits, int) or isinstance(kv_bits, bool)
                                                    or kv_bits not in spec.kv_bits + spec.push_bits):
        codes, pushes = modes_where(kv_bits=KV_BITS), modes_where(push_bits=PUSH_KV_BITS)
        raise ApiError(400, f"kv_bits is one of {KV_BITS} for transfer_mode {' or '.join(map(repr, codes))} (its codes)"
                            f" or of {PUSH_KV_BITS} for {' or '.join(map(repr, pushes))} (its push and reads; 0 for "
                            f"exact KV) or {AUTO_KV_BITS} for 'auto' (consent to low-bit KV: quantized or a low-bit "
                            f"push; exact without it)", "kv_bits")
    ablate = body.get("ablate", [])
    if not isinstance(ablate, list) or not all(isinstance(p, str) and p in SMARTGEN_PATHS for p in ablate):
        raise ApiError(400, f"ablate must be a list of paths to switch off, from {', '.join(SMARTGEN_PATHS)}", "ablate")
    if ablate and not spec.has_paths:
        names = " or ".join(repr(name) for name in modes_where(has_paths=True))
        raise ApiError(400, f"ablate switches off paths of transfer_mode {names}", "ablate")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError(400, "ignore_eos must be true or false", "ignore_eos")
    min_tokens = body.get("min_tokens")
    min_tokens = 0 if min_tokens is None else min_tokens
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
        raise ApiError(400, f"min_tokens must be an integer from 0 to max_tokens ({max_tokens})", "min_tokens")
    if min_tokens and structure.grammar:  # a complete answer allows nothing but its end, which min_tokens forbids
        raise ApiError(400, "min_tokens cannot be combined with structured output (response_format, tools, guided_*)",
                       "min_tokens")
    failure_policy = body.get("failure_policy", FAILURE_POLICIES[0])
    if failure_policy not in FAILURE_POLICIES:
        raise ApiError(400, f"failure_policy {failure_policy!r} is not one of {', '.join(FAILURE_POLICIES)}",
                       "failure_policy")

    return CompletionJob(request_id=request_id or f"cmpl-{uuid.uuid4().hex[:24]}", kind=kind, prompt_ids=prompt_ids,
                         max_tokens=max_tokens, temperature=float(temperature), seed=seed, stop=stop, stream=stream,
                         include_usage=bool(stream_options and stream_options.get("include_usage")),
                         transfer_mode=mode, selector=selector,
                         kv_budget=float(kv_budget) if kv_budget is not None else None,
                         kv_bits=kv_bits or 0, ablate=sorted(set(ablate)), ignore_eos=ignore_eos,
                         failure_policy=failure_policy, logprobs=logprobs, echo=echo, top_p=top_p, top_k=top_k,
                         logit_bias=logit_bias, min_p=min_p, min_tokens=min_tokens,
                         stop_token_ids=sorted(set(stop_token_ids)), include_stop_str_in_output=include_stop,
                         structure=structure, noted=noted,
                         **penalties)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, above: bool = False) -> float:
    """body[name] as a float in [low, high] (`above`: in (low, high]), `default` if absent or null; else a 400
    naming it."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (low < value if above else low <= value) or not value <= high:  # NaN fails both comparisons
        raise ApiError(400, f"{name} must be a number {'above' if above else 'from'} {low:g} "
                            f"{'and at most' if above else 'to'} {high:g}", name)
    return float(value)


def _logit_bias(value: Any, vocab_size: int) -> dict[str, float]:
    """OpenAI's `logit_bias`, checked: {token id (a string, decimal, no leading zero): bias from -100 to 100}, at most
    MAX_LOGIT_BIAS entries; absent, null or {} means none."""
    if value is None:
        return {}
    problem = (f"logit_bias maps token ids (strings of 0..{vocab_size - 1}) to numbers from -100 to 100, "
               f"at most {MAX_LOGIT_BIAS} of them")
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise ApiError(400, problem, "logit_bias")
    for key, bias in value.items():
        # NOTE: the length first (int() refuses over 4,300 digits), the range before NaN (isnan overflows on 10**400)
        if not (isinstance(key, str) and len(key) <= len(str(vocab_size)) and re.fullmatch(r"0|[1-9][0-9]*", key)
                and int(key) < vocab_size) or isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:  # NaN fails every comparison
            raise ApiError(400, problem, "logit_bias")
    return {key: float(bias) for key, bias in value.items()}


def _logprobs_and_echo(body: dict, kind: str) -> tuple[int, bool]:
    """How many alternatives each token's log-probability comes with (-1: none), and echo."""
    def count(name: str) -> int:
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise ApiError(400, f"{name} must be an integer from 0 to {MAX_LOGPROBS}", name)
        return value

    if kind == "chat":
        wants = body.get("logprobs", False)
        if not isinstance(wants, bool):
            raise ApiError(400, "logprobs must be true or false (chat); top_logprobs gives the alternatives", "logprobs")
        if body.get("top_logprobs") is not None and not wants:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        if body.get("echo") is not None and body.get("echo") is not False:
            raise ApiError(400, "echo is for /v1/completions", "echo")
        return (count("top_logprobs") if body.get("top_logprobs") is not None else 0) if wants else -1, False
    if body.get("top_logprobs") is not None:
        raise ApiError(400, "top_logprobs is for chat: completions take logprobs as the number of alternatives",
                       "top_logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise ApiError(400, "echo must be true or false", "echo")
    return (count("logprobs") if body.get("logprobs") is not None else -1), echo


def _completion_prompt(prompt: Any, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < len(tokenizer) for t in prompt):
            raise ApiError(400, f"prompt token ids must be in 0..{len(tokenizer) - 1}", "prompt")
        return list(prompt)
    if prompt is None:
        raise ApiError(400, "missing required field 'prompt'", "prompt")
    raise ApiError(400, "prompt must be a string, a list of token ids, or a list of either", "prompt")


def _truncated(prompt_ids: list[int], keep: Any, max_positions: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: only the prompt's last `keep` tokens (absent or null: all of them)."""
    if keep is None:
        return prompt_ids
    if isinstance(keep, bool) or not isinstance(keep, int) or not 1 <= keep <= max_positions:
        raise ApiError(400, f"truncate_prompt_tokens must be an integer from 1 to {max_positions}", "truncate_prompt_tokens")
    return prompt_ids[-keep:]
