"""`quest`: per-page min/max key bounds (Quest, Tang et al. 2024).

Each page of `page_tokens` tokens keeps the channel-wise minimum and maximum of its keys. A page's score
for a query is the upper bound of q·k over it, Σ_d max(q_d·min_d, q_d·max_d), summed over the query heads
of a KV head's group. The newest page, while partly filled, is always kept; the top full pages fill the
rest of the budget, selected whole.
"""
from __future__ import annotations

import torch

from services.decode.selectors.base import LayerState, Selector, top_k


class QuestState(LayerState):
    def __init__(self) -> None:
        self.page_min: list[torch.Tensor] = []  # per page (num_kv_heads, head_dim)
        self.page_max: list[torch.Tensor] = []


class QuestSelector(Selector):
    name = "quest"

    def metadata_bytes_per_token(self) -> float:
        g = self.geometry
        return 2 * g.num_kv_heads * g.head_dim * 4 / g.page_tokens

    def new_state(self, layer: int) -> QuestState:
        return QuestState()

    def extend(self, layer: int, state: QuestState, keys: torch.Tensor) -> None:
        t = self.geometry.page_tokens
        n = keys.shape[1]
        first = (state.num_tokens // t) * t  # recompute the last, partial page
        del state.page_min[first // t:], state.page_max[first // t:]
        for start in range(first, n, t):
            page = keys[:, start: start + t].float()
            state.page_min.append(page.amin(dim=1))
            state.page_max.append(page.amax(dim=1))
        state.num_tokens = n

    def select(self, layer: int, state: QuestState, query: torch.Tensor, k: int) -> torch.Tensor:
        g, t, n = self.geometry, self.geometry.page_tokens, state.num_tokens
        num_full = n // t
        tail = torch.arange(num_full * t, n).expand(g.num_kv_heads, -1)  # the partial newest page, if any
        num_pages = min(num_full, max(0, (k - tail.shape[1]) // t))
        if num_pages == 0:
            return tail
        lo = torch.stack(state.page_min[:num_full], dim=1).repeat_interleave(g.group, dim=0)  # (heads, pages, d)
        hi = torch.stack(state.page_max[:num_full], dim=1).repeat_interleave(g.group, dim=0)
        q = query.float()[:, None, :]
        bound = torch.maximum(q * lo, q * hi).sum(-1)  # (num_heads, pages): the most q·k can be in each page
        pages = top_k(self.group_sum(bound), num_pages)  # (num_kv_heads, num_pages)
        tokens = (pages[..., None] * t + torch.arange(t)).flatten(1)
        return torch.cat([tokens, tail], dim=1)  # ascending: full pages come before the partial one
