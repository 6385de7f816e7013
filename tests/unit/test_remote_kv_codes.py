"""Remote KV with kv_bits: on-demand, background and ranked reads move per-entry records (codes) that land as
their dequantized values, and decode as exact reads do at 8 bits."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from schemas import KvSource, entry_record_bytes
from services.decode.remote_lifecycle import read_blocks
from services.decode.remote import RemoteKv, RemoteReadError
from shared.compute.entry_codes import EntryCodes, every_entry
from shared.compute.kvstore import KvStore, layout_for
from shared.dataplane import Grant, make_dataplane
from tests.reference import prompt_ids
from tests.unit.remote_kv_harness import PROMPT, remote_tokens, runner  # noqa: F401 (runner: a fixture)


def dequantized(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """The reference for an entry that travelled as codes: each (layer, KV head, token) of `rows` (L, K|V, H, N, d)
    quantized to its record and dequantized again by torch (shared/compute/entry_codes.py), in `rows`' dtype."""
    num_layers, _, heads, n, d = rows.shape
    codes = EntryCodes(num_layers, heads, d, n, bits, offset=0)
    aux, out = torch.zeros(codes.nbytes, dtype=torch.uint8), torch.empty_like(rows)
    for layer in range(num_layers):
        codes.encode(aux, layer, rows[layer, 0].float(), rows[layer, 1].float(), every_entry(heads, n))
        codes.decode(aux, layer, every_entry(heads, n), out[layer, 0], out[layer, 1])
    return out


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
async def test_with_kv_bits_on_demand_reads_move_records_and_land_as_their_dequantized_values(runner, bits, kv_dtype):
    """smartgen with kv_bits: the prefill serves every entry as a record of codes (K 8-bit, V `bits`), on-demand
    reads (fetch and speculation) move records, not rows — the bytes read are the records' — and each entry read
    lands in the decode slab as torch's quantize→dequantize of its exact value, bit for bit (NumPy decodes it on the
    event loop, in the slab's dtype), like the pushed ones; nothing else of the slab is touched."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    codes_slabs, exact_slabs, calls = {}, {}, {}
    _, remote = await remote_tokens(runner, ids, "oracle", 0.1, 2, True, background=False, kv_bits=bits,
                                    kv_dtype=kv_dtype, slabs=codes_slabs, calls=calls)
    _, exact = await remote_tokens(runner, ids, "oracle", 0.1, 2, True, background=False, kv_bits=bits,
                                   read_codes=False, kv_dtype=kv_dtype, slabs=exact_slabs)
    assert remote.codes is not None and exact.codes is None and remote.num_speculative_reads > 0
    record, row = entry_record_bytes(16, bits), exact.entry_bytes  # the tiny model: 16 channels per head
    assert remote.entry_bytes == record < row  # 40 or 32 bytes against 64 (bf16) or 128 (fp32)
    read, exact_read = remote.presence.present.copy(), exact.presence.present.copy()  # (L, H, N): layers 0–1 pushed, the rest read
    read[:2] = exact_read[:2] = False
    assert remote.bytes_on_demand == int(read.sum()) * record > 0 and calls.get("read_gather", 0) > 0
    assert exact.bytes_on_demand == int(exact_read.sum()) * row
    reference = dequantized(codes_slabs["src"], bits)
    local = torch.from_numpy(remote.presence.present)[:, None, :, :, None].expand_as(reference)
    assert torch.equal(codes_slabs["dst"][local], reference[local])  # pushed and read: each its codes' value
    assert codes_slabs["dst"][~local].isnan().all()  # nothing else was touched
    exact_read = torch.from_numpy(exact_read)[:, None, :, :, None].expand_as(reference)
    assert torch.equal(exact_slabs["dst"][exact_read], exact_slabs["src"][exact_read])  # exact reads: exact values


@pytest.mark.parametrize("selector", ["quest", "oracle"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
async def test_eight_bit_reads_decode_as_exact_reads_do(runner, selector, kv_dtype):
    """K8V8 reads against the same request reading exact rows (both with the 8-bit push): fed the same tokens,
    every step's next-token distribution is within KL 5e-3 of it (mean ≤ 1e-3; measured ~1e-4 here, as the push's on
    SmolLM2), and Quest's greedy tokens are the same. (The random tiny model's top tokens are close: with Oracle
    over bf16 its 8th greedy token flips, so its tokens are not compared.)"""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    exact_logits, codes_logits = [], []
    exact_tokens, _ = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, kv_bits=8,
                                          read_codes=False, kv_dtype=kv_dtype, logits=exact_logits)
    _, remote = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, kv_bits=8,
                                    kv_dtype=kv_dtype, forced=exact_tokens, logits=codes_logits)
    assert remote.codes is not None and remote.bytes_on_demand % remote.entry_bytes == 0 < remote.bytes_on_demand
    kl = [float(torch.nn.functional.kl_div(c.log_softmax(-1), e.log_softmax(-1), log_target=True, reduction="sum"))
          for c, e in zip(codes_logits, exact_logits)]
    assert max(kl) < 5e-3 and sum(kl) / len(kl) < 1e-3, kl
    if selector == "quest":
        tokens, _ = await remote_tokens(runner, ids, selector, 0.1, 2, True, background=False, kv_bits=8,
                                        kv_dtype=kv_dtype)
        assert tokens == exact_tokens


@pytest.mark.parametrize("bits", [8, 4])
async def test_with_kv_bits_background_and_ranked_reads_move_records_too(runner, bits):
    """Path 3 with kv_bits: the broker's blocks (`read_blocks`) and the latest query's ranked reads move records
    (bytes_background is records' worth), the request ends all local, and every entry holds its codes' value."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    slabs: dict[str, torch.Tensor] = {}
    _, remote = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=True, kv_bits=bits,
                                    kv_dtype="bfloat16", slabs=slabs)
    record = entry_record_bytes(16, bits)
    assert remote.is_all_local and remote.local_blocks().all()
    assert remote.bytes_background > 0 and remote.bytes_background % record == 0
    assert remote.bytes_on_demand + remote.bytes_background == 6 * 2 * len(ids) * record  # layers 2–7, 2 KV heads
    assert torch.equal(slabs["dst"], dequantized(slabs["src"], bits))
    _, ranked = await remote_tokens(runner, ids, "quest", 0.1, 2, True, background=False, kv_bits=bits,
                                    kv_dtype="bfloat16", ranked=True, slabs=slabs)
    assert ranked.num_ranked_reads > 0 and ranked.bytes_ranked == ranked.bytes_background > 0
    assert ranked.bytes_ranked % record == 0
    local = torch.from_numpy(ranked.presence.present)[:, None, :, :, None].expand_as(slabs["dst"])
    assert torch.equal(slabs["dst"][local], dequantized(slabs["src"], bits)[local])


async def test_with_kv_bits_step_one_reads_a_layer_only_once_its_pushed_records_are_dequantized(runner):
    """No push barrier, 8-bit push and reads: read records land in the codes region the layer's pushed records
    landed in, so a layer is read (fetched or speculated) only once those were dequantized into its rows; the
    pushed layers' values and the tokens are those of the same request with the push landed before step 1."""
    ids = prompt_ids(runner.path, PROMPT)[:300]
    slabs: dict[str, torch.Tensor] = {}
    tokens, remote = await remote_tokens(runner, ids, "quest", 0.1, 4, True, background=False, kv_bits=8,
                                         kv_dtype="bfloat16", land_every_s=0.02, slabs=slabs)
    barrier_tokens, _ = await remote_tokens(runner, ids, "quest", 0.1, 4, True, background=False, kv_bits=8,
                                            kv_dtype="bfloat16")
    assert tokens == barrier_tokens and remote.landing_wait_s > 0.02 and remote.num_speculative_reads > 0
    local = torch.from_numpy(remote.presence.present)[:, None, :, :, None].expand_as(slabs["dst"])
    assert torch.equal(slabs["dst"][local], dequantized(slabs["src"], 8)[local])
    assert remote.bytes_on_demand == int(remote.presence.present[4:].sum()) * entry_record_bytes(16, 8)


async def test_a_layer_is_read_as_codes_only_once_its_pushed_records_are_dequantized():
    """The decode slab's codes region holds a layer's pushed records (in push order) until they are dequantized
    (`ready`), and read records land in it at head·N + token: a read may not land there before. A speculated layer
    that has landed is dequantized first (on the torch thread, never waiting), and path 3 refuses an unprepared
    layer (its batch is read again later). Here the push carries page 0 of layer 2 (records 0–31: head 0's tokens
    0–15, then head 1's) and a read of head 0's token 20 lands on record 20, head 1's token 4's pushed record."""
    layout = layout_for(num_layers=4, num_kv_heads=2, head_dim=16, page_tokens=16, dtype=torch.bfloat16)
    n, bits = 40, 8
    codes = EntryCodes(4, 2, 16, n, bits, offset=0)
    src, dst = KvStore(layout, 64), KvStore(layout, 64)
    dst.allocate("pad", 5)
    src_slab, dst_slab = src.allocate("r", n, codes.nbytes), dst.allocate("r", n, codes.nbytes)
    exact = torch.randn(4, 2, 2, n, 16).to(torch.bfloat16)
    for layer in range(4):
        codes.encode(src.aux(src_slab), layer, exact[layer, 0].float(), exact[layer, 1].float(), every_entry(2, n))
    reference = dequantized(exact, bits)
    pushed = np.zeros((4, 3), dtype=bool)
    pushed[2, 0] = True
    mask = np.zeros((2, n), dtype=bool)
    mask[:, :16] = True
    codes.encode(dst.aux(dst_slab), 2, exact[2, 0].float(), exact[2, 1].float(), mask)  # the push has landed
    rows = dst.view(dst_slab)
    rows.fill_(float("nan"))
    prepared = []

    def prepare(layer: int) -> None:  # as the decode engine's loader: the layer's pushed records into its rows
        if layer == 2:
            codes.decode(dst.aux(dst_slab), 2, mask, rows[2, 0, :, :n], rows[2, 1, :, :n])
        prepared.append(layer)
    a, b = make_dataplane("inproc"), make_dataplane("inproc")
    a.register_region(src.region)
    b.register_region(dst.region)
    await a.start()
    await b.start()
    at = src.aux_offset(src_slab)
    a.grant(Grant(7, [(at, at + codes.nbytes)]))
    source = KvSource("p", a.address, 7, src.offset(src_slab), src_slab.capacity, 30.0, at, bits)
    remote = RemoteKv(b, asyncio.get_running_loop(), source, layout, dst.offset(dst_slab), dst_slab.capacity, n,
                      pushed, codes_at=dst.aux_offset(dst_slab), region=dst.region)
    remote.await_pushes(prepare)
    remote.speculate(3, torch.tensor([[20], [21]]))  # layer 3 has not landed: nothing is read ahead
    assert 3 not in remote._ahead and not prepared
    remote.push_landed(2, None)
    with pytest.raises(RemoteReadError, match="not dequantized"):  # path 3 before step 1 prepared the layer
        await read_blocks(remote, [2 * 3 + 1])
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, remote.speculate, 2, torch.tensor([[20], [21]]))  # the torch thread
    assert prepared == [2]
    pending = await loop.run_in_executor(None, remote.fetch, 2, torch.tensor([[20], [21]]))
    assert pending is None  # the speculative read brought both
    local = torch.from_numpy(remote.presence.present[2])[None, :, :, None].expand(2, 2, n, 16)
    assert int(remote.presence.present[2].sum()) == 34 and remote.bytes_on_demand == 2 * codes.record_bytes
    assert torch.equal(rows[2, :, :, :n][local], reference[2][local])
    await remote.close()

