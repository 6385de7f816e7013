"""The real SmolLM2 through the whole disaggregated path, on a prompt of over 1,000 tokens: full and colocated
against model.generate, then SmartGen's selective transfer on a slow link against the same selector with all
KV local. The prefill's prefix cache is on: after the first, the prompt's prefills take its pages from it."""
from __future__ import annotations

import time

import pytest

from shared.runtime.admin_auth import admin_headers
from tools.nats_server import free_port
from tools.client import wait_for_broker_pacing
from tools.stack import Stack, StackSpec
from tests.integration.conftest import assert_no_leaks, get_json, model_workers, post_json
from tests.reference import greedy_tokens, prompt_ids

NUM_TOKENS = 12


def long_prompt() -> str:
    """Real text of about 1,300 tokens: a stdlib module's source, then a question about it."""
    import inspect
    import textwrap

    source = inspect.getsource(textwrap)[:5200]
    return f"{source}\n\n# Question: what does the function `dedent` above do?\n# Answer:"


@pytest.mark.real_model
def test_real_model_full_and_colocated_match_generate(real_model_path, tmp_path):
    """Greedy SmolLM2 over >1,000 prompt tokens: full and colocated both give model.generate's tokens."""
    prompt = long_prompt()
    ids = prompt_ids(real_model_path, prompt)
    assert len(ids) >= 1000
    expected = greedy_tokens(real_model_path, ids, NUM_TOKENS)
    log_file = tmp_path / "stack.log"
    # NOTE: fp32 KV: the tokens are held against plain transformers, which keeps its cache in fp32
    spec = StackSpec(gateway_port=free_port(), log_file=log_file, env={"SMARTGEN_KV_CACHE_MB": "256",
                                                                       "SMARTGEN_KV_DTYPE": "float32"})
    with Stack(spec) as stack:
        try:
            stack.wait_ready(240)
            for mode in ("full", "colocated"):
                status, body = post_json(stack.gateway_url + "/v1/completions",
                                         {"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0,
                                          "transfer_mode": mode}, timeout=300)
                assert status == 200, body
                sg = body["smartgen"]
                print(f"{mode}: prompt {sg['prompt_tokens']} tokens, TTFT {sg['ttft_s']:.3f} s, "
                      f"TTST {sg['ttst_s']:.3f} s, TBT {sg['tbt_s']:.3f} s, kv_bytes {sg['kv_bytes']}")
                assert sg["token_ids"] == expected, mode
            # the prefix cache (on by default): the prompt again takes all its full pages from the prefill's cache
            # and computes the rest, with generate's tokens still (the runs after this one hit it too)
            status, again = post_json(stack.gateway_url + "/v1/completions", {"prompt": prompt, "max_tokens": NUM_TOKENS,
                                      "temperature": 0, "transfer_mode": "full"}, timeout=300)
            assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) - 16, again
            assert again["smartgen"]["token_ids"] == expected
            print(f"full with {again['smartgen']['cached_tokens']} cached tokens: prefill {again['smartgen']['prefill_s']:.3f} s")
            assert_no_leaks(stack)
            check_concurrent_requests(stack, real_model_path, prompt, expected)
            assert_no_leaks(stack)
            check_smartgen_on_a_slow_link(stack, prompt)
            assert_no_leaks(stack)
            check_prepared_selectors(stack, prompt)
            assert_no_leaks(stack)
        except BaseException:
            print(log_file.read_text()[-4000:])
            raise


def check_concurrent_requests(stack: Stack, model_path, prompt: str, expected: list[int]) -> None:
    """Four requests at once: their prefills queue on the one prefill worker for several heartbeats (none may be
    taken for lost meanwhile) and each gets generate's tokens. (Steps sharing forward passes is checked in
    test_end_to_end.py: 12 tokens decode faster than the next prefill here.)"""
    import concurrent.futures

    short = prompt[:2600]
    short_expected = greedy_tokens(model_path, prompt_ids(model_path, short), NUM_TOKENS)
    prompts = [prompt, short, prompt, short]
    decode = next(w for w in model_workers(stack) if w["role"] == "decode")
    before = get_json(decode["admin_url"] + "/stats")["batching"]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: post_json(stack.gateway_url + "/v1/completions",
                                                    {"prompt": p, "max_tokens": NUM_TOKENS, "temperature": 0,
                                                     "transfer_mode": "full"}, timeout=300), prompts))
    after = get_json(decode["admin_url"] + "/stats")["batching"]
    print(f"4 concurrent requests in {time.monotonic() - started:.1f} s; "
          f"{after['batches'] - before['batches']} decode forward passes for {4 * (NUM_TOKENS - 1)} steps")
    assert [status for status, _ in results] == [200] * 4, results
    assert [body["smartgen"]["token_ids"] for _, body in results] == [expected, short_expected] * 2


def check_prepared_selectors(stack: Stack, prompt: str) -> None:
    """`make test` (like `make up`) prepares infinigen and hata for the default model: both work on their first
    request, and smartgen on the slow link decodes exactly their all-local tokens, token-level selections (many
    scattered reads per layer) included."""
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "kv_budget": 0.1}
    for selector in ("infinigen", "hata"):
        status, local = post_json(stack.gateway_url + "/v1/completions",
                                  body | {"selector": selector, "transfer_mode": "colocated"}, timeout=300)
        assert status == 200 and local["smartgen"]["attention"] == "selective", (selector, local)
        status, smart = post_json(stack.gateway_url + "/v1/completions",
                                  body | {"selector": selector, "transfer_mode": "smartgen", "kv_bits": 0}, timeout=300)
        assert status == 200, (selector, smart)
        assert smart["smartgen"]["token_ids"] == local["smartgen"]["token_ids"], selector
        assert smart["smartgen"]["kv_bytes"]["on_demand"] > 0, selector


def check_smartgen_on_a_slow_link(stack: Stack, prompt: str) -> None:
    """Pace the links so the full KV takes ~4× the prefill (R ≈ 4): smartgen with quest at 10% decodes exactly
    the tokens of quest with all KV local, though most of what it selects starts on the prefill node, and
    its TTST stays far below what a full transfer would stall."""
    prefill = next(w for w in model_workers(stack) if w["role"] == "prefill")
    rate = get_json(prefill["admin_url"] + "/stats")["prefill_tokens_per_s"]  # measured by the runs above
    gbps = 46080 * 8 * rate / 4 / 1e9  # KV bits per token × tokens/s ÷ R
    for w in model_workers(stack):
        status, _ = post_json(w["admin_url"] + "/link", {"gbps": gbps}, headers=admin_headers(stack.admin_token))
        assert status == 200
    wait_for_broker_pacing(stack.gateway_url, gbps, stack.admin_token)
    body = {"prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "selector": "quest", "kv_budget": 0.1}
    _, local = post_json(stack.gateway_url + "/v1/completions", body | {"transfer_mode": "colocated"}, timeout=300)
    status, smart = post_json(stack.gateway_url + "/v1/completions", body | {"transfer_mode": "smartgen", "kv_bits": 0},
                              timeout=300)
    assert status == 200, smart
    sg = smart["smartgen"]
    print(f"smartgen at {gbps * 1e3:.1f} Mbit/s: TTFT {sg['ttft_s']:.3f} s, TTST {sg['ttst_s']:.3f} s, "
          f"TBT {sg['tbt_s']:.3f} s, kv_bytes {sg['kv_bytes']}, step-1 local share {sg['step_local_share'][0]:.2f}")
    assert sg["token_ids"] == local["smartgen"]["token_ids"]
    assert min(sg["step_local_share"]) < 1.0 and sg["kv_bytes"]["on_demand"] > 0  # (step 1 may be: the exact push)
    full_transfer_s = sg["prompt_tokens"] * 46080 * 8 / (gbps * 1e9)
    assert sg["ttst_s"] < 0.5 * full_transfer_s
    # The query-aware push: the prefill sends what its last prompt position selects, which step 1 mostly
    # selects again; the same budget spent on profile blocks instead finds far less of step 1's selection local.
    # Both without reading ahead on predictions (`ahead`), which would hide what the push brought.
    def ask(ablate: list[str], selector: str = "quest") -> dict:
        status, reply = post_json(stack.gateway_url + "/v1/completions",
                                  body | {"transfer_mode": "smartgen", "kv_bits": 0, "ablate": ablate, "selector": selector},
                                  timeout=300)
        assert status == 200, reply
        return reply["smartgen"]

    by_query, po = ask(["ahead"]), ask(["query", "ahead"])
    assert by_query["token_ids"] == po["token_ids"] == sg["token_ids"]
    print(f"step-1 local share: query-aware push {by_query['step_local_share'][0]:.2f} "
          f"({by_query['plan']['query_tokens']} tokens per KV head), profile blocks only {po['step_local_share'][0]:.2f}")
    assert by_query["plan"]["query_tokens"] > 0 and po["plan"]["query_tokens"] == 0
    assert by_query["step_local_share"][0] >= 0.6 and by_query["step_local_share"][0] > po["step_local_share"][0] + 0.15
    # Speculation (InfiniGen: its selection is its query speculated from the layer before, so decode can read it a
    # layer early): more of step 1's selection has landed by the time each layer attends, tokens unchanged
    plain, speculating = ask(["query", "ahead"], "infinigen"), ask(["query"], "infinigen")
    print(f"infinigen step-1 local share: {plain['step_local_share'][0]:.2f}, speculating "
          f"{speculating['step_local_share'][0]:.2f} (reads {speculating['reads']} against {plain['reads']})")
    assert speculating["token_ids"] == plain["token_ids"]
    assert speculating["reads"]["speculative"] > 0 and plain["reads"]["speculative"] == 0
    assert speculating["reads"]["fetch"] < plain["reads"]["fetch"]
    assert speculating["step_local_share"][0] > plain["step_local_share"][0]
