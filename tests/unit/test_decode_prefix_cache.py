"""The decode side's prefix cache: the shortened push both ends compute, the prefill refusing a hit it cannot honour,
and the decode engine keeping a finished request's prompt's pages and copying them into a new slab."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from schemas import KvHandle, Prefill, Sampling, mode_of, pushed_bytes, pushed_runs
from services.prefill.checks import prefill_problem
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore, layout_for
from shared.compute.modeling import ModelRunner
from shared.compute.prefix_cache import PrefixCache

LAYOUT = layout_for(num_layers=4, num_kv_heads=2, head_dim=8, page_tokens=16, dtype=torch.float32)
N = 40


def test_full_pushes_only_the_rows_past_the_decode_hit():
    """With 32 tokens cached on decode, full pushes rows 32…39 of every layer and decode waits for exactly those."""
    assert pushed_runs(mode_of("full"), None, LAYOUT, N, cached_tokens=32) == [[(32, N)]] * LAYOUT.num_layers
    assert pushed_bytes(mode_of("full"), None, LAYOUT, N, 0, cached_tokens=32) == (N - 32) * LAYOUT.token_bytes
    with pytest.raises(AssertionError):  # no other mode takes a decode-side hit
        pushed_runs(mode_of("quantized"), None, LAYOUT, N, cached_tokens=32)


@pytest.mark.parametrize("mode, cached", [("quantized", 16), ("full", N), ("full", -1)])
def test_prefill_refuses_a_hit_it_cannot_honour(mode, cached):
    """A handle's cached_tokens outside full mode, or not fewer than the prompt's tokens, is a 400 that names it."""
    handle = KvHandle("r", "d", "x:1", 1, LAYOUT, N, 0, 64, cached_tokens=cached)
    runner = SimpleNamespace(token_problem=lambda ids: "")
    problem = prefill_problem(Prefill("r", list(range(N)), mode, Sampling(), handle, kv_bits=4 if mode == "quantized" else 0),
                              runner, LAYOUT)
    assert "cached_tokens" in problem


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    return ModelRunner(tiny_model_path)


def test_a_finished_request_leaves_its_prompts_pages_and_the_next_copies_them(runner):
    """A request of 40 prompt tokens and 10 completion tokens leaves its prompt's two full pages (32 tokens) in the
    pool, not its completion's; a prompt that starts with those 40 tokens and the completion gets 32 copied into its
    slab, equal to the first request's rows, none held afterwards; a prompt of exactly 32 of them gets 31 (its last
    token is always pushed); another first token finds nothing."""
    store = KvStore(runner.kv_layout(16, "float32"), 64)
    engine = DecodeEngine(runner, store, prefix_cache=PrefixCache(16 * 2**20, 16))
    prompt = [(7 * i) % runner.vocab_size for i in range(40)]
    tokens = [engine.prefill_local("a", prompt, Sampling(), max_new_tokens=16)]
    for index in range(1, 10):
        tokens.append(engine.step("a", tokens[-1], Sampling(), index))
    rows = store.view(store.slab("a"))[:, :, :, :32].clone()
    engine.end("a", keep=prompt)
    assert engine.prefix_cache.num_pages == 2 and not store.request_ids
    ids = prompt + tokens
    slab = store.allocate("b", len(ids))
    assert engine.reuse_prefix(slab, ids) == 32
    assert torch.equal(store.view(slab)[:, :, :, :32], rows)
    assert engine.prefix_cache.num_pages_in_use == 0
    store.free("b")
    slab = store.allocate("c", 32)
    assert engine.reuse_prefix(slab, ids[:32]) == 31
    assert engine.reuse_prefix(slab, [9] + ids[1:32]) == 0


@pytest.mark.parametrize("token_ids, expected", [(list(range(N - 1)), "token ids, not"), ([-1] * N, "token_ids:")])
def test_decode_refuses_token_ids_that_are_not_the_prompt(token_ids, expected):
    """OpenKv.token_ids of another length than num_tokens, or outside the vocabulary, is a 400 before anything is
    reserved; none at all is fine (no lookup)."""
    from schemas import OpenKv
    from services.decode.admission import open_problem

    runner = SimpleNamespace(max_positions=4096, token_problem=lambda ids: "ids outside the vocabulary"
                             if min(ids) < 0 else "")
    assert expected in open_problem(OpenKv("r", N, 8, "full", token_ids=token_ids), runner)
    assert open_problem(OpenKv("r", N, 8, "full"), runner) == ""
