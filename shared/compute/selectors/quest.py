"""`quest`: per-page min/max key bounds (Quest, Tang et al. 2024).

Each page of `page_tokens` tokens keeps the channel-wise minimum and maximum of its keys. A page's score
for a query is the upper bound of q·k over it, Σ_d max(q_d·min_d, q_d·max_d), summed over the query heads
of a KV head's group. The newest page, while partly filled, is always kept; the top full pages fill the
rest of the budget, selected whole. Bounds are updated incrementally (min/max are exact), so extending
never reads keys it has seen before. The bounds travel in the KV store's dtype (Geometry.kv_dtype): min and
max of keys kept in bf16 are bf16 values, so that is exact and half the bytes of fp32.
"""
from __future__ import annotations

import math

import torch

from shared.compute.selectors.base import LayerState, MetadataSpec, Rows, Selector, top_k


class QuestState(LayerState):
    def __init__(self) -> None:
        self.page_min = Rows()  # (num_kv_heads, pages, head_dim) float32, the last page possibly partial
        self.page_max = Rows()


class QuestSelector(Selector):
    name = "quest"

    def metadata_bytes_per_token(self) -> float:
        g = self.geometry
        return 2 * g.num_kv_heads * g.head_dim * g.kv_dtype.itemsize / g.page_tokens

    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        g = self.geometry
        shape = (g.num_kv_heads, math.ceil(num_tokens / g.page_tokens), g.head_dim)
        return [(shape, g.kv_dtype), (shape, g.kv_dtype)]

    def new_state(self, layer: int) -> QuestState:
        return QuestState()

    def extend(self, layer: int, state: QuestState, keys: torch.Tensor) -> None:
        t, start = self.geometry.page_tokens, state.num_tokens
        fresh = keys[:, start:].float()
        if fresh.shape[1] == 0:
            return
        room = (-start) % t  # free slots in the last, partial page
        if room:
            head, fresh = fresh[:, :room], fresh[:, room:]
            last_min, last_max = state.page_min.data[:, -1], state.page_max.data[:, -1]
            last_min.copy_(torch.minimum(last_min, head.amin(dim=1)))
            last_max.copy_(torch.maximum(last_max, head.amax(dim=1)))
        if fresh.shape[1]:
            pad = (-fresh.shape[1]) % t  # pad a new partial page with its own last key (min/max unchanged)
            if pad:
                fresh = torch.cat([fresh, fresh[:, -1:].expand(-1, pad, -1)], dim=1)
            pages = fresh.view(fresh.shape[0], -1, t, fresh.shape[-1])
            state.page_min.append(pages.amin(dim=2))
            state.page_max.append(pages.amax(dim=2))
        state.num_tokens = keys.shape[1]

    def export(self, state: QuestState) -> list[torch.Tensor]:
        dtype = self.geometry.kv_dtype  # NOTE: exact when the keys were kept in it (the prefill reads them back)
        return [state.page_min.data.to(dtype), state.page_max.data.to(dtype)]

    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> QuestState:
        state = QuestState()
        state.page_min.append(tensors[0].float())
        state.page_max.append(tensors[1].float())
        state.num_tokens = num_tokens
        return state

    def select(self, layer: int, state: QuestState, query: torch.Tensor, k: int) -> torch.Tensor:
        g, t, n = self.geometry, self.geometry.page_tokens, state.num_tokens
        num_full = n // t
        device = query.device
        tail = torch.arange(num_full * t, n, device=device).expand(g.num_kv_heads, -1)  # the partial newest page
        num_pages = min(num_full, max(0 if tail.shape[1] else 1, (k - tail.shape[1]) // t))  # never select nothing
        if num_pages == 0:
            return tail
        lo = state.page_min.data[:, None, :num_full]  # (kv, 1, pages, d)
        hi = state.page_max.data[:, None, :num_full]
        q = query.float().view(g.num_kv_heads, g.group, 1, -1)  # (kv, G, 1, d)
        bound = torch.maximum(q * lo, q * hi).sum(-1)  # (kv, G, pages): the most q·k can be in each page
        pages = top_k(bound.sum(1), num_pages)  # (num_kv_heads, num_pages)
        tokens = (pages[..., None] * t + torch.arange(t, device=device)).flatten(1)
        return torch.cat([tokens, tail], dim=1)  # ascending: full pages come before the partial one
