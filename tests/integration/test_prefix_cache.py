"""The prefill's prefix cache through the real stack (on by default): a prompt seen before computes only its new
tokens, yet every transfer mode gives the same tokens and moves the same KV, and the counts reach the response's
usage and the prefill's /metrics."""
from __future__ import annotations

import urllib.request

import pytest

from tests.integration.conftest import model_workers, post_json
from tests.reference import greedy_tokens, prompt_ids

DOC = ("The river town kept its records in a stone house by the bridge. Each spring the clerks counted the boats, "
       "the mills and the families, and wrote the numbers in a ledger bound with red thread. In the dry years the "
       "ledger grew thin; in the wet years the river took the lower streets and the clerks wrote of that too. ")
PAGE_TOKENS = 16  # the stack's default page_tokens


def complete(stack, prompt: str, mode: str, max_tokens: int = 12) -> dict:
    status, body = post_json(stack.gateway_url + "/v1/completions",
                             {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "transfer_mode": mode})
    assert status == 200, body
    return body


def cached(body: dict) -> int:
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == body["smartgen"]["cached_tokens"]
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def prefill_metric(stack, name: str) -> float:
    """One prefill worker's counter or gauge (the shared stack has one prefill worker)."""
    (prefill,) = [w for w in model_workers(stack) if w["role"] == "prefill"]
    text = urllib.request.urlopen(prefill["admin_url"] + "/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.mark.parametrize("mode", ["full", "quantized", "partial", "smartgen"])
def test_a_repeated_prompt_hits_and_gives_the_same_tokens(clean_stack, tiny_model_path, mode):
    """The same prompt twice: the first computes all of it (cached_tokens 0), the second takes all but its last
    token from the cache; both give the same greedy tokens and move the same KV bytes by path to decode (but in
    full mode, where the decode worker's own prefix cache has the same pages: tests/integration/test_decode_prefix_cache.py)."""
    prompt = f"[{mode}] {DOC} Question: what did the clerks count?"
    n = len(prompt_ids(tiny_model_path, prompt))
    miss = complete(clean_stack, prompt, mode)
    hit = complete(clean_stack, prompt, mode)
    assert cached(miss) == 0
    assert cached(hit) == min(n - 1, (n // PAGE_TOKENS) * PAGE_TOKENS)  # full pages only; the last token runs
    assert hit["smartgen"]["token_ids"] == miss["smartgen"]["token_ids"]
    if mode == "full":  # the decode worker's own prefix cache had the prompt's pages too: the rest is pushed
        decode_cached = hit["smartgen"]["decode_cached_tokens"]
        assert miss["smartgen"]["decode_cached_tokens"] == 0 and decode_cached == cached(hit)
        assert hit["smartgen"]["kv_bytes"]["full"] * n == miss["smartgen"]["kv_bytes"]["full"] * (n - decode_cached)
    elif mode == "quantized":  # the selective modes' reads depend on timing; their pushes and metadata do not
        assert hit["smartgen"]["kv_bytes"] == miss["smartgen"]["kv_bytes"]
    else:
        assert hit["smartgen"]["kv_bytes"]["metadata"] == miss["smartgen"]["kv_bytes"]["metadata"]


def test_a_shared_prefix_hits_and_matches_generate(clean_stack, tiny_model_path):
    """Two questions over one document, full mode: the second takes the document's full pages from the cache and
    still gives model.generate's tokens; the prefill's counters count exactly those tokens, and its pool holds
    bytes."""
    first, second = (f"[shared] {DOC} Question: {q}" for q in ("what did the clerks count?", "where was the ledger?"))
    ids = prompt_ids(tiny_model_path, second)
    common = next(i for i, (a, b) in enumerate(zip(prompt_ids(tiny_model_path, first), ids)) if a != b)
    queries, hits = (prefill_metric(clean_stack, f"smartgen_prefix_cache_{c}_total") for c in ("queries", "hits"))
    before = complete(clean_stack, first, "full")
    body = complete(clean_stack, second, "full", 16)
    assert cached(before) == 0
    assert cached(body) == (common // PAGE_TOKENS) * PAGE_TOKENS > 0
    assert body["smartgen"]["token_ids"] == greedy_tokens(tiny_model_path, ids, 16)
    queried = len(prompt_ids(tiny_model_path, first)) + len(ids)
    assert prefill_metric(clean_stack, "smartgen_prefix_cache_queries_total") == queries + queried
    assert prefill_metric(clean_stack, "smartgen_prefix_cache_hits_total") == hits + cached(body)
    assert prefill_metric(clean_stack, "smartgen_prefix_cache_bytes") > 0
