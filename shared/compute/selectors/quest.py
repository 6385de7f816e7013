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

from shared.compute.selectors.base import LayerState, MetadataSpec, Rows, Selector, top_k_unsorted


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
            if head.shape[1] == 1:  # a decode step's one token: two in-place ops (min/max of one key is the key)
                torch.minimum(last_min, head[:, 0], out=last_min)
                torch.maximum(last_max, head[:, 0], out=last_max)
            else:
                torch.minimum(last_min, head.amin(dim=1), out=last_min)
                torch.maximum(last_max, head.amax(dim=1), out=last_max)
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

    def _pages(self, state: QuestState, query: torch.Tensor, k: int) -> tuple[torch.Tensor | None, int, int]:
        """The selected full pages (num_kv_heads, num_pages), unsorted (None: none, only the partial newest page),
        the number of full pages and of tokens cached."""
        g, t, n = self.geometry, self.geometry.page_tokens, state.num_tokens
        num_full = n // t
        tail = n - num_full * t  # tokens of the partial newest page
        num_pages = min(num_full, max(0 if tail else 1, (k - tail) // t))  # never select nothing
        if num_pages == 0:
            return None, num_full, n
        lo = state.page_min.data[:, :num_full]  # (kv, pages, d)
        hi = state.page_max.data[:, :num_full]
        q = query.float().view(g.num_kv_heads, g.group, -1)  # (kv, G, d)
        # the most q·k can be in each page, Σ_d max(q_d·lo_d, q_d·hi_d): lo ≤ hi, so the larger product is q·hi where
        # q ≥ 0 and q·lo where q < 0, and the bound is two matrix products, min(q, 0)·loᵀ + max(q, 0)·hiᵀ: one
        # baddbmm over all heads instead of elementwise passes over a (kv, G, pages, d) tensor. NOTE: the same terms as
        # reference.py's, summed over d in another order (last bits only; its pages in every test and in 400 random
        # 2K/8K selections: docs/results/decode-step-2026-12-07)
        bound = torch.baddbmm(torch.bmm(q.clamp(max=0), lo.transpose(1, 2)), q.clamp(min=0), hi.transpose(1, 2))
        return top_k_unsorted(bound.sum(1), num_pages), num_full, n

    def select(self, layer: int, state: QuestState, query: torch.Tensor, k: int) -> torch.Tensor:
        t = self.geometry.page_tokens
        pages, num_full, n = self._pages(state, query, k)
        tail = torch.arange(num_full * t, n, device=query.device).expand(self.geometry.num_kv_heads, -1)
        if pages is None:
            return tail
        pages = torch.sort(pages, dim=-1).values
        tokens = (pages[..., None] * t + torch.arange(t, device=query.device)).flatten(1)
        return torch.cat([tokens, tail], dim=1)  # ascending: full pages come before the partial one

    def mark(self, layer: int, state: QuestState, query: torch.Tensor, k: int, mask: torch.Tensor) -> None:
        t = self.geometry.page_tokens
        pages, num_full, n = self._pages(state, query, k)
        mask[:, num_full * t: n] = True  # the partial newest page
        if pages is not None:  # every token of each selected page: one scatter over (kv, pages, t)
            whole = pages[..., None].expand(-1, -1, t)
            mask[:, : num_full * t].view(mask.shape[0], num_full, t).scatter_(1, whole, True)
