"""smartgen's low-bit proactive push (`kv_bits` 4 or 8 on transfer_mode smartgen): what the prefill pushes while
it computes — layers 0–1 whole, the plan's profile blocks, the entries its last-position query selects — travels
as codes, several times fewer bytes, so more of what step 1 attends to fits behind the prefill. On-demand and
background reads stay exact (a background read later overwrites a pushed entry with its exact value).

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
            codes, scale_min = quantize_partitions(x[picked].float(), bits)  # (count, ·), (count, 2): (head, token) order
            records[:, at: at + codes.shape[1]] = codes.to(aux.device)
            records[:, sm_at: sm_at + 4] = scale_min.contiguous().view(torch.uint8).to(aux.device)
        return count

    def decode(self, aux: torch.Tensor, layer: int, mask: np.ndarray, keys_out: torch.Tensor,
               values_out: torch.Tensor) -> None:
        """The inverse: `layer`'s records → keys_out/values_out (num_kv_heads, N, head_dim) at `mask`, in place."""
        count = int(mask.sum())
        if not count:
            return
        records = self._records(aux, layer, count).to(keys_out.device)
        picked = torch.from_numpy(mask).to(keys_out.device)
        head_dim = keys_out.shape[-1]
        for out, (bits, at, sm_at) in zip((keys_out, values_out), self.fields):
            scale_min = records[:, sm_at: sm_at + 4].contiguous().view(torch.float16)
            codes = records[:, at: at + head_dim * bits // 8]
            out[picked] = dequantize_partitions(codes, scale_min, bits).to(out.dtype)


def pushed_mask(pages: np.ndarray, page_tokens: int, num_tokens: int, num_kv_heads: int,
                by_query: np.ndarray | None = None) -> np.ndarray:
    """(num_kv_heads, N) bool: the entries of one layer the proactive push sends — `pages` (num_pages,) bool,
    the plan's blocks of the layer, every head — and `by_query` (num_kv_heads, N) bool, the query-aware push's."""
    tokens = np.repeat(pages, page_tokens)[:num_tokens]
    mask = np.broadcast_to(tokens, (num_kv_heads, num_tokens)).copy()
    if by_query is not None:
        mask |= by_query
    return mask
