"""The engines without any service: prefill into pages, gather on the other side, decode — same tokens
as model.generate. This is the full-transfer path with the network taken out."""
from __future__ import annotations

import torch

from schemas import Sampling
from shared.compute.decode_engine import DecodeEngine
from shared.compute.prefill_engine import PrefillEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from tests.reference import greedy_tokens, prompt_ids

PROMPT = "Once upon a time, in a valley between two mountains, there lived"


def decode_via_slabs(runner: ModelRunner, ids: list[int], n: int, corrupt: bool = False) -> list[int]:
    layout = runner.kv_layout(page_tokens=4)
    src, dst = KvStore(layout, 64), KvStore(layout, 64)
    dst.allocate("pad", 5)  # so the two sides' offsets differ
    src_slab, dst_slab = src.allocate("r", len(ids)), dst.allocate("r", len(ids) + n)
    layers_done = []
    first = PrefillEngine(runner, src).run(src_slab, ids, Sampling(), layers_done.append)
    assert layers_done == list(range(runner.num_layers))  # every layer reported, in order
    for layer in range(runner.num_layers):  # what the prefill service pushes, as a memcpy
        rows = zip(src.rows(src_slab, layer, 0, len(ids)), dst.rows(dst_slab, layer, 0, len(ids)))
        for (s, length), (d, _) in rows:
            dst.region[d: d + length] = src.region[s: s + length]
    if corrupt:
        dst.view(dst_slab)[1, 0] += 1.0
    engine = DecodeEngine(runner, dst)
    engine.load_from_store("r", dst_slab, len(ids))
    tokens = [first]
    for i in range(1, n):
        tokens.append(engine.step("r", tokens[-1], Sampling(), i))
    engine.end("r")
    return tokens


def test_slab_transfer_reproduces_generate(tiny_model_path):
    """Prefill → slab → copy of its rows → slab → cache in place → decode gives model.generate's tokens exactly."""
    runner = ModelRunner(tiny_model_path)
    ids = prompt_ids(tiny_model_path, PROMPT)
    assert decode_via_slabs(runner, ids, 20) == greedy_tokens(tiny_model_path, ids, 20)


def test_corrupted_kv_changes_the_output(tiny_model_path):
    """The check above can fail: disturbing one layer's keys changes the greedy tokens."""
    runner = ModelRunner(tiny_model_path)
    ids = prompt_ids(tiny_model_path, PROMPT)
    assert decode_via_slabs(runner, ids, 20, corrupt=True) != greedy_tokens(tiny_model_path, ids, 20)


def test_colocated_engine_reproduces_generate(tiny_model_path):
    """Colocated: the decode engine's own prefill then steps equals model.generate."""
    runner = ModelRunner(tiny_model_path)
    ids = prompt_ids(tiny_model_path, PROMPT)
    engine = DecodeEngine(runner, KvStore(runner.kv_layout(16), 8))
    tokens = [engine.prefill_local("r", ids, Sampling())]
    for i in range(1, 12):
        tokens.append(engine.step("r", tokens[-1], Sampling(), i))
    assert tokens == greedy_tokens(tiny_model_path, ids, 12)
    assert torch.is_tensor(engine.caches["r"].layers[0].keys)


def test_recompute_mid_decode_continues_with_the_colocated_tokens(tiny_model_path):
    """failure_policy recompute: a request whose cache is lost after 5 tokens (its KV came from a slab) is rebuilt
    from the prompt, the 5 tokens replayed, and decodes on exactly as colocated mode does, also with a selector."""
    runner = ModelRunner(tiny_model_path)
    ids = prompt_ids(tiny_model_path, PROMPT * 3)
    for selector in ("", "quest"):
        colocated = DecodeEngine(runner, KvStore(runner.kv_layout(4), 64))
        expected = [colocated.prefill_local("r", ids, Sampling())]
        if selector:
            colocated.use_selection("r", selector, 0.25)
        for i in range(1, 12):
            expected.append(colocated.step("r", expected[-1], Sampling(), i))
        layout = runner.kv_layout(page_tokens=4)
        engine = DecodeEngine(runner, KvStore(layout, 64))
        slab = engine.store.allocate("r", len(ids) + 12)
        engine.load_from_store("r", slab, len(ids))  # garbage KV: what is lost is never read again
        tokens = expected[:5]
        assert engine.recompute("r", ids, tokens, Sampling(), selector, 0.25) == expected[0]
        for i in range(5, 12):
            tokens.append(engine.step("r", tokens[-1], Sampling(), i))
        assert tokens == expected, selector
