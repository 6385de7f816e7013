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

from shared.compute.selectors.base import Geometry, LayerState, MetadataSpec, Rows, Selector, top_k

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

    def select(self, layer: int, state: HataState, query: torch.Tensor, k: int) -> torch.Tensor:
        g = self.geometry
        w = self.weights[layer].repeat_interleave(g.group, dim=0)  # (num_heads, bits, d)
        q_codes = pack_codes(query[:, None, :], w).view(g.num_kv_heads, g.group, 1, -1)  # (kv, G, 1, bytes)
        diff = q_codes ^ state.codes.data[:, None]  # (kv, G, n, bytes)
        # NOTE: a table lookup per byte; torch has no popcount, and 8 shift-and-mask passes cost 3× as much
        hamming = torch.take(_POPCOUNT.to(diff.device), diff.long()).sum((1, 3), dtype=torch.int32)  # (kv, n)
        return top_k(-hamming.float(), k)
