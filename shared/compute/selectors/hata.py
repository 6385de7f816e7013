"""`hata`: hash-based top-k (HATA, Gong et al. 2025).

Keys and queries of a KV head are hashed to `num_bits` binary codes with that head's projection W
(code = sign(W·x)); a token's score is minus its Hamming distance to the query's code, summed over the
query heads of the group; a fixed budget of the best tokens is kept. W is learned offline by
`smartgen prepare-selectors --selector hata` (hash weights next to the model); without it, random
Gaussian projections (SimHash, fixed seed) are the untrained fallback.
Metadata: the packed codes, num_bits / 8 bytes per KV head per token.
"""
from __future__ import annotations

import torch

from shared.compute.selectors.base import Geometry, LayerState, MetadataSpec, Rows, Selector, top_k, top_k_unsorted

NUM_BITS = 128
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)  # set bits of each byte value


def pack_codes(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x (h, n, d), weights (h, bits, d) → packed sign codes (h, n, bits / 8) uint8."""
    bits = (torch.einsum("hnd,hbd->hnb", x.float(), weights.to(x.device)) > 0).to(torch.uint8)
    return (bits.view(*bits.shape[:-1], -1, 8) * _BIT_WEIGHTS.to(x.device)).sum(-1).to(torch.uint8)


class HataState(LayerState):
    def __init__(self) -> None:
        self.codes = Rows()  # (num_kv_heads, n, num_bits / 8) uint8


class HataSelector(Selector):
    name = "hata"

    def __init__(self, geometry: Geometry, weights: dict[int, torch.Tensor] | None = None, num_bits: int = NUM_BITS):
        super().__init__(geometry)
        self.num_bits = num_bits
        self.is_trained = weights is not None
        if weights is None:  # the untrained fallback: SimHash with a fixed seed (deterministic)
            gen = torch.Generator().manual_seed(0)
            weights = {layer: torch.randn(geometry.num_kv_heads, num_bits, geometry.head_dim, generator=gen)
                       for layer in range(geometry.num_layers)}
        self.weights = weights  # layer → (num_kv_heads, num_bits, head_dim)
        self._per_query_head: dict[tuple[int, torch.device], torch.Tensor] = {}

    def metadata_bytes_per_token(self) -> float:
        return self.geometry.num_kv_heads * self.num_bits / 8

    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        return [((self.geometry.num_kv_heads, num_tokens, self.num_bits // 8), torch.uint8)]

    def new_state(self, layer: int) -> HataState:
        return HataState()

    def extend(self, layer: int, state: HataState, keys: torch.Tensor) -> None:
        state.codes.append(pack_codes(keys[:, state.num_tokens:], self.weights[layer]))
        state.num_tokens = keys.shape[1]

    def export(self, state: HataState) -> list[torch.Tensor]:
        return [state.codes.data]

    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> HataState:
        state = HataState()
        state.codes.append(tensors[0])
        state.num_tokens = num_tokens
        return state

    def _query_weights(self, layer: int, device: torch.device) -> torch.Tensor:
        """(num_heads, bits, d): the layer's projections, one per query head (built once per layer and device)."""
        key = (layer, device)
        w = self._per_query_head.get(key)
        if w is None:
            w = self._per_query_head[key] = self.weights[layer].to(device).repeat_interleave(self.geometry.group, dim=0)
        return w

    def _scores(self, layer: int, state: HataState, query: torch.Tensor) -> torch.Tensor:
        """(num_kv_heads, n) float: minus each token's Hamming distance to the query codes, summed over the group."""
        g = self.geometry
        q_codes = pack_codes(query[:, None, :], self._query_weights(layer, query.device))  # (H, 1, bytes)
        codes = state.codes.data  # (kv, n, bytes)
        if codes.shape[-1] % 8:  # NOTE: the int64 popcount below needs whole words (128 bits: 2)
            diff = q_codes.view(g.num_kv_heads, g.group, 1, -1) ^ codes[:, None]
            hamming = torch.take(_POPCOUNT.to(diff.device), diff.long()).sum((1, 3), dtype=torch.int32)
        else:
            hamming = hamming_sum(q_codes.view(torch.int64).view(g.num_kv_heads, g.group, -1),
                                  codes.view(torch.int64))
        return -hamming.float()

    def select(self, layer: int, state: HataState, query: torch.Tensor, k: int) -> torch.Tensor:
        return top_k(self._scores(layer, state, query), k)

    def mark(self, layer: int, state: HataState, query: torch.Tensor, k: int, mask: torch.Tensor) -> None:
        mask.scatter_(1, top_k_unsorted(self._scores(layer, state, query), k), True)


_M1, _M2, _M4, _H01 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F, 0x0101010101010101


def hamming_sum(queries: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """queries (kv, G, words) int64, codes (kv, n, words) int64 → (kv, n) int32: Σ over the group and the words of
    popcount(query ^ code), the same integers as the byte-table lookup (reference.py), ~6× faster: SWAR popcount
    on whole int64 words (torch has no popcount op), the group summed in 4-bit lanes (≤ 3 heads × 4 bits < 16,
    so no lane overflows) before the bytes are added up by one multiply."""
    total = None
    for start in range(0, queries.shape[1], 3):
        acc = None
        for h in range(start, min(start + 3, queries.shape[1])):
            x = codes ^ queries[:, h, None]  # (kv, n, words), a fresh tensor: updated in place below
            x.sub_((x >> 1) & _M1)  # 2-bit lanes: count of their 2 bits (arithmetic >> is masked off by _M1)
            x = (x & _M2).add_((x >> 2) & _M2)  # 4-bit lanes: ≤ 4
            acc = x if acc is None else acc.add_(x)  # ≤ 12 per lane
        x = (acc & _M4).add_((acc >> 4) & _M4)  # bytes: ≤ 24
        x = x.mul_(_H01).bitwise_right_shift_(56).bitwise_and_(255)  # the word's byte sum (≤ 192), in its low byte
        total = x if total is None else total.add_(x)
    return total.sum(-1, dtype=torch.int32)
