"""smartgen's low-bit proactive push: each pushed (layer, KV head, token) entry as one record of codes, in
(head, token) order, within half a quantization step (keys in 8 bits, values in kv_bits); and the bytes every side computes for it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from schemas import PUSH_KEY_BITS, KvLayout, TransferPlan, entry_record_bytes, entry_region_bytes, mode_of, pack_bits, pushed_bytes
from shared.compute.entry_codes import EntryCodes, as_stored, every_entry, pushed_mask, records_to_values

H, N, D = 3, 150, 64


@pytest.mark.parametrize("bits", [4, 8])
def test_pushed_entries_come_back_within_half_a_step_and_nothing_else_is_touched(bits):
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(H, N, D, generator=gen), torch.randn(H, N, D, generator=gen) * 3
    mask = pushed_mask(np.array([True] + [False] * 8 + [True, False]), 16, N, H,
                       np.random.default_rng(0).random((H, N)) < 0.1)
    codes = EntryCodes(num_layers=2, num_kv_heads=H, head_dim=D, num_tokens=N, bits=bits, offset=100)
    aux = torch.zeros(100 + codes.nbytes, dtype=torch.uint8)
    count = codes.encode(aux, 1, keys, values, mask)
    assert count == mask.sum() and codes.layer_range(1, count) == (100 + codes.layer_bytes, count * codes.record_bytes)
    assert not aux[:100 + codes.layer_bytes].any()  # layer 0's room and what precedes the region are untouched
    k_out, v_out = torch.full_like(keys, 7.0), torch.full_like(values, 7.0)
    codes.decode(aux, 1, mask, k_out, v_out)
    picked = torch.from_numpy(mask)
    for x, out, width in ((keys, k_out, PUSH_KEY_BITS), (values, v_out, bits)):
        step = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / (2 ** width - 1)  # per entry
        assert torch.all(((out - x).abs() <= step / 2 + 2e-2 * step + 1e-3)[picked])
        assert torch.all(out[~picked] == 7.0)


def test_the_mask_is_the_layers_blocks_for_every_head_and_the_query_entries():
    by_query = np.zeros((H, 40), dtype=bool)
    by_query[1, 20] = True
    mask = pushed_mask(np.array([True, False, True]), 16, 40, H, by_query)
    assert mask[:, :16].all() and mask[:, 32:].all() and mask[1, 20] and mask.sum() == H * 24 + 1


LAYOUT = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_tokens=16, dtype="bfloat16", token_bytes=23040)


def test_records_are_a_fraction_of_the_exact_entries_and_decode_waits_for_exactly_them():
    """A bf16 entry (K and V, 64 channels) is 256 bytes: 104 with 4-bit values (keys stay 8-bit), 136 with 8-bit
    values. With the low-bit
    push, decode waits for the metadata and one record per pushed entry, not for the codes region's room."""
    assert entry_record_bytes(64, 4) == 104 and entry_record_bytes(64, 8) == 136
    assert entry_region_bytes(LAYOUT, 100, 0) == 0
    region = entry_region_bytes(LAYOUT, 100, 4)
    assert region == 30 * 3 * 100 * 104
    blocks = np.zeros((30, 7), dtype=bool)
    blocks[:2] = True  # layers 0–1 whole: 2 × 100 tokens × 3 heads entries
    plan = TransferPlan("r", "smartgen", "b", 7, pack_bits(blocks), int(blocks.sum()))
    metadata = 5000
    exact = pushed_bytes(mode_of("smartgen"), plan, LAYOUT, 100, metadata, query_entries=10)
    assert exact == metadata + (600 + 10) * 256
    low = pushed_bytes(mode_of("smartgen"), plan, LAYOUT, 100, metadata + region, query_entries=10, push_bits=4)
    assert low == metadata + (600 + 10) * 104


def test_only_smartgen_takes_push_bits_and_quantized_still_needs_its_own():
    assert mode_of("smartgen").kv_bits_problem(0) == "" and mode_of("smartgen").kv_bits_problem(4) == ""
    assert "4 or 8" in mode_of("smartgen").kv_bits_problem(2)
    assert mode_of("partial").kv_bits_problem(4) and mode_of("auto").kv_bits_problem(2)
    assert mode_of("auto").kv_bits_problem(8) == ""  # consent to 8-bit codes: quantized or smartgen's push, both take 8
    assert mode_of("quantized").kv_bits_problem(0)
    assert mode_of("quantized").kv_bits_problem(2) == "" and mode_of("quantized").kv_bits_problem(8) == ""


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_numpy_decodes_a_record_as_torch_does_bit_for_bit(bits, dtype):
    """The decode node's event loop dequantizes read records with NumPy (no torch there): the same values as
    `EntryCodes.decode`, rounded to the slab's dtype as torch rounds them (bf16: to nearest even)."""
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(H, N, D, generator=gen) * 5, torch.randn(H, N, D, generator=gen)
    codes = EntryCodes(num_layers=1, num_kv_heads=H, head_dim=D, num_tokens=N, bits=bits, offset=0)
    aux = torch.zeros(codes.nbytes, dtype=torch.uint8)
    assert codes.encode(aux, 0, keys, values, every_entry(H, N)) == H * N  # record h·N + t is entry (h, t)
    torch_dtype = getattr(torch, dtype)
    k_out, v_out = torch.empty(H, N, D, dtype=torch_dtype), torch.empty(H, N, D, dtype=torch_dtype)
    codes.decode(aux, 0, every_entry(H, N), k_out, v_out)
    k_np, v_np = records_to_values(aux.numpy().reshape(H * N, codes.record_bytes), D, bits)
    for ours, theirs in ((k_np, k_out), (v_np, v_out)):
        stored = as_stored(ours, dtype).reshape(H, N, D)
        expected = theirs.view(torch.uint16) if dtype == "bfloat16" else theirs
        assert np.array_equal(stored, expected.numpy())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_writes_dequantize_partitions_values_at_the_masked_entries(bits, dtype):
    """`decode`'s fewer passes (no unpacking of 8-bit codes, in-place products, rows written by index) give the
    values of `dequantize_partitions` (the quantized mode's rule) bit for bit, at the masked entries of rows that
    hold more tokens than the prompt (a slab's capacity), and touch nothing else."""
    from shared.compute.quantization import dequantize_partitions

    gen = torch.Generator().manual_seed(2)
    keys, values = torch.randn(H, N, D, generator=gen) * 4, torch.randn(H, N, D, generator=gen)
    mask = np.random.default_rng(2).random((H, N)) < 0.3
    codes = EntryCodes(num_layers=1, num_kv_heads=H, head_dim=D, num_tokens=N, bits=bits, offset=0)
    aux = torch.zeros(codes.nbytes, dtype=torch.uint8)
    count = codes.encode(aux, 0, keys, values, mask)
    torch_dtype = getattr(torch, dtype)
    k_slab, v_slab = torch.full((H, N + 20, D), 7.0, dtype=torch_dtype), torch.full((H, N + 20, D), 7.0, dtype=torch_dtype)
    codes.decode(aux, 0, mask, k_slab[:, :N], v_slab[:, :N])
    records = aux[:count * codes.record_bytes].view(count, codes.record_bytes)
    picked = torch.from_numpy(mask)
    for slab, (width, at, sm_at) in zip((k_slab, v_slab), codes.fields):
        expected = dequantize_partitions(records[:, at: at + D * width // 8],
                                         records[:, sm_at: sm_at + 4].contiguous().view(torch.float16), width)
        assert torch.equal(slab[:, :N][picked], expected.to(torch_dtype))
        assert torch.all(slab[:, :N][~picked] == 7.0) and torch.all(slab[:, N:] == 7.0)
