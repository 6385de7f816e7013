"""`oracle`: exact attention top-k for the current query — the quality reference.

Per KV head it keeps the k tokens with the most attention probability summed over the query heads that
share it, so no selector can capture more attention mass at the same budget. Its metadata is a copy of the
keys themselves (the whole K), which is why it is a reference and not a transfer strategy: in the
selective transfer modes the prefill node pushes all of K ahead as metadata.
"""
from __future__ import annotations

import torch

from shared.compute.selectors.base import Geometry, LayerState, MetadataSpec, Rows, Selector, top_k


def attention_mass(g: Geometry, query: torch.Tensor, keys_by_column: torch.Tensor) -> torch.Tensor:
    """(num_kv_heads, n) float32: each token's attention probability, summed over the query heads of its KV head.
    query (num_heads, head_dim); keys_by_column (num_kv_heads, head_dim, n) float32, a column a token."""
    q = query.float().view(g.num_kv_heads, g.group, -1)  # (kv, G, d)
    logits = torch.bmm(q, keys_by_column).mul_(g.head_dim ** -0.5)  # (kv, G, n)
    return torch.softmax(logits, dim=-1).sum(1)


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
        return top_k(attention_mass(self.geometry, query, state.keys.data.transpose(1, 2)), k)
