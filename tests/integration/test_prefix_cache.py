"""The prefill's prefix cache through the real stack (on by default): a prompt seen before computes only its new
tokens, yet every transfer mode gives the same tokens and moves the same KV, and the counts reach the response's
usage and the prefill's /metrics."""
from __future__ import annotations

import urllib.request

import pytest

from tests.integration.conftest import assert_no_leaks, model_workers, post_json
from tests.integration.fault_helpers import admin_post, worker
from tests.reference import greedy_tokens, prompt_ids
from tools.nats_server import free_port
from tools.stack import StackSpec, started_stack

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
    token from the cache, and its plan was sized for that hit; both give the same greedy tokens and move the same KV bytes by path to decode (but in
    full mode, where the decode worker's own prefix cache has the same pages: tests/integration/test_decode_prefix_cache.py)."""
    prompt = f"[{mode}] {DOC} Question: what did the clerks count?"
    n = len(prompt_ids(tiny_model_path, prompt))
    miss = complete(clean_stack, prompt, mode)
    hit = complete(clean_stack, prompt, mode)
    assert cached(miss) == 0
    assert cached(hit) == min(n - 1, (n // PAGE_TOKENS) * PAGE_TOKENS)  # full pages only; the last token runs
    # the gateway expected it (routing.py: it records what each prefill keeps) and the broker sized the plan with it
    assert miss["smartgen"]["plan"]["prefill_cached_tokens"] == 0
    assert hit["smartgen"]["plan"]["prefill_cached_tokens"] == (n // PAGE_TOKENS) * PAGE_TOKENS
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


def test_token_one_leaves_before_the_prompt_is_kept_in_the_cache(tiny_model_path, tmp_path):
    """The prefix cache insertion is off TTFT's path: made 3 s slow (fault injection), a prompt's first token still
    comes back at once (inserted before the reply, as it once was, TTFT would be ≥ 3 s), and the same prompt sent
    next, queued behind the insertion on the torch thread, finds every page of it in the cache."""
    delay_s = 3.0
    spec = StackSpec(model=str(tiny_model_path), gateway_port=free_port(), log_file=tmp_path / "stack.log",
                     env={"SMARTGEN_KV_CACHE_MB": "32", "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_KV_DTYPE": "float32",
                          "SMARTGEN_FAULT_INJECTION": "1"})
    with started_stack(spec, 120) as stack:
        admin_post(stack, worker(stack, "prefill"), "/fault", {"kind": "slow_prefix_insert", "delay_s": delay_s})
        prompt = f"{DOC} Question: how were the ledgers bound?"
        n = len(prompt_ids(tiny_model_path, prompt))
        miss = complete(stack, prompt, "full", max_tokens=2)
        assert cached(miss) == 0
        assert miss["smartgen"]["ttft_s"] < delay_s / 2, miss["smartgen"]["ttft_s"]
        hit = complete(stack, prompt, "full", max_tokens=2)
        assert cached(hit) == min(n - 1, (n // PAGE_TOKENS) * PAGE_TOKENS)
        assert hit["smartgen"]["token_ids"] == miss["smartgen"]["token_ids"]
        admin_post(stack, worker(stack, "prefill"), "/fault", {"kind": "clear"})
        assert_no_leaks(stack)
