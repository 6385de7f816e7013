"""`positional`: a fixed profile of relative positions, the same for every query.

The first `num_sinks` tokens (attention sinks) and the most recent tokens fill the budget. This is the
baseline the profile-based proactive path starts from (the KV-profile service adds learned blocks later).
It needs no metadata at all, which is why positions alone can be pushed before anything is known.
"""
from __future__ import annotations

import torch

from services.decode.selectors.base import LayerState, Selector


class PositionalSelector(Selector):
    name = "positional"
    num_sinks = 4

    def metadata_bytes_per_token(self) -> float:
        return 0.0

    def new_state(self, layer: int) -> LayerState:
        return LayerState()

    def extend(self, layer: int, state: LayerState, keys: torch.Tensor) -> None:
        state.num_tokens = keys.shape[1]
        state.device = keys.device

    def select(self, layer: int, state: LayerState, query: torch.Tensor, k: int) -> torch.Tensor:
        n = state.num_tokens
        sinks = min(self.num_sinks, k, n)
        device = getattr(state, "device", None)
        recent = torch.arange(max(sinks, n - (k - sinks)), n, device=device)
        indices = torch.cat([torch.arange(sinks, device=device), recent])
        return indices.expand(self.geometry.num_kv_heads, -1)
