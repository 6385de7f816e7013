"""`oracle`: exact attention top-k for the current query — the quality reference.

Per KV head it keeps the k tokens with the most attention probability summed over the query heads that
share it, so no selector can capture more attention mass at the same budget. Its metadata is the keys
themselves (the whole K), which is why it is a reference and not a transfer strategy.
"""
from __future__ import annotations

import torch

from services.decode.selectors.base import LayerState, Selector, top_k


class OracleState(LayerState):
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # a view of the cache's keys (num_kv_heads, n, head_dim)


class OracleSelector(Selector):
    name = "oracle"

    def metadata_bytes_per_token(self) -> float:
        return self.geometry.num_kv_heads * self.geometry.head_dim * 4

    def new_state(self, layer: int) -> OracleState:
        return OracleState()

    def extend(self, layer: int, state: OracleState, keys: torch.Tensor) -> None:
        state.keys, state.num_tokens = keys, keys.shape[1]

    def select(self, layer: int, state: OracleState, query: torch.Tensor, k: int) -> torch.Tensor:
        g = self.geometry
        q = query.float().view(g.num_kv_heads, g.group, -1)  # (kv, G, d)
        probs = torch.softmax(q @ state.keys.float().transpose(1, 2) / g.head_dim ** 0.5, dim=-1)  # (kv, G, n)
        return top_k(probs.sum(1), k)
