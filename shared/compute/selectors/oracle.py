"""`oracle`: exact attention top-k for the current query — the quality reference.

Per KV head it keeps the k tokens with the most attention probability summed over the query heads that
share it, so no selector can capture more attention mass at the same budget. Its metadata is a copy of the
keys themselves (the whole K), which is why it is a reference and not a transfer strategy: in the
selective transfer modes the prefill node pushes all of K ahead as metadata.
"""
from __future__ import annotations

import torch

from shared.compute.selectors.base import LayerState, MetadataSpec, Rows, Selector, top_k


class OracleState(LayerState):
    def __init__(self) -> None:
        self.keys = Rows()  # (num_kv_heads, n, head_dim) float32


class OracleSelector(Selector):
    name = "oracle"

    def metadata_bytes_per_token(self) -> float:
        return self.geometry.num_kv_heads * self.geometry.head_dim * 4

    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        return [((self.geometry.num_kv_heads, num_tokens, self.geometry.head_dim), torch.float32)]

    def new_state(self, layer: int) -> OracleState:
        return OracleState()

    def extend(self, layer: int, state: OracleState, keys: torch.Tensor) -> None:
        state.keys.append(keys[:, state.num_tokens:].float())
        state.num_tokens = keys.shape[1]

    def export(self, state: OracleState) -> list[torch.Tensor]:
        return [state.keys.data]

    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> OracleState:
        state = OracleState()
        state.keys.append(tensors[0])
        state.num_tokens = num_tokens
        return state

    def select(self, layer: int, state: OracleState, query: torch.Tensor, k: int) -> torch.Tensor:
        g = self.geometry
        q = query.float().view(g.num_kv_heads, g.group, -1)  # (kv, G, d)
        probs = torch.softmax(q @ state.keys.data.transpose(1, 2) / g.head_dim ** 0.5, dim=-1)  # (kv, G, n)
        return top_k(probs.sum(1), k)
