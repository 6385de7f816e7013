"""KV selectors and selective attention: full budget is dense, metadata is what it declares, selection is
deterministic, and oracle keeps the most attention mass (on the real model)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from schemas import NO_FLOOR, Sampling
from shared.compute.decode_engine import DecodeEngine
from shared.compute.selectors import SELECTORS, Geometry, PreparationMissing, make_selector
from shared.compute.kvstore import KvStore
from shared.compute.selectors.metadata import MetadataLayout
from shared.compute.modeling import ModelRunner
from tools.tiny_model import make_tiny_model
from tests.reference import prompt_ids
from tools import prepare_selectors

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n" * 8


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def prepared(request, tmp_path_factory, real_model_path) -> tuple[Path, Path]:
    """A tiny random model of each architecture, with infinigen and hata prepared for it."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny_model(folder, tokenizer_from=real_model_path, model_type=request.param)
    prep = folder / "prep"
    prepare_selectors.run(str(folder), "all", num_prompts=1, prompt_tokens=256, out_dir=prep)
    return folder, prep


@pytest.fixture(scope="module")
def engine(prepared) -> tuple[DecodeEngine, list[int]]:
    """A decode engine on the prepared tiny model, and a prompt for it."""
    folder, prep = prepared
    runner = ModelRunner(folder)
    return DecodeEngine(runner, KvStore(runner.kv_layout(16), 64), prep, NO_FLOOR), prompt_ids(folder, PROMPT)


def decode(engine: DecodeEngine, ids: list[int], n: int, selector: str | None, budget: float) -> list[int]:
    tokens = [engine.prefill_local("r", ids, Sampling())]
    if selector:
        engine.use_selection("r", selector, budget)
    for i in range(1, n):
        tokens.append(engine.step("r", tokens[-1], Sampling(), i))
    engine.end("r")
    return tokens


@pytest.mark.parametrize("selector", SELECTORS)
def test_full_budget_reproduces_dense(engine, selector):
    """At 100% budget every selector decodes exactly the dense tokens (Llama and Qwen3 layouts)."""
    engine, ids = engine
    assert decode(engine, ids, 12, selector, 1.0) == decode(engine, ids, 12, None, 0)


@pytest.mark.parametrize("selector", SELECTORS)
def test_small_budget_changes_the_computation(engine, selector):
    """The check above can fail: with 4 tokens of context kept, logits differ from dense."""
    engine, ids = engine
    engine.prefill_local("a", ids, Sampling())
    engine.caches["b"] = copy.deepcopy(engine.caches["a"])
    engine.use_selection("b", selector, 4)
    dense, sparse = engine.step_logits("a", 5), engine.step_logits("b", 5)
    assert not torch.allclose(dense, sparse, atol=1e-4)
    assert engine.selections["b"].selected_share < 0.2
    engine.end("a")
    engine.end("b")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("selector", SELECTORS)
def test_metadata_size_is_what_it_declares(prepared, selector, kv_dtype):
    """Per cached token and layer, the metadata a selector exports (what the prefill node pushes) is exactly
    the bytes it declares, in the shapes and dtypes of its specs, with the KV kept in fp32 or (as served) bf16."""
    _, prep = prepared
    geometry = Geometry(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, page_tokens=16, kv_dtype=kv_dtype)
    sel = make_selector(selector, geometry, prep)
    state = sel.new_state(2)
    n = 160  # a whole number of pages
    sel.extend(2, state, torch.randn(2, n, 16).to(kv_dtype).float())  # keys as the KV store keeps them
    exported = sel.export(state)
    assert [(tuple(t.shape), t.dtype) for t in exported] == sel.metadata_specs(n)
    assert sum(t.numel() * t.element_size() for t in exported) == pytest.approx(sel.metadata_bytes_per_token() * n)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("selector", SELECTORS)
def test_metadata_round_trip_selects_the_same(prepared, selector, kv_dtype):
    """State exported into an aux buffer and restored on the other side (then extended by decoded tokens)
    selects exactly what the original state selects: what makes metadata pushes exact (with bf16 KV too, where
    InfiniGen's partial keys travel in bf16: rounded alike on both sides). Quest's bounds travel as 8-bit codes
    rounded outward (test_quest_bounds_travel_as_outward_codes): on this data they select the same pages."""
    _, prep = prepared
    geometry = Geometry(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, page_tokens=16, kv_dtype=kv_dtype)
    gen = torch.Generator().manual_seed(3)
    keys, query = torch.randn(2, 107, 16, generator=gen).to(kv_dtype).float(), torch.randn(4, 16, generator=gen)
    sel = make_selector(selector, geometry, prep)
    here = sel.new_state(3)
    sel.extend(3, here, keys[:, :100])
    layout = MetadataLayout(sel, 4, 100)
    aux = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.write(aux, 3, sel.export(here))
    there = sel.restore(3, layout.read(aux, 3), 100)
    aux.fill_(0)  # restore copied: the buffer may be reused
    for state in (here, there):
        sel.extend(3, state, keys)  # 7 decoded tokens, one partial page for quest
    assert torch.equal(sel.select(3, here, query, 30), sel.select(3, there, query, 30))
    if selector == "infinigen":  # what it holds is what travels: values of the KV's dtype
        assert torch.equal(there.partial_keys.data, there.partial_keys.data.to(kv_dtype).float())


@pytest.mark.parametrize("selector", SELECTORS)
def test_selection_is_deterministic(prepared, selector):
    """The same keys and query give the same indices, from fresh state; rows are sorted and in range."""
    _, prep = prepared
    geometry = Geometry(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, page_tokens=16)
    keys, query = torch.randn(2, 100, 16, generator=torch.Generator().manual_seed(1)), torch.randn(4, 16)
    picks = []
    for _ in range(2):
        sel = make_selector(selector, geometry, prep)
        state = sel.new_state(3)
        sel.extend(3, state, keys)
        picks.append(sel.select(3, state, query, 20))
    assert torch.equal(picks[0], picks[1])
    idx = picks[0]
    assert idx.shape[0] == 2 and idx.shape[1] <= 20 and int(idx.max()) < 100
    assert torch.equal(idx, torch.sort(idx, dim=-1).values)


def test_infinigen_without_preparation_names_the_command(tmp_path):
    """A missing offline preparation is an error that says which command makes it, for hata too: random
    projections only when asked for by name (`hata_untrained`), never as a silent fallback."""
    geometry = Geometry(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
    for name in ("infinigen", "hata"):
        with pytest.raises(PreparationMissing, match="smartgen model prepare"):
            make_selector(name, geometry, tmp_path)
    assert make_selector("hata_untrained", geometry, tmp_path).is_trained is False


@pytest.mark.real_model
def test_oracle_keeps_the_most_attention_mass(real_model_path, tmp_path):
    """On SmolLM2, over the same teacher-forced steps at a 10% budget, no selector keeps more attention mass
    than oracle."""
    runner = ModelRunner(real_model_path)
    prep = tmp_path / "prep"
    # NOTE: infinigen only; hata runs untrained (random projections) here: its training takes a minute on CPU
    prepare_selectors.run(str(real_model_path), "infinigen", num_prompts=1, prompt_tokens=512, out_dir=prep)
    engine = DecodeEngine(runner, KvStore(runner.kv_layout(16), 64), prep, NO_FLOOR)
    import inspect
    import json as json_module

    ids = prompt_ids(real_model_path, inspect.getsource(json_module.decoder))[:700]
    prompt, continuation = ids[:640], ids[640:]
    _, cache = runner.prefill(prompt)
    mass = {}
    for selector in [s for s in SELECTORS if s != "hata"]:  # hata_untrained stands in: hata's training takes a minute
        engine.caches["r"] = copy.deepcopy(cache)
        engine.use_selection("r", selector, 0.1, measure_mass=True)
        for token in continuation[:6]:
            engine.step_logits("r", token)
        mass[selector] = engine.end("r").attention_mass
    assert all(mass["oracle"] >= m - 1e-6 for m in mass.values()), mass
    assert mass["oracle"] > mass["positional"] + 0.01, mass


def test_quest_never_selects_nothing():
    """At a page boundary with a budget under one page, quest still keeps a page (an empty selection would
    make attention output zeros)."""
    geometry = Geometry(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, page_tokens=16)
    sel = make_selector("quest", geometry)
    state = sel.new_state(2)
    sel.extend(2, state, torch.randn(2, 32, 16))
    idx = sel.select(2, state, torch.randn(4, 16), 3)
    assert idx.shape == (2, 16)


def test_keycodes_is_the_oracle_over_two_bit_keys():
    """keycodes selects what the oracle selects over the values of its keys' 2-bit codes (per token and head, as
    quantization.py codes them), and its metadata is those codes: 16 + 4 bytes a token per KV head at head_dim 64."""
    from shared.compute.quantization import dequantize_partitions, quantize_partitions

    geometry = Geometry(num_layers=4, num_heads=9, num_kv_heads=3, head_dim=64)
    gen = torch.Generator().manual_seed(5)
    keys, query = torch.randn(3, 300, 64, generator=gen), torch.randn(9, 64, generator=gen)
    codes = dequantize_partitions(*quantize_partitions(keys, 2), 2)
    keycodes, oracle = make_selector("keycodes", geometry), make_selector("oracle", geometry)
    mine, theirs = keycodes.new_state(2), oracle.new_state(2)
    keycodes.extend(2, mine, keys)
    oracle.extend(2, theirs, codes)
    assert torch.equal(keycodes.select(2, mine, query, 40), oracle.select(2, theirs, query, 40))
    exact = oracle.new_state(2)
    oracle.extend(2, exact, keys)
    assert not torch.equal(keycodes.select(2, mine, query, 40), oracle.select(2, exact, query, 40))  # codes, not keys
    assert keycodes.metadata_bytes_per_token() == 3 * 20


def test_quest_bounds_travel_as_outward_codes():
    """Quest's page bounds travel in 8 bits (136 bytes a page and KV head at head_dim 64, bf16's 256), no tighter
    than the pages' keys — min ≤ the page's minimum, max ≥ its maximum, each within about 1/255 of its vector's range,
    so a page's score is still an upper bound — at any scale, bf16 outliers included; and the node that made them
    scores over the very bounds the other node restores (so exact KV decodes alike wherever it was computed)."""
    geometry = Geometry(num_layers=4, num_heads=9, num_kv_heads=3, head_dim=64, page_tokens=16)
    sel = make_selector("quest", geometry)
    assert sel.metadata_bytes_per_token() * geometry.page_tokens == 3 * 136
    gen = torch.Generator().manual_seed(7)
    for scale in (1e-3, 1.0, 300.0):
        keys = (torch.randn(3, 312, 64, generator=gen) * scale).to(torch.bfloat16).float()
        keys[:, :, 5] *= 40  # an outlier channel
        here = sel.new_state(2)
        sel.extend(2, here, keys)
        there = sel.restore(2, sel.export(here), 312)
        assert torch.equal(here.page_min.data, there.page_min.data) and torch.equal(here.page_max.data, there.page_max.data)
        pages = torch.cat([keys, keys[:, -1:].expand(-1, 8, -1)], dim=1).view(3, 20, 16, 64)  # the last page partial
        lo, hi = pages.amin(dim=2), pages.amax(dim=2)
        assert bool((there.page_min.data <= lo).all()) and bool((there.page_max.data >= hi).all())
        span = hi.amax(-1, keepdim=True) - lo.amin(-1, keepdim=True)
        assert float(((lo - there.page_min.data) / span).max()) <= 1.01 / 255
        assert float(((there.page_max.data - hi) / span).max()) <= 1.01 / 255
        query = torch.randn(9, 64, generator=gen)
        decoded = torch.cat([keys, torch.randn(3, 5, 64, generator=gen) * scale], dim=1)  # fills the partial page
        for state in (here, there):
            sel.extend(2, state, decoded)
        assert torch.equal(sel.select(2, here, query, 64), sel.select(2, there, query, 64))


@pytest.mark.real_model
def test_quest_over_its_eight_bit_bounds_decodes_the_tokens_of_exact_bounds(real_model_path):
    """On SmolLM2, 24 greedy steps at 10% from a 1,200-token prompt: Quest over its 8-bit bounds (what every node
    holds) gives the tokens of Quest over the pages' exact min and max."""
    import inspect
    import json as json_module

    runner = ModelRunner(real_model_path)
    engine = DecodeEngine(runner, KvStore(runner.kv_layout(16), 1400), None)
    ids = prompt_ids(real_model_path, inspect.getsource(json_module.decoder))[:1200]
    logits, cache = runner.prefill(ids)
    first, n, t = int(logits[-1].argmax()), len(ids), 16
    tokens = {}
    for exact in (False, True):
        engine.caches["r"] = copy.deepcopy(cache)
        engine.use_selection("r", "quest", 0.1)
        if exact:
            for layer, state in engine.selections["r"].states.items():
                keys = cache.layers[layer].keys[0].float()  # (H_kv, n, d)
                pad = (-n) % t
                pages = torch.cat([keys, keys[:, -1:].expand(-1, pad, -1)], dim=1).view(keys.shape[0], -1, t, keys.shape[-1])
                state.page_min.data.copy_(pages.amin(dim=2))
                state.page_max.data.copy_(pages.amax(dim=2))
        token, out = first, []
        for _ in range(24):
            token = int(engine.step_logits("r", token).argmax())
            out.append(token)
        engine.end("r")
        tokens[exact] = out
    assert tokens[True] == tokens[False]
