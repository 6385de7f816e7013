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
        self.page_min: torch.Tensor | None = None  # (num_kv_heads, pages, head_dim)
        self.page_max: torch.Tensor | None = None


class QuestSelector(Selector):
    name = "quest"

    def metadata_bytes_per_token(self) -> float:
        g = self.geometry
        return 2 * g.num_kv_heads * g.head_dim * 4 / g.page_tokens

    def new_state(self, layer: int) -> QuestState:
        return QuestState()

    def extend(self, layer: int, state: QuestState, keys: torch.Tensor) -> None:
        t, n = self.geometry.page_tokens, keys.shape[1]
        first = state.num_tokens // t  # the last, partial page is recomputed
        fresh = keys[:, first * t:].float()
        pad = (-fresh.shape[1]) % t  # pad the new partial page with its own first key (min/max unchanged)
        if pad:
            fresh = torch.cat([fresh, fresh[:, -1:].expand(-1, pad, -1)], dim=1)
        pages = fresh.view(fresh.shape[0], -1, t, fresh.shape[-1])
        lo, hi = pages.amin(dim=2), pages.amax(dim=2)
        keep = lambda old: old[:, :first] if old is not None else lo[:, :0]  # noqa: E731
        state.page_min = torch.cat([keep(state.page_min), lo], dim=1)
        state.page_max = torch.cat([keep(state.page_max), hi], dim=1)
        state.num_tokens = n

    def select(self, layer: int, state: QuestState, query: torch.Tensor, k: int) -> torch.Tensor:
        g, t, n = self.geometry, self.geometry.page_tokens, state.num_tokens
        num_full = n // t
        device = state.page_min.device
        tail = torch.arange(num_full * t, n, device=device).expand(g.num_kv_heads, -1)  # the partial newest page
        num_pages = min(num_full, max(0 if tail.shape[1] else 1, (k - tail.shape[1]) // t))  # never select nothing
        if num_pages == 0:
            return tail
        lo, hi = state.page_min[:, None, :num_full], state.page_max[:, None, :num_full]  # (kv, 1, pages, d)
        q = query.float().view(g.num_kv_heads, g.group, 1, -1)  # (kv, G, 1, d)
        bound = torch.maximum(q * lo, q * hi).sum(-1)  # (kv, G, pages): the most q·k can be in each page
        pages = top_k(bound.sum(1), num_pages)  # (num_kv_heads, num_pages)
        tokens = (pages[..., None] * t + torch.arange(t, device=device)).flatten(1)
        return torch.cat([tokens, tail], dim=1)  # ascending: full pages come before the partial one
