"""`positional`: a fixed choice of relative positions, the same for every query.

The first `num_sinks` tokens (attention sinks) and the most recent tokens fill the budget. It needs no
metadata at all, which is why positions alone can be pushed before anything is known; it is also the
profile the KV-profile service falls back to when it holds none for a request (shared/runtime/profiles.py).
"""
from __future__ import annotations

import torch

from shared.compute.selectors.base import LayerState, MetadataSpec, Selector


class PositionalSelector(Selector):
    name = "positional"
    num_sinks = 4

    def metadata_bytes_per_token(self) -> float:
        return 0.0

    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        return []

    def new_state(self, layer: int) -> LayerState:
        return LayerState()

    def extend(self, layer: int, state: LayerState, keys: torch.Tensor) -> None:
        state.num_tokens = keys.shape[1]

    def export(self, state: LayerState) -> list[torch.Tensor]:
        return []

    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> LayerState:
        state = LayerState()
        state.num_tokens = num_tokens
        return state

    def select(self, layer: int, state: LayerState, query: torch.Tensor, k: int) -> torch.Tensor:
        n = state.num_tokens
        sinks = min(self.num_sinks, k, n)
        device = query.device
        recent = torch.arange(max(sinks, n - (k - sinks)), n, device=device)
        indices = torch.cat([torch.arange(sinks, device=device), recent])
        return indices.expand(self.geometry.num_kv_heads, -1)

    def mark(self, layer: int, state: LayerState, query: torch.Tensor, k: int, mask: torch.Tensor) -> None:
        n = state.num_tokens
        sinks = min(self.num_sinks, k, n)
        mask[:, :sinks] = True
        mask[:, max(sinks, n - (k - sinks)): n] = True
