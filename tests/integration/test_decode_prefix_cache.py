"""The decode side's prefix cache through the real stack (on by default): a full-mode request that starts like one
the decode worker finished takes those pages from its pool, the prefill pushes only the rest, the tokens stay the
same, and the bytes, the response and the decode's /metrics say so."""
from __future__ import annotations

import urllib.request

from tests.integration.conftest import model_workers, post_json
from tests.reference import greedy_tokens, prompt_ids

PAGE_TOKENS = 16  # the stack's default page_tokens
TOKEN_BYTES = 4 * 2 * 2 * 16 * 4  # the tiny model, fp32 KV: layers × K,V × KV heads × head dim × 4 bytes
DOC = ("The harbour master kept a ledger of every ship that came in: its name, its cargo, the weather it met and the "
       "day it left again. Some years the ledger filled before midsummer and a second book was bound. ")


def complete(stack, prompt: str, mode: str = "full", max_tokens: int = 12) -> dict:
    status, body = post_json(stack.gateway_url + "/v1/completions",
                             {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "transfer_mode": mode})
    assert status == 200, body
    return body["smartgen"]


def decode_metric(stack, name: str) -> float:
    """The decode worker's counter or gauge (the shared stack has one decode worker)."""
    (decode,) = [w for w in model_workers(stack) if w["role"] == "decode"]
    text = urllib.request.urlopen(decode["admin_url"] + "/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_a_repeated_prompt_moves_only_what_decode_lacks(clean_stack, tiny_model_path):
    """The same full-mode prompt twice: the second takes the prompt's full pages (never its last token) from the
    decode's pool, the prefill pushes only the rows past them, the greedy tokens are model.generate's both times,
    and the decode's counters count the lookup and the hit."""
    prompt = f"[repeat] {DOC} What did the ledger hold?"
    ids = prompt_ids(tiny_model_path, prompt)
    n = len(ids)
    queries, hits = (decode_metric(clean_stack, f"smartgen_decode_prefix_cache_{c}_total") for c in ("queries", "hits"))
    miss, hit = complete(clean_stack, prompt), complete(clean_stack, prompt)
    cached = min(n - 1, n // PAGE_TOKENS * PAGE_TOKENS)
    assert (miss["decode_cached_tokens"], hit["decode_cached_tokens"]) == (0, cached) and cached > 0
    assert miss["kv_bytes"] == {"full": n * TOKEN_BYTES}
    assert hit["kv_bytes"] == {"full": (n - cached) * TOKEN_BYTES}
    assert miss["token_ids"] == hit["token_ids"] == greedy_tokens(tiny_model_path, ids, 12)
    assert decode_metric(clean_stack, "smartgen_decode_prefix_cache_queries_total") == queries + 2 * n
    assert decode_metric(clean_stack, "smartgen_decode_prefix_cache_hits_total") == hits + cached
    assert decode_metric(clean_stack, "smartgen_decode_prefix_cache_bytes") > 0


def test_a_continuation_reuses_the_prompt_but_not_the_completion(clean_stack, tiny_model_path):
    """A prompt that is an earlier prompt plus its greedy answer: the decode's pool has the earlier prompt's full
    pages, not the answer's (a decode step's KV is not bit for bit a prefill's), so the rest is pushed, and the
    tokens are still model.generate's."""
    prompt = f"[continue] {DOC} Another ledger"
    ids = prompt_ids(tiny_model_path, prompt)
    first = complete(clean_stack, prompt, max_tokens=24)
    follow = ids + first["token_ids"] + ids[:20]
    status, body = post_json(clean_stack.gateway_url + "/v1/completions",
                             {"prompt": follow, "max_tokens": 12, "temperature": 0, "transfer_mode": "full"})
    assert status == 200, body
    sg = body["smartgen"]
    assert sg["decode_cached_tokens"] == len(ids) // PAGE_TOKENS * PAGE_TOKENS > 0
    assert sg["kv_bytes"] == {"full": (len(follow) - sg["decode_cached_tokens"]) * TOKEN_BYTES}
    assert sg["token_ids"] == greedy_tokens(tiny_model_path, follow, 12)


def test_other_modes_take_no_decode_hit(clean_stack):
    """quantized (and every mode but full) moves all of the prompt as before, however often it was seen."""
    prompt = f"[quantized] {DOC}"
    complete(clean_stack, prompt, "full")
    again = complete(clean_stack, prompt, "quantized")
    twice = complete(clean_stack, prompt, "quantized")
    assert again["decode_cached_tokens"] == twice["decode_cached_tokens"] == 0
    assert again["kv_bytes"] == twice["kv_bytes"] and again["token_ids"] == twice["token_ids"]
