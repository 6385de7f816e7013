"""A 4-turn chat in full mode on two decode workers (issue #36): the gateway sends every turn to the decode worker that
holds the conversation so far, each turn moves only the KV of its new tokens, and each answer is plain transformers'
greedy answer to the turn's prompt."""
from __future__ import annotations

import time
from pathlib import Path

from transformers import AutoTokenizer

from services.gateway.chat import chat_prompt
from tests.integration.conftest import NO_FLOOR_ENV, assert_no_leaks, open_stream, post_json
from tests.reference import greedy_tokens
from tools.nats_server import free_port
from tools.stack import Stack, StackSpec, started_stack

PAGE_TOKENS = 16  # the stacks' default page_tokens
TOKEN_BYTES = 4 * 2 * 2 * 16 * 4  # the tiny model, fp32 KV: layers × K,V × KV heads × head dim × 4 bytes
QUESTIONS = ["Tell me about the lighthouse keeper who lived on the northern cape.",
             "What did she keep in the small wooden box by the lamp?",
             "Why did the ships stop coming after the storm of that winter?",
             "How does the story end, and who tells it now?"]
ENV = {"SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_KV_DTYPE": "float32", **NO_FLOOR_ENV}


def start(tiny_model_path: Path, tmp_path: Path, num_decode: int, env: dict[str, str]):
    spec = StackSpec(model=str(tiny_model_path), num_decode=num_decode, gateway_port=free_port(),
                     log_file=tmp_path / "stack.log", env={**ENV, **env})
    return started_stack(spec, 180)


def chat(stack: Stack, messages: list[dict]) -> dict:
    status, body = post_json(stack.gateway_url + "/v1/chat/completions",
                             {"messages": messages, "max_tokens": 24, "temperature": 0, "transfer_mode": "full"})
    assert status == 200, body
    return body


def conversation(stack: Stack) -> list[dict]:
    """The four turns, each asking with every turn before it and its answer; per turn the response, with the
    messages it was asked with under "asked"."""
    messages: list[dict] = []
    turns = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        body = chat(stack, messages)
        turns.append({**body, "asked": list(messages)})
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return turns


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_each_turn_moves_only_its_new_tokens_to_the_decode_worker_that_has_the_rest(tiny_model_path, tmp_path):
    """Turn 1 goes to the less loaded decode worker (the other one is busy); turns 2–4 follow it there though the
    other is as idle and first by id (the least-loaded rule alone would move them). Each turn after the first finds
    the conversation's previous prompt in that worker's pool but its partial last page, and moves ≤ 1.1 × the KV of
    its new tokens (the previous answer and the new question) plus a page. Each answer is model.generate's for the
    turn's prompt."""
    with start(tiny_model_path, tmp_path, 2, {}) as stack:
        busy = {"prompt": "a long story", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "transfer_mode": "full"}
        with open_stream(stack.gateway_url + "/v1/completions", busy) as events:
            next(iter(events))  # it runs on the first decode worker by id (both idle: ties go by id)
            first = chat(stack, [{"role": "user", "content": QUESTIONS[0]}])  # hence: the other one
        time.sleep(2.5)  # the stream closed (its request aborted) and the heartbeats say both are idle again
        turns = conversation(stack)
        assert_no_leaks(stack)
    assert turns[0]["smartgen"]["decode_worker_id"] == first["smartgen"]["decode_worker_id"]  # turn 1 cached before
    assert len({t["smartgen"]["decode_worker_id"] for t in turns}) == 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    # each turn's answer is plain transformers' greedy answer to the prompt it was asked with (fp32 KV, as here)
    assert [t["smartgen"]["token_ids"] for t in turns] == [
        greedy_tokens(tiny_model_path, chat_prompt(t["asked"], tokenizer), 24) for t in turns]
    for k in range(1, len(turns)):
        before, now = turns[k - 1], turns[k]
        held = chat_prompt(before["asked"], tokenizer)  # the KV the worker kept: the previous prompt's
        ids = chat_prompt(now["asked"], tokenizer)
        n, cached = len(ids), now["smartgen"]["decode_cached_tokens"]
        assert n == now["usage"]["prompt_tokens"]
        same = common_prefix(held, ids)  # where this prompt parts from the one before (the template re-rendering it)
        new = n - len(held)  # the tokens new in this turn: the previous answer, the new question, the template's
        print(f"turn {k + 1}: prompt {n}, held {len(held)}, same as held {same}, cached {cached}, new {new}, "
              f"moved {now['smartgen']['kv_bytes']['full']} B ({n - cached} tokens)")
        assert cached == same // PAGE_TOKENS * PAGE_TOKENS  # every full page the worker holds of this prompt
        assert now["smartgen"]["kv_bytes"] == {"full": (n - cached) * TOKEN_BYTES}
        assert now["smartgen"]["kv_bytes"]["full"] <= 1.1 * new * TOKEN_BYTES + PAGE_TOKENS * TOKEN_BYTES


def test_bench_conversation_smoke(tiny_model_path):
    """`smartgen bench conversation` on the tiny model, 2 turns: turn 2 finds turn 1's prompt cached on the decode
    worker and the prefill with the caches on, moves less than with them off, and both stacks give the same tokens."""
    from tools.bench.conversation import run

    rows = run(str(tiny_model_path), 2, 4, 8, 0.0)
    assert [row["tokens_equal"] for row in rows] == [True, True]
    second = rows[1]
    assert second["on"]["decode_cached_tokens"] > 0 and second["off"]["decode_cached_tokens"] == 0
    assert second["on"]["cached_tokens"] > 0 and second["off"]["cached_tokens"] == 0  # `--off all`: the prefill's too
    assert 0 < second["on"]["kv_mb"] < second["off"]["kv_mb"]
