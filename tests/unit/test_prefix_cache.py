"""The prefill's prefix cache: the pool alone (hash chain, LRU, reference counts, bounds), then the prefill engine
with it on the tiny model (a hit computes only the suffix, yet every layer lands whole and equal)."""
from __future__ import annotations

import pytest
import torch

from schemas import Sampling
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.prefill_engine import PrefillEngine
from shared.compute.prefix_cache import PrefixCache, page_keys

PAGE = 4
LAYERS, HEADS, DIM = 2, 1, 2
PAGE_BYTES = LAYERS * 2 * HEADS * PAGE * DIM * 4  # one page, fp32


def fake_kv(num_tokens: int, seed: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (keys, values) (HEADS, num_tokens, DIM) whose entries name their layer and token."""
    token = torch.arange(num_tokens, dtype=torch.float32)[None, :, None].expand(HEADS, num_tokens, DIM)
    return [(token + 1000 * layer + seed, -token - 1000 * layer - seed) for layer in range(LAYERS)]


def assert_none_held(cache: PrefixCache) -> None:
    assert cache.num_pages_in_use == 0, "a page is still held after every request released its hit"


def test_page_keys_chain_over_every_token_before():
    """Prompts sharing two pages share two keys; a change in page 0 changes every key; a partial page has none."""
    a, b = list(range(10)), list(range(8)) + [99, 99]
    assert len(page_keys(a, PAGE)) == 2  # 10 tokens: two full pages
    assert page_keys(a, PAGE) == page_keys(b, PAGE)
    assert page_keys(a + [5, 6], PAGE)[2] != page_keys(b + [5, 6], PAGE)[2]
    changed = [1] + a[1:]
    assert all(x != y for x, y in zip(page_keys(a, PAGE), page_keys(changed, PAGE)))
    # the same page tokens after a different first page: a different key (the chain, not the page alone)
    assert page_keys([0, 0, 0, 0, 7, 7, 7, 7], PAGE)[1] != page_keys([1, 1, 1, 1, 7, 7, 7, 7], PAGE)[1]


def test_a_hit_returns_the_longest_cached_prefix_and_its_kv():
    """After one prompt is inserted, another sharing its first 9 tokens hits its 2 full pages, with their KV."""
    cache = PrefixCache(10 * PAGE_BYTES, PAGE)
    ids = list(range(11))
    assert cache.insert(ids, fake_kv(11)) == 2  # 11 tokens: pages 0 and 1; the partial third is not kept
    hit = cache.acquire(ids[:9] + [50, 51, 52, 53])
    assert hit.num_tokens == 8
    keys, values = hit.layer_kv(6)[1]
    assert torch.equal(keys, fake_kv(11)[1][0][:, :6]) and torch.equal(values, fake_kv(11)[1][1][:, :6])
    assert (cache.num_queried_tokens, cache.num_hit_tokens) == (13, 8)
    cache.release(hit)
    cache.release(hit)  # idempotent
    assert_none_held(cache)
    miss = cache.acquire([7] + ids[1:])
    assert miss.num_tokens == 0 and cache.num_hit_tokens == 8
    with pytest.raises(ValueError):
        hit.layer_kv(1)  # a released hit holds nothing


def test_whole_prompt_hit_counts_all_but_the_last_token():
    """A prompt cached whole counts N − 1 hit tokens: its last token always runs."""
    cache = PrefixCache(10 * PAGE_BYTES, PAGE)
    cache.insert(list(range(8)), fake_kv(8))
    hit = cache.acquire(list(range(8)))
    assert hit.num_tokens == 8 and cache.num_hit_tokens == 7
    cache.release(hit)


def test_lru_evicts_the_least_recent_and_the_chain_from_its_end():
    """With room for 3 pages, a new prompt's pages evict the least recently used; within a chain, its last pages
    go first, so what stays is still a usable prefix."""
    cache = PrefixCache(3 * PAGE_BYTES, PAGE)
    a, b = [1] * 12, [2] * 4
    cache.insert(a, fake_kv(12))  # a0 a1 a2
    assert cache.num_pages == 3 and cache.num_bytes == 3 * PAGE_BYTES
    cache.insert(b, fake_kv(4))  # evicts a2, the chain's last page
    hit = cache.acquire(a)
    assert hit.num_tokens == 8  # a0 a1 still form a prefix
    cache.release(hit)
    cache.insert([3] * 4, fake_kv(4))  # b is now the least recently used
    assert cache.acquire(b).num_tokens == 0
    assert cache.num_bytes <= cache.capacity_bytes


def test_the_pool_is_allocated_once_and_an_evicted_pages_slot_takes_the_next():
    """Pages live in one tensor of capacity // page slots, allocated at the first insert: however many prompts come
    and go, no page is stored anywhere else, and a page evicted for a new one leaves its slot to it (the values the
    new page reads are its own)."""
    cache = PrefixCache(3 * PAGE_BYTES + PAGE_BYTES // 2, PAGE)  # room for 3 pages, not 4
    cache.insert([0] * 12, fake_kv(12))
    pool = cache._slots
    assert pool is not None and pool.shape[0] == 3
    base, end = pool.data_ptr(), pool.data_ptr() + pool.nbytes
    for prompt in range(1, 40):  # each evicts the least recently used chain's pages
        cache.insert([prompt] * 8, fake_kv(8, seed=prompt))
        assert cache._slots is pool and cache.num_bytes <= cache.capacity_bytes
        hit = cache.acquire([prompt] * 8)
        assert hit.num_tokens == 8 and all(base <= page.data_ptr() < end for page in hit.pages)
        keys, values = hit.layer_kv(8)[1]
        assert torch.equal(keys, fake_kv(8, seed=prompt)[1][0]) and torch.equal(values, fake_kv(8, seed=prompt)[1][1])
        cache.release(hit)
    assert sorted([page.slot for page in cache._pages.values()] + cache._free) == [0, 1, 2]  # each slot once


def test_eviction_never_frees_a_held_page():
    """While a request holds its hit, inserting other prompts evicts nothing of it; insert stops when no room is
    left rather than exceed the bound."""
    cache = PrefixCache(2 * PAGE_BYTES, PAGE)
    a = [1] * 8
    cache.insert(a, fake_kv(8))
    hit = cache.acquire(a)
    assert cache.num_pages_in_use == 2
    assert cache.insert([2] * 8, fake_kv(8)) == 0  # no room: both pages are held
    assert cache.num_bytes == 2 * PAGE_BYTES
    assert torch.equal(hit.layer_kv(8)[0][0], fake_kv(8)[0][0])
    cache.release(hit)
    assert cache.insert([2] * 8, fake_kv(8)) == 2  # released: now they may go
    assert cache.acquire(a).num_tokens == 0
    assert_none_held(cache)  # the acquire above was a miss: it holds nothing


def test_clear_and_bad_settings():
    """clear drops every unheld page; a negative size or a page of 0 tokens is refused."""
    cache = PrefixCache(4 * PAGE_BYTES, PAGE)
    cache.insert([1] * 8, fake_kv(8))
    hit = cache.acquire([1] * 4)
    cache.clear()
    assert cache.num_pages == 1 and cache.num_bytes == PAGE_BYTES  # the held one stays
    cache.release(hit)
    cache.clear()
    assert cache.num_pages == 0 and cache.num_bytes == 0
    for capacity, page in ((-1, PAGE), (PAGE_BYTES, 0)):
        with pytest.raises(ValueError):
            PrefixCache(capacity, page)


# --- the prefill engine with the cache (tiny model) -----------------------------------------------------------
def prefill(engine: PrefillEngine, ids: list[int], sampling: Sampling = Sampling()):
    """Run `ids` into a fresh slab; returns (FirstToken, the slab's KV (L, 2, H, N, D), layers reported)."""
    store = engine.store
    slab = store.allocate("r", len(ids))
    layers: list[int] = []
    try:
        first = engine.run_scored(slab, ids, sampling, layers.append, reuse_prefix=True)
        return first, store.view(slab)[:, :, :, :len(ids)].clone(), layers
    finally:
        store.free("r")


@pytest.fixture(scope="module")
def runner(tiny_model_path):
    return ModelRunner(tiny_model_path)


def engines(runner: ModelRunner, cache_mb: int = 16) -> tuple[PrefillEngine, PrefillEngine]:
    """(without a cache, with one), on fp32 KV stores of 16-token pages."""
    layout = runner.kv_layout(16, "float32")
    return (PrefillEngine(runner, KvStore(layout, 64)),
            PrefillEngine(runner, KvStore(layout, 64), prefix_cache=PrefixCache(cache_mb * 2**20, 16)))


def test_a_hit_computes_the_suffix_and_stores_the_whole_prompt_equal(runner):
    """Two prompts sharing 64 tokens: the second takes 64 from the cache, and its first token and every layer's KV
    in the slab, all 100 tokens, equal those of a prefill without cache (the decode side gets the same bytes)."""
    plain, cached = engines(runner)
    shared = [(37 * i + 5) % runner.vocab_size for i in range(70)]
    ids = shared + [(11 * i + 3) % runner.vocab_size for i in range(30)]
    assert prefill(cached, shared)[0].num_cached_tokens == 0  # fills pages 0–3 (64 tokens; 70 is no full page more)
    first, kv, layers = prefill(cached, ids)
    expected, expected_kv, _ = prefill(plain, ids)
    assert first.num_cached_tokens == 64
    assert layers == list(range(runner.num_layers))
    assert first.token == expected.token
    assert torch.allclose(kv, expected_kv, atol=1e-5)
    assert_none_held(cached.prefix_cache)


def test_a_whole_prompt_hit_still_runs_its_last_token(runner):
    """The same 64-token prompt twice: the second takes 63 tokens from the cache and computes the last one."""
    plain, cached = engines(runner)
    ids = [(13 * i + 1) % runner.vocab_size for i in range(64)]
    prefill(cached, ids)
    first, kv, _ = prefill(cached, ids)
    expected, expected_kv, _ = prefill(plain, ids)
    assert first.num_cached_tokens == 63
    assert first.token == expected.token and torch.allclose(kv, expected_kv, atol=1e-5)


def test_the_hit_is_what_runs(runner):
    """The check above can fail: corrupting the cached pages changes the slab's cached part to those bytes, and
    the computed suffix with them."""
    plain, cached = engines(runner)
    ids = [(37 * i + 5) % runner.vocab_size for i in range(48)]
    prefill(cached, ids[:32])
    for page in cached.prefix_cache._pages.values():
        page.kv += 1.0
    _, kv, _ = prefill(cached, ids)
    _, expected_kv, _ = prefill(plain, ids)
    assert torch.allclose(kv[:, :, :, :32], expected_kv[:, :, :, :32] + 1.0, atol=1e-5)
    assert not torch.allclose(kv[1:, :, :, 32:], expected_kv[1:, :, :, 32:], atol=1e-3)  # layer 0's KV needs no attention


def test_echo_and_a_cache_of_zero_bytes_look_nothing_up(runner):
    """echo with logprobs scores every prompt position, so it computes them all; a cache with no room keeps
    nothing, and both still give the plain prefill's token."""
    plain, cached = engines(runner)
    ids = [(37 * i + 5) % runner.vocab_size for i in range(40)]
    prefill(cached, ids)
    echo = Sampling(logprobs=1, echo=True)
    first, _, _ = prefill(cached, ids, echo)
    assert first.num_cached_tokens == 0 and len(first.prompt_logprobs) == len(ids) - 1
    assert first.token == prefill(plain, ids, echo)[0].token
    _, empty = engines(runner, cache_mb=0)
    prefill(empty, ids)
    assert prefill(empty, ids)[0].num_cached_tokens == 0 and empty.prefix_cache.num_pages == 0


def test_a_past_that_leaves_nothing_to_run_is_refused(runner):
    """ModelRunner.prefill refuses a past as long as the prompt (no position would give logits)."""
    past = [(torch.zeros(runner.num_kv_heads, 4, runner.head_dim),) * 2 for _ in range(runner.num_layers)]
    with pytest.raises(ValueError, match="nothing"):
        runner.prefill([1, 2, 3, 4], past=past)


def test_prefix_cache_setting_is_validated():
    """--prefix-cache-mb: 0 turns the cache off, a negative size is refused with the fix."""
    from services.prefill.config import PrefillConfig
    from shared.runtime.config import ConfigError, load_config

    assert load_config(PrefillConfig, [], {"SMARTGEN_PREFIX_CACHE_MB": "0"}).prefix_cache_mb == 0
    assert load_config(PrefillConfig, [], {}).prefix_cache_mb > 0  # on by default
    with pytest.raises(ConfigError, match="prefix_cache_mb"):
        load_config(PrefillConfig, ["--prefix-cache-mb", "-1"], {})


def test_bench_prefix_prefill_smoke(tiny_model_path):
    """`smartgen bench prefix-prefill` on the tiny model: the hit prompts take the document from the cache and give
    the whole prefill's first token and KV."""
    from tools.bench.prefix_prefill import run

    row = run(str(tiny_model_path), prompt_tokens=128, hit=0.75, repeats=1)
    assert row["hit_tokens"] == [96] and row["first_tokens_equal"] and row["kv_max_abs_diff"] < 1e-2


def test_a_prompt_larger_than_the_pool_keeps_a_usable_prefix():
    """Room for 2 pages, a prompt of 4: its first 2 pages stay (a later prompt hits them), not pages whose earlier
    pages were evicted to make room for them (unreachable: a hit walks the chain from the start)."""
    cache = PrefixCache(2 * PAGE_BYTES, PAGE)
    ids = list(range(4 * PAGE))
    assert cache.insert(ids, fake_kv(len(ids))) == 2
    hit = cache.acquire(ids + [99])
    assert hit.num_tokens == 2 * PAGE
    cache.release(hit)
    assert_none_held(cache)
