"""The fast selective step (issue #33) selects exactly what the reference selects (selectors/reference.py, the
code before it): the same indices per KV head for every selector and the floor, the same gathered entries, the
same attention output, and the same greedy tokens on a tiny model."""
from __future__ import annotations

import pytest
import torch

from schemas import BudgetFloor, Sampling
from shared.compute import floor as budget_floor, gather, selective
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import Geometry, make_selector
from shared.compute.selectors import reference
from shared.compute.selectors.hata import HataSelector, pack_codes
from shared.compute.selectors.infinigen import InfiniGenSelector
from tests.reference import prompt_ids
from tools import prepare_selectors
from tools.tiny_model import make_tiny_model

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 8


def _selectors(geometry: Geometry):
    gen = torch.Generator().manual_seed(1)
    d, h = geometry.head_dim, geometry.num_kv_heads
    skew = {layer: torch.linalg.qr(torch.randn(h, d, d, generator=gen))[0] for layer in range(geometry.num_layers)}
    channels = {layer: torch.randperm(d, generator=gen)[: d // 4].expand(h, -1).contiguous()
                for layer in range(geometry.num_layers)}
    return [make_selector("quest", geometry), make_selector("positional", geometry), make_selector("oracle", geometry),
            HataSelector(geometry), HataSelector(geometry, num_bits=72),  # 72 bits: not whole words (byte table)
            InfiniGenSelector(geometry, skew, channels)]


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 2), (8, 2), (4, 4), (14, 2)])
@pytest.mark.parametrize("n", [37, 300, 1030])
def test_select_matches_reference(heads, kv_heads, n):
    """Every selector's `select`, with and without the floor, is index for index the reference's."""
    geometry = Geometry(num_layers=3, num_heads=heads, num_kv_heads=kv_heads, head_dim=64, page_tokens=16)
    gen = torch.Generator().manual_seed(n + heads)
    keys = torch.randn(kv_heads, n, 64, generator=gen)
    for selector in _selectors(geometry):
        state = selector.new_state(2)
        selector.extend(2, state, keys[:, : n - 5])
        selector.extend(2, state, keys)  # incremental, as decode steps append
        for trial in range(4):
            query = torch.randn(heads, 64, generator=gen) * (1 + trial)
            for k in (1, 7, n // 10, n // 3, n):
                got, want = selector.select(2, state, query, k), reference.select(selector, 2, state, query, k)
                assert torch.equal(got, want), (selector.name, k)
                for floor in (BudgetFloor(min_tokens=1, dense_below=0, sinks=4, recent=32),
                              BudgetFloor(min_tokens=1, dense_below=0, sinks=0, recent=0)):
                    got = selective.select_with_floor(selector, 2, state, query, k, n, floor)
                    assert torch.equal(got, reference.select_with_floor(selector, 2, state, query, k, n, floor))


def test_ties_and_zero_query_channels_match_reference():
    """Quest's bound (one product on the side of the query's sign) and HATA's planes agree with the reference where
    it is hardest: query channels that are exactly ±0, pages and codes that tie, keys with exact zeros."""
    geometry = Geometry(num_layers=3, num_heads=9, num_kv_heads=3, head_dim=64, page_tokens=16)
    gen = torch.Generator().manual_seed(7)
    n = 16 * 40 + 5
    keys = torch.randn(3, n, 64, generator=gen)
    keys[:, 16:32] = keys[:, 48:64]  # two identical pages: equal bounds
    keys[:, 100:200:3] = 0.0
    for selector in (make_selector("quest", geometry), HataSelector(geometry)):
        state = selector.new_state(2)
        selector.extend(2, state, keys[:, : n - 1])
        selector.extend(2, state, keys)
        for trial in range(6):
            query = torch.randn(9, 64, generator=gen)
            query[:, ::5] = 0.0
            query[:, 1::7] = -0.0
            if trial % 2:
                query = query.round()  # coarse values: many equal products and scores
            for k in (16, 64, 200):
                assert torch.equal(selector.select(2, state, query, k), reference.select(selector, 2, state, query, k))
                floor = BudgetFloor(min_tokens=1, dense_below=0, sinks=4, recent=32)
                assert torch.equal(selective.select_with_floor(selector, 2, state, query, k, n, floor),
                                   reference.select_with_floor(selector, 2, state, query, k, n, floor))


def test_hata_codes_are_pack_codes():
    """HATA's extend (a bmm and numpy's packbits on CPU) keeps exactly pack_codes's codes, which the prefill node
    pushes; the word-major copy select reads holds the same bits."""
    geometry = Geometry(num_layers=3, num_heads=9, num_kv_heads=3, head_dim=64)
    selector = HataSelector(geometry)
    keys = torch.randn(3, 300, 64, generator=torch.Generator().manual_seed(3))
    keys[:, ::11] = 0.0
    state = selector.new_state(2)
    for stop in (200, 201, 202, 300):  # a prompt, then a token at a time, then a chunk
        selector.extend(2, state, keys[:, :stop])
        assert torch.equal(state.codes.data, pack_codes(keys[:, :stop], selector.weights[2]))
        selector.select(2, state, torch.randn(9, 64), 20)
        words = state.words.data.view(3, 2, stop).transpose(1, 2).contiguous().view(torch.uint8)
        assert torch.equal(words, state.codes.data)


def test_floor_tops_up_short_rows_like_the_reference():
    """Rows of different lengths after adding sinks and recent: topped up with their most recent free tokens."""
    gen = torch.Generator().manual_seed(0)
    for n in (50, 64, 333):
        for _ in range(20):
            k = int(torch.randint(3, n // 2, (1,), generator=gen))
            idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(3)]).sort(1).values
            idx[0, : k // 2] = torch.arange(k // 2)  # overlaps the sinks on one row only
            idx[1, -(k // 3):] = torch.arange(n - k // 3, n)  # and the recent window on another
            idx = idx.sort(1).values
            for sinks, recent in ((4, 32), (0, 8), (3, 0), (4, n)):
                want = reference.with_sinks_and_recent(idx, n, sinks, recent)
                assert torch.equal(budget_floor._with_sinks_and_recent(idx, n, sinks, recent), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_and_attention_match_reference(dtype):
    """One index_select into a buffer gathers what torch.gather did; SDPA with enable_gqa over it gives the
    repeat_interleave'd result bit for bit."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 700, 64, generator=gen).to(dtype)  # (H_kv, capacity, d), a slab layer
    keys, values = rows[:, :613], torch.randn(3, 700, 64, generator=gen).to(dtype)[:, :613]
    idx = torch.stack([torch.randperm(613, generator=gen)[:90] for _ in range(3)]).sort(1).values
    buf = keys.new_empty(400, 64)
    got = gather.gather_rows(keys, idx, buf)
    want = torch.gather(keys, 1, idx[..., None].expand(-1, -1, 64))
    assert torch.equal(got, want) and got.data_ptr() == buf.data_ptr()
    assert torch.equal(gather.gather_rows(values, idx), torch.gather(values, 1, idx[..., None].expand(-1, -1, 64)))
    query = torch.randn(1, 9, 1, 64, generator=gen)
    k_sel, v_sel = want.float(), torch.gather(values, 1, idx[..., None].expand(-1, -1, 64)).float()
    reference_out = torch.nn.functional.scaled_dot_product_attention(
        query, k_sel.repeat_interleave(3, 0)[None], v_sel.repeat_interleave(3, 0)[None], scale=0.125)
    fast = torch.nn.functional.scaled_dot_product_attention(query, got.float()[None],
                                                            gather.gather_rows(values, idx).float()[None],
                                                            scale=0.125, enable_gqa=True)
    assert torch.equal(fast, reference_out)


def _slab_rows(arena: torch.Tensor, first: int, n: int, capacity: int = 700) -> tuple[torch.Tensor, torch.Tensor]:
    """A slab layer's (K, V) views (3, n, 64) at element `first` of a flat arena, laid out as the KV store lays
    them out: (K|V, head, capacity, d)."""
    layer = arena[first: first + 2 * 3 * capacity * 64].view(2, 3, capacity, 64)
    return layer[0, :, :n], layer[1, :, :n]


@pytest.mark.parametrize("one_arena", [True, False])
def test_rows_gathered_together_are_each_rows_own_gather(one_arena):
    """`SelectedRows` gathers several rows' selections in one index_select over their shared arena (or row by row
    where they share none, as caches copied to an accelerator one request each) and casts once: each row's K and V
    equal its own gather, cast; rows of one width that lie side by side form one (rows, H_kv, k, d) block."""
    gen = torch.Generator().manual_seed(1)
    arena = torch.randn(5 * 2 * 3 * 700 * 64, generator=gen).to(torch.bfloat16)
    spots = [(3, 613), (0, 250), (1, 613), (4, 99)]  # (slab, tokens): widths 90, 40, 90, 20
    views = [_slab_rows(arena if one_arena else arena.clone(), slab * 2 * 3 * 700 * 64, n) for slab, n in spots]
    idx = [torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(3)]).sort(1).values
           for (_, n), k in zip(spots, (90, 40, 90, 20))]
    order = [0, 2, 1, 3]  # widest first, as the decode step takes them
    selected = gather.SelectedRows()
    for _ in range(2):  # the second call reuses the buffers
        rows = selected.gather([views[r][0] for r in order], [views[r][1] for r in order], [idx[r] for r in order],
                               torch.float32)
        for r, (k_sel, v_sel) in zip(order, rows):
            assert k_sel.dtype == torch.float32
            assert torch.equal(k_sel, gather.gather_rows(views[r][0], idx[r]).float())
            assert torch.equal(v_sel, gather.gather_rows(views[r][1], idx[r]).float())
    same_dtype = selected.gather([views[1][0]], [views[1][1]], [idx[1]], torch.bfloat16)  # one row, no cast
    assert torch.equal(same_dtype[0][0], gather.gather_rows(views[1][0], idx[1]))
    assert torch.equal(same_dtype[0][1], gather.gather_rows(views[1][1], idx[1]))
    rows = selected.gather([views[r][0] for r in order], [views[r][1] for r in order], [idx[r] for r in order],
                           torch.float32)
    both = gather.block(rows[:2])
    assert both is not None and torch.equal(both[0], torch.stack([rows[0][0], rows[1][0]]))
    assert torch.equal(both[1], torch.stack([rows[0][1], rows[1][1]]))
    assert gather.block(rows[1:3]) is None  # two widths
    assert gather.block([rows[0], rows[2]]) is None  # not side by side


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, real_model_path):
    folder = tmp_path_factory.mktemp("tiny-fast")
    make_tiny_model(folder, tokenizer_from=real_model_path)
    prep = folder / "prep"
    prepare_selectors.run(str(folder), "all", num_prompts=1, prompt_tokens=256, out_dir=prep)
    floor = BudgetFloor(min_tokens=8, dense_below=0, sinks=4, recent=8)
    runner = ModelRunner(folder)
    return DecodeEngine(runner, KvStore(runner.kv_layout(16), 64), prep, floor), prompt_ids(folder, PROMPT)


def _decode(engine, ids, selector, steps, log):
    tokens = [engine.prefill_local("r", ids, Sampling())]
    engine.use_selection("r", selector, 0.1)
    for i in range(1, steps):
        tokens.append(engine.step("r", tokens[-1], Sampling(), i))
    engine.end("r")
    return tokens


@pytest.mark.parametrize("selector", ["quest", "hata", "infinigen", "positional", "oracle"])
def test_greedy_tokens_and_selections_match_reference(tiny, selector, monkeypatch):
    """The tiny model decodes the same greedy tokens, selecting the same indices at every layer and step, with the
    fast selection as with the reference one."""
    engine, ids = tiny
    runs = {}
    for name, choose in (("fast", selective.select_with_floor), ("reference", reference.select_with_floor)):
        log: list[torch.Tensor] = []

        def recording(*args, choose=choose, log=log):
            idx = choose(*args)
            log.append(idx.clone())
            return idx
        monkeypatch.setattr(selective, "select_with_floor", recording)
        runs[name] = (_decode(engine, ids, selector, 10, log), log)
    (fast_tokens, fast_log), (ref_tokens, ref_log) = runs["fast"], runs["reference"]
    assert fast_tokens == ref_tokens
    assert len(fast_log) == len(ref_log) > 0
    assert all(torch.equal(a, b) for a, b in zip(fast_log, ref_log))


@pytest.mark.parametrize("lengths", [(700, 700, 700), (700, 333, 1030, 64)])
def test_rows_selected_together_match_rows_alone(lengths):
    """A batched step's rows that select together (`select_rows_with_floor`: one mask, one `mark_rows`, one nonzero)
    get each row's own `select_with_floor` indices: equal contexts and budgets (Quest's one top-k for all rows), and
    rows of different lengths and budgets, with and without a floor (a head short of its row topped up)."""
    geometry = Geometry(num_layers=3, num_heads=9, num_kv_heads=3, head_dim=64, page_tokens=16)
    gen = torch.Generator().manual_seed(sum(lengths))
    for selector in _selectors(geometry):
        if selector.ranks_tokens and isinstance(selector, InfiniGenSelector):
            continue  # it speculates its query: it never selects together
        states = []
        for n in lengths:
            states.append(selector.new_state(2))
            selector.extend(2, states[-1], torch.randn(3, n, 64, generator=gen))
        probes = torch.randn(len(lengths), 9, 64, generator=gen)
        for fraction in (0.05, 0.1, 0.3):
            ks = [max(1, int(fraction * n)) + (r if len(set(lengths)) > 1 else 0) for r, n in enumerate(lengths)]
            for floor in (BudgetFloor(min_tokens=1, dense_below=0, sinks=4, recent=32, stick=0.0),
                          BudgetFloor(min_tokens=1, dense_below=0, sinks=0, recent=0, stick=0.0)):
                together = budget_floor.select_rows_with_floor(selector, 2, states, probes, ks, list(lengths), floor)
                for r, n in enumerate(lengths):
                    alone = selective.select_with_floor(selector, 2, states[r], probes[r], ks[r], n, floor)
                    assert torch.equal(together[r], alone), (selector.name, n, ks[r], floor)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_quest_bounds_token_by_token_stay_bounds(kv_dtype):
    """Quest's bounds extended a decode step's token at a time (its two in-place ops into the partial page, keys as
    the store keeps them) still contain every page's keys; the pages the first, bulk extend rounded are the bounds of
    the same keys taken at once (later pages differ by rounding: every node extends in the same order, so alike)."""
    geometry = Geometry(num_layers=3, num_heads=9, num_kv_heads=3, head_dim=64, page_tokens=16, kv_dtype=kv_dtype)
    selector = make_selector("quest", geometry)
    keys = torch.randn(3, 300, 64, generator=torch.Generator().manual_seed(5)).to(kv_dtype)
    stepped, whole = selector.new_state(2), selector.new_state(2)
    selector.extend(2, stepped, keys[:, :250])
    for n in range(251, 301):  # across three page boundaries
        selector.extend(2, stepped, keys[:, :n])
    selector.extend(2, whole, keys)
    assert stepped.num_tokens == whole.num_tokens == 300
    full = 250 // 16
    assert torch.equal(stepped.page_min.data[:, :full], whole.page_min.data[:, :full])
    assert torch.equal(stepped.page_max.data[:, :full], whole.page_max.data[:, :full])
    pages = torch.cat([keys, keys[:, -1:].expand(-1, 4, -1)], dim=1).float().view(3, 19, 16, 64)
    assert bool((stepped.page_min.data <= pages.amin(dim=2)).all())
    assert bool((stepped.page_max.data >= pages.amax(dim=2)).all())
