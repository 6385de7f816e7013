"""The engines without any service: prefill into pages, gather on the other side, decode — same tokens
as model.generate. This is the full-transfer path with the network taken out."""
from __future__ import annotations

import torch

from schemas import Sampling
from services.decode.engine import DecodeEngine
from services.prefill.engine import PrefillEngine
from shared.dataplane import pair_segments
from shared.kvstore import KvStore
from shared.modeling import ModelRunner
from tests.reference import greedy_tokens, prompt_ids

PROMPT = "Once upon a time, in a valley between two mountains, there lived"


def decode_via_pages(runner: ModelRunner, ids: list[int], n: int, corrupt: bool = False) -> list[int]:
    layout = runner.kv_layout(page_tokens=4)
    src, dst = KvStore(layout, 200), KvStore(layout, 300)
    dst.allocate("pad", 5)  # so the two sides' page ids differ
    src_table, dst_table = src.allocate("r", len(ids)), dst.allocate("r", len(ids))
    layers_done = []
    first = PrefillEngine(runner, src).run(src_table, ids, Sampling(), layers_done.append)
    assert layers_done == list(range(runner.num_layers))  # every layer reported, in order
    for layer in range(runner.num_layers):  # what the data plane does, as a memcpy
        for s in pair_segments(src_table.page_ids[layer].tolist(), dst_table.page_ids[layer].tolist(), layout.page_bytes):
            dst.region[s.dst: s.dst + s.length] = src.region[s.src: s.src + s.length]
    if corrupt:
        dst.pages[dst_table.page_ids[1], 0] += 1.0
    engine = DecodeEngine(runner, dst)
    engine.load_from_store("r", dst_table)
    tokens = [first]
    for i in range(1, n):
        tokens.append(engine.step("r", tokens[-1], Sampling(), i))
    engine.end("r")
    return tokens


def test_paged_transfer_reproduces_generate(tiny_model_path):
    """Prefill → pages → copy → pages → cache → decode gives model.generate's tokens exactly."""
    runner = ModelRunner(tiny_model_path)
    ids = prompt_ids(tiny_model_path, PROMPT)
    assert decode_via_pages(runner, ids, 20) == greedy_tokens(tiny_model_path, ids, 20)


def test_corrupted_kv_changes_the_output(tiny_model_path):
    """The check above can fail: disturbing one layer's keys changes the greedy tokens."""
    runner = ModelRunner(tiny_model_path)
    ids = prompt_ids(tiny_model_path, PROMPT)
    assert decode_via_pages(runner, ids, 20, corrupt=True) != greedy_tokens(tiny_model_path, ids, 20)


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
