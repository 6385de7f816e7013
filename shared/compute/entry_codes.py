"""smartgen's low-bit proactive push (`kv_bits` 4 or 8 on transfer_mode smartgen): what the prefill pushes while
it computes — layers 0–1 whole, the plan's profile blocks, the entries its last-position query selects — travels
as codes, several times fewer bytes, so more of what step 1 attends to fits behind the prefill. On-demand and
background reads stay exact (a background read later overwrites a pushed entry with its exact value).

An entry is one (layer, KV head, token): its K and its V, each a head_dim vector quantized as one partition
(asymmetric, x ≈ scale·q + min, fp16 scale and minimum; quantization.py's rule, per token as HACK and KIVI do
for K). Per-entry partitions let any set of entries travel on its own.

Where, in the request's aux area (after the selector metadata, whose size it does not change):
    aux    = [metadata blocks (+ query bitmaps)][layer 0 records][layer 1 records]…
    layer  = (num_kv_heads · N, record) uint8: room for every entry; the first `count` records are the layer's
             pushed entries in (head, token) order, so one layer's push is one contiguous segment
    record = [K codes: d·bits/8][V codes: d·bits/8][K scale, min: fp16 ×2][V scale, min: fp16 ×2]
Records carry no index: both sides derive the same entries from the plan's blocks and the query bitmaps
(`pushed_mask`).
"""
from __future__ import annotations

import numpy as np
import torch

from schemas import entry_record_bytes
from shared.compute.quantization import dequantize_partitions, quantize_partitions


class EntryCodes:
    """The codes region of one request's aux area, starting at byte `offset` of it."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, bits: int, offset: int):
        self.bits, self.offset = bits, offset
        self.code_bytes = head_dim * bits // 8  # one K (or V) vector's codes
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
        c = self.code_bytes
        for at, x in ((0, keys), (c, values)):
            codes, scale_min = quantize_partitions(x[picked].float(), self.bits)  # (count, c), (count, 2) in (head, token) order
            records[:, at: at + c] = codes.to(aux.device)
            sm_at = 2 * c + (at // c) * 4
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
        c = self.code_bytes
        for at, out in ((0, keys_out), (c, values_out)):
            sm_at = 2 * c + (at // c) * 4
            scale_min = records[:, sm_at: sm_at + 4].contiguous().view(torch.float16)
            out[picked] = dequantize_partitions(records[:, at: at + c], scale_min, self.bits).to(out.dtype)


def pushed_mask(pages: np.ndarray, page_tokens: int, num_tokens: int, num_kv_heads: int,
                by_query: np.ndarray | None = None) -> np.ndarray:
    """(num_kv_heads, N) bool: the entries of one layer the proactive push sends — `pages` (num_pages,) bool,
    the plan's blocks of the layer, every head — and `by_query` (num_kv_heads, N) bool, the query-aware push's."""
    tokens = np.repeat(pages, page_tokens)[:num_tokens]
    mask = np.broadcast_to(tokens, (num_kv_heads, num_tokens)).copy()
    if by_query is not None:
        mask |= by_query
    return mask
