"""smartgen's low-bit KV (`kv_bits` 4 or 8 on transfer_mode smartgen): what the prefill pushes while it computes —
layers 0–1 whole, the plan's profile blocks, the entries its last-position query selects — travels as codes,
several times fewer bytes, so more of what step 1 attends to fits behind the prefill; and so do the on-demand and
background reads (paths 2 and 3): the prefill node also writes every entry's record at a fixed place (`read
codes`, below), and the decode node reads records and dequantizes them into its slab's rows as they land. An
entry's value is the same whichever path brought it (the same record of the same exact entry).

An entry is one (layer, KV head, token): its K and its V, each a head_dim vector quantized as one partition
(asymmetric, x ≈ scale·q + min, fp16 scale and minimum; quantization.py's rule), V in `kv_bits` and K in
PUSH_KEY_BITS (8): a key quantized per token loses its outlier channels (schemas/constants.py). Per-entry
partitions let any set of entries travel on its own.

Where, in the request's aux area (after the selector metadata, whose size it does not change):
    aux    = [metadata blocks (+ query bitmaps)][layer 0 records][layer 1 records]…
    layer  = (num_kv_heads · N, record) uint8: room for every entry; the first `count` records are the layer's
             pushed entries in (head, token) order, so one layer's push is one contiguous segment
    record = [K codes: d·8/8][V codes: d·bits/8][K scale, min: fp16 ×2][V scale, min: fp16 ×2]
Records carry no index: both sides derive the same entries from the plan's blocks and the query bitmaps
(`pushed_mask`).

Read codes (paths 2 and 3): on the prefill node, after the whole aux area the decode node reserved, a second
region of the same shape holds the record of EVERY entry at a fixed place, record head·N + token of its layer
(`encode` with every entry picked), written as each layer is stored; the read ticket grants only that region
(KvSource.codes_offset, codes_bits). The decode node reads records into its own codes region at the same places,
a layer's only once its pushed records there have been dequantized (services/decode/remote.py), and decodes them
with NumPy on its event loop (`records_to_values`, bit for bit `decode`'s values) before it marks them present.
"""
from __future__ import annotations

import numpy as np
import torch

from schemas import PUSH_KEY_BITS, entry_record_bytes
from shared.compute.quantization import dequantize_partitions, quantize_partitions


class EntryCodes:
    """The codes region of one request's aux area, starting at byte `offset` of it."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, bits: int, offset: int):
        self.bits, self.offset = bits, offset
        k_bytes, v_bytes = head_dim * PUSH_KEY_BITS // 8, head_dim * bits // 8  # one K, one V vector's codes
        # (bits, where its codes start, where its fp16 scale and minimum start) in a record, for K and for V
        self.fields = ((PUSH_KEY_BITS, 0, k_bytes + v_bytes), (bits, k_bytes, k_bytes + v_bytes + 4))
        self.record_bytes = entry_record_bytes(head_dim, bits)
        self.layer_bytes = num_kv_heads * num_tokens * self.record_bytes
        self.nbytes = num_layers * self.layer_bytes

    def layer_range(self, layer: int, count: int) -> tuple[int, int]:
        """(offset, length) in bytes, within the aux area, of `layer`'s first `count` records."""
        return self.offset + layer * self.layer_bytes, count * self.record_bytes

    def _records(self, aux: torch.Tensor, layer: int, count: int) -> torch.Tensor:
        at, n = self.layer_range(layer, count)
        return aux[at: at + n].view(count, self.record_bytes)

    def encode(self, aux: torch.Tensor, layer: int, keys: torch.Tensor, values: torch.Tensor,
               mask: np.ndarray) -> int:
        """keys/values (num_kv_heads, N, head_dim) as stored; `mask` (num_kv_heads, N) bool: the entries to push.
        Writes their records (aux: uint8) and returns how many."""
        picked = torch.from_numpy(mask).to(keys.device)
        count = int(mask.sum())
        if not count:
            return 0
        records = self._records(aux, layer, count)
        for x, (bits, at, sm_at) in zip((keys, values), self.fields):
            x = x.reshape(-1, x.shape[-1]) if count == mask.size else x[picked]  # every entry (read codes): no mask
            codes, scale_min = quantize_partitions(x.float(), bits)  # (count, ·), (count, 2): (head, token) order
            records[:, at: at + codes.shape[1]] = codes.to(aux.device)
            records[:, sm_at: sm_at + 4] = scale_min.contiguous().view(torch.uint8).to(aux.device)
        return count

    def decode(self, aux: torch.Tensor, layer: int, mask: np.ndarray, keys_out: torch.Tensor,
               values_out: torch.Tensor) -> None:
        """The inverse: `layer`'s records → keys_out/values_out (num_kv_heads, N, head_dim) at `mask`, in place.
        The rows are written at (head, token) indices, not through a boolean mask (a pushed layer a step: 2K prompts,
        ~6K records in layers 0–1)."""
        flat = np.flatnonzero(mask)  # (count,): head·N + token of each pushed entry, the records' order
        count = flat.size
        if not count:
            return
        device = keys_out.device
        records = self._records(aux, layer, count).to(device)
        at = torch.from_numpy(flat).to(device)
        heads, tokens = at // mask.shape[1], at % mask.shape[1]
        head_dim = keys_out.shape[-1]
        for out, (bits, at_codes, sm_at) in zip((keys_out, values_out), self.fields):
            scale_min = records[:, sm_at: sm_at + 4].contiguous().view(torch.float16)  # (count, 2)
            codes = records[:, at_codes: at_codes + head_dim * bits // 8]
            out[heads, tokens] = dequantize_partitions(codes, scale_min, bits).to(out.dtype)


def pushed_mask(pages: np.ndarray, page_tokens: int, num_tokens: int, num_kv_heads: int,
                by_query: np.ndarray | None = None) -> np.ndarray:
    """(num_kv_heads, N) bool: the entries of one layer the proactive push sends — `pages` (num_pages,) bool,
    the plan's blocks of the layer, every head — and `by_query` (num_kv_heads, N) bool, the query-aware push's."""
    tokens = np.repeat(pages, page_tokens)[:num_tokens]
    mask = np.broadcast_to(tokens, (num_kv_heads, num_tokens)).copy()
    if by_query is not None:
        mask |= by_query
    return mask


def every_entry(num_kv_heads: int, num_tokens: int) -> np.ndarray:
    """The mask that writes one layer's read codes: every entry, so record head·N + token is entry (head, token)."""
    return np.ones((num_kv_heads, num_tokens), dtype=bool)


def records_to_values(records: np.ndarray, head_dim: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """NumPy's `EntryCodes.decode` (the decode node's event loop dequantizes read records with it, no torch there):
    records (n, record_bytes) uint8 → K, V (n, head_dim) float32, the same values as the torch path, bit for bit
    (the same fp32 products and sums)."""
    k_bytes, v_bytes = head_dim * PUSH_KEY_BITS // 8, head_dim * bits // 8
    scale_min = np.ascontiguousarray(records[:, k_bytes + v_bytes: k_bytes + v_bytes + 8]).view(np.float16)
    scale_min = scale_min.astype(np.float32)  # (n, 4): K scale, K min, V scale, V min
    out = []
    for at, nbytes, width, sm in ((0, k_bytes, PUSH_KEY_BITS, 0), (k_bytes, v_bytes, bits, 2)):
        codes = records[:, at: at + nbytes]
        if width == 8:
            q = codes
        else:  # 4 bits: value 2j in the low nibble of byte j, 2j + 1 in the high one (quantize_partitions)
            q = np.empty((codes.shape[0], head_dim), dtype=np.uint8)
            q[:, 0::2] = codes & 0x0F
            q[:, 1::2] = codes >> 4
        out.append(q.astype(np.float32) * scale_min[:, sm: sm + 1] + scale_min[:, sm + 1: sm + 2])
    return out[0], out[1]


def as_stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values → what a slab of `dtype` stores (torch's rounding: bfloat16 to nearest even, as raw uint16;
    float16 as float16; float32 as is)."""
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16)
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        return ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    raise ValueError(f"no NumPy form for a slab of {dtype}")


STORED_AS = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}  # NumPy views of slab rows
