"""The engines without any service: prefill into pages, gather on the other side, decode — same tokens
as model.generate. This is the full-transfer path with the network taken out."""
from __future__ import annotations

import torch

from schemas import NO_FLOOR, Sampling
from shared.compute.decode_engine import DecodeEngine
from shared.compute.prefill_engine import PrefillEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from tests.reference import greedy_tokens, prompt_ids

PROMPT = "Once upon a time, in a valley between two mountains, there lived"


def decode_via_slabs(runner: ModelRunner, ids: list[int], n: int, corrupt: bool = False, kv_dtype: str = "",
                     selector: str = "") -> list[int]:
    layout = runner.kv_layout(page_tokens=4, kv_dtype=kv_dtype)
    src, dst = KvStore(layout, 64), KvStore(layout, 64)
    dst.allocate("pad", 5)  # so the two sides' offsets differ
    prefill = PrefillEngine(runner, src)
    meta, encode = (prefill.metadata_encoder(src.allocate("probe", 1), selector, len(ids)) if selector else (None, None))
    aux = meta.nbytes if meta else 0
    src.free("probe")
    src_slab, dst_slab = src.allocate("r", len(ids), aux), dst.allocate("r", len(ids) + n, aux)
    if selector:
        _, encode = prefill.metadata_encoder(src_slab, selector, len(ids))
    layers_done = []
    first = prefill.run(src_slab, ids, Sampling(), layers_done.append, encode)
    assert layers_done == list(range(runner.num_layers))  # every layer reported, in order
    for layer in range(runner.num_layers):  # what the prefill service pushes, as a memcpy
        rows = zip(src.rows(src_slab, layer, 0, len(ids)), dst.rows(dst_slab, layer, 0, len(ids)))
        for (s, length), (d, _) in rows:
            dst.region[d: d + length] = src.region[s: s + length]
    if corrupt:
        dst.view(dst_slab)[1, 0] += 1.0
    if selector:
        dst.aux(dst_slab).copy_(src.aux(src_slab))  # the metadata push
    engine = DecodeEngine(runner, dst, floor=NO_FLOOR)
    engine.load_from_store("r", dst_slab, len(ids))
    if selector:
        engine.use_selection("r", selector, 0.25, slab=dst_slab)
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


def test_recompute_mid_decode_replays_in_one_forward_and_continues_with_the_colocated_tokens(tiny_model_path):
    """failure_policy recompute: a request whose cache is lost after 40 tokens (its KV came from a slab) is rebuilt
    from the prompt and the 40 tokens replayed in one forward over the slab: the slab then holds the KV stepping
    left (bf16, as the services keep it), and dense decoding goes on with exactly colocated's tokens. With a
    selector the replay is dense, so the run goes on from there (its tokens need not be the selective run's)."""
    runner = ModelRunner(tiny_model_path)
    ids = prompt_ids(tiny_model_path, PROMPT * 3)
    layout = runner.kv_layout(4, "bfloat16")
    for selector in ("", "quest"):
        colocated = DecodeEngine(runner, KvStore(layout, 64), floor=NO_FLOOR)
        expected = [colocated.prefill_local("r", ids, Sampling())]
        if selector:
            colocated.use_selection("r", selector, 0.25)
        for i in range(1, 60):
            expected.append(colocated.step("r", expected[-1], Sampling(), i))
        engine = DecodeEngine(runner, KvStore(layout, 64), floor=NO_FLOOR)
        slab = engine.store.allocate("r", len(ids) + 60)
        engine.load_from_store("r", slab, len(ids))  # garbage KV: what is lost is never read again
        tokens = expected[:40]
        forwards = []
        hook = runner.model.register_forward_pre_hook(lambda *_: forwards.append(1))
        try:
            assert engine.recompute("r", slab, ids, tokens, Sampling(), selector, 0.25) == expected[0]
        finally:
            hook.remove()
        assert len(forwards) == 2  # the prompt's prefill and the replay, whatever the completion's length
        assert engine.caches["r"].get_seq_length() == len(ids) + 39
        for i in range(40, 60):
            tokens.append(engine.step("r", tokens[-1], Sampling(), i))
        if not selector:
            assert tokens == expected
            n = len(ids) + 59
            replayed, stepped = engine.store.view(slab)[..., :n, :], colocated.store.view(colocated.store.slab("r"))[..., :n, :]
            assert torch.allclose(replayed.float(), stepped.float(), atol=2e-2, rtol=1e-2)  # a bf16 rounding step at most


def test_bf16_kv_gives_one_set_of_tokens_in_every_path(tiny_model_path):
    """KV kept in bf16 while the model computes in fp32 (the services' default): colocated (a local prefill into a
    slab) and transfer (a prefill worker's slab copied row by row) decode the same tokens, densely and with Quest
    metadata pushed from the prefill side, since both round the same KV the same way; the slabs hold 2 bytes an
    element."""
    runner = ModelRunner(tiny_model_path)
    ids = prompt_ids(tiny_model_path, PROMPT * 3)
    assert runner.kv_layout(4, "bfloat16").token_bytes * 2 == runner.kv_layout(4).token_bytes
    for selector in ("", "quest"):
        colocated = DecodeEngine(runner, KvStore(runner.kv_layout(4, "bfloat16"), 64), floor=NO_FLOOR)
        expected = [colocated.prefill_local("r", ids, Sampling())]
        if selector:
            colocated.use_selection("r", selector, 0.25)
        for i in range(1, 16):
            expected.append(colocated.step("r", expected[-1], Sampling(), i))
        assert colocated.caches["r"].layers[0].keys.dtype == torch.bfloat16
        assert decode_via_slabs(runner, ids, 16, kv_dtype="bfloat16", selector=selector) == expected, selector
