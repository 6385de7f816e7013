"""`quest`: per-page min/max key bounds (Quest, Tang et al. 2024).

Each page of `page_tokens` tokens keeps the channel-wise minimum and maximum of its keys. A page's score
for a query is the upper bound of q·k over it, Σ_d max(q_d·min_d, q_d·max_d), summed over the query heads
of a KV head's group. The newest page, while partly filled, is always kept; the top full pages fill the
rest of the budget, selected whole. Bounds are updated incrementally (min/max), so extending never reads keys it
has seen before.

The bounds travel as 8-bit codes rounded outward (quantization.py `bound_codes`: per page and KV head, min and max
each a vector of codes with an fp16 scale and minimum, 136 bytes against bf16's 256), so a restored bound is still a
bound (a page's score can only rise, by at most about 1/255 of the vector's range a channel). And every node scores
over those rounded bounds, the node that made them too: pages a bulk `extend` appends (the prompt's) are rounded
there, and later tokens update the rounded bounds with min/max, alike on every node — so the prefill's own
selection, colocated-selective's and smartgen's decode node's are the same, and exact KV still decodes the same tokens
wherever it was computed (the way InfiniGen's partial keys are rounded to the KV's dtype on every node).
"""
from __future__ import annotations

import math

import torch

from shared.compute.quantization import bound_codes, bound_values
from shared.compute.selectors.base import LayerState, MetadataSpec, Rows, Selector, top_k_unsorted


class QuestState(LayerState):
    def __init__(self) -> None:
        self.page_min = Rows()  # (num_kv_heads, pages, head_dim) float32, the last page possibly partial: the
        self.page_max = Rows()  # rounded bounds every node scores with
        self.codes: list[Rows] | None = None  # what travels: bound_codes of the pages as bulk extends made them
        self.codes_stale = False  # a later token moved a page's bounds: the codes no longer give them


class QuestSelector(Selector):
    name = "quest"

    def metadata_bytes_per_token(self) -> float:
        g = self.geometry
        return g.num_kv_heads * (2 * g.head_dim + 4 * 2) / g.page_tokens

    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        g = self.geometry
        pages = math.ceil(num_tokens / g.page_tokens)
        return [((g.num_kv_heads, pages, g.head_dim), torch.uint8), ((g.num_kv_heads, pages, g.head_dim), torch.uint8),
                ((g.num_kv_heads, pages, 4), torch.float16)]  # min codes, max codes, their scales and minima

    def new_state(self, layer: int) -> QuestState:
        return QuestState()

    def extend(self, layer: int, state: QuestState, keys: torch.Tensor) -> None:
        t, start = self.geometry.page_tokens, state.num_tokens
        room = (-start) % t  # free slots in the last, partial page
        if room and keys.shape[1] == start + 1:  # a decode step's one token into it: two in-place ops (a key's own
            key = keys[:, start]  # min and max are the key; the ops take bf16 keys into the fp32 bounds exactly)
            last_min, last_max = state.page_min.last(), state.page_max.last()
            torch.minimum(last_min, key, out=last_min)
            torch.maximum(last_max, key, out=last_max)
            state.num_tokens = start + 1
            state.codes_stale = True
            return
        fresh = keys[:, start:].float()
        if fresh.shape[1] == 0:
            return
        if room:
            head, fresh = fresh[:, :room], fresh[:, room:]
            last_min, last_max = state.page_min.last(), state.page_max.last()
            torch.minimum(last_min, head.amin(dim=1), out=last_min)
            torch.maximum(last_max, head.amax(dim=1), out=last_max)
            state.codes_stale = True
        if fresh.shape[1]:
            pad = (-fresh.shape[1]) % t  # pad a new partial page with its own last key (min/max unchanged)
            if pad:
                fresh = torch.cat([fresh, fresh[:, -1:].expand(-1, pad, -1)], dim=1)
            pages = fresh.view(fresh.shape[0], -1, t, fresh.shape[-1])
            self._append_rounded(state, bound_codes(pages.amin(dim=2), pages.amax(dim=2)))
        state.num_tokens = keys.shape[1]

    @staticmethod
    def _append_rounded(state: QuestState, codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Pages as their codes give them: the bounds every node scores with, and the codes that travel."""
        page_min, page_max = bound_values(*codes)
        state.page_min.append(page_min)
        state.page_max.append(page_max)
        if state.codes is None:
            state.codes = [Rows(), Rows(), Rows()]
        for rows, part in zip(state.codes, codes):
            rows.append(part)

    def export(self, state: QuestState) -> list[torch.Tensor]:
        # NOTE: the prefill node exports right after the prompt's extend; a later token's update has no codes
        assert not state.codes_stale, "quest exports the bounds as the prompt's extend rounded them"
        return [rows.data for rows in state.codes]

    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> QuestState:
        state = QuestState()
        self._append_rounded(state, tuple(tensors))  # Rows copy: the caller's buffer may be reused
        state.num_tokens = num_tokens
        return state

    def _pages(self, state: QuestState, query: torch.Tensor, k: int) -> tuple[torch.Tensor | None, int, int]:
        """The selected full pages (num_kv_heads, num_pages), unsorted (None: none, only the partial newest page),
        the number of full pages and of tokens cached."""
        num_full, n, num_pages = self._plan(state, k)
        if num_pages == 0:
            return None, num_full, n
        up, down = self._query_sides(query[None])
        return top_k_unsorted(self._bound(state, num_full, up[0], down[0]), num_pages), num_full, n

    def _plan(self, state: QuestState, k: int) -> tuple[int, int, int]:
        """(full pages, tokens cached, full pages to select) for a budget of k tokens: the partial newest page is
        always kept, and never nothing is selected."""
        t, n = self.geometry.page_tokens, state.num_tokens
        num_full = n // t
        tail = n - num_full * t  # tokens of the partial newest page
        return num_full, n, min(num_full, max(0 if tail else 1, (k - tail) // t))

    def _query_sides(self, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """queries (R, H, d) → (Σ_g max(q_g, 0), Σ_g min(q_g, 0)), each (R, kv, 1, d): a KV head's group summed.

        The most q·k can be in a page, summed over the KV head's group of query heads, is Σ_g Σ_d max(q_gd·lo_d,
        q_gd·hi_d). lo ≤ hi, so the larger product is q·hi where q ≥ 0 and q·lo where q < 0: Σ_g (q_g⁺·hi + q_g⁻·lo),
        linear in q⁺ and q⁻, so the group's sum comes first and the bound is one row per KV head times the pages'
        bounds (`_bound`), a G-th of the work of a row per query head: 22/27/39 µs a bound at 2K/4K/8K on one
        thread here against 26/37/64 (docs/results/select-together-2026-12-07). NOTE: the same terms as
        reference.py's, summed in another order (last bits only; the reference's pages in every test)."""
        g = self.geometry
        q = queries.float().view(queries.shape[0], g.num_kv_heads, g.group, -1)
        return q.clamp(min=0).sum(2, keepdim=True), q.clamp(max=0).sum(2, keepdim=True)

    def _bound(self, state: QuestState, num_full: int, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """(kv, full pages): each full page's bound for one row's `_query_sides` (kv, 1, d)."""
        lo = state.page_min.data[:, :num_full]  # (kv, pages, d)
        hi = state.page_max.data[:, :num_full]
        return torch.baddbmm(torch.bmm(down, lo.transpose(1, 2)), up, hi.transpose(1, 2))[:, 0]

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

    def mark_rows(self, layer: int, states: list[QuestState], queries: torch.Tensor, picks: list[int],
                  masks: torch.Tensor) -> None:
        """`Selector.mark_rows` in fewer ops than row by row where every row has as many full pages and picks (a batch
        of equal contexts): queries (R, H, d), masks (R, kv, ≥ n_r) bool; the query sides, the top-k and the scatter
        are one op for all rows, each row's bound its own product (its bounds live in its own `Rows`), the same bound
        bit for bit as `mark`'s, so the same pages. Rows of different contexts: row by row (`mark`)."""
        plans = [self._plan(state, k) for state, k in zip(states, picks)]
        if len({(num_full, num_pages) for num_full, _, num_pages in plans}) > 1:
            super().mark_rows(layer, states, queries, picks, masks)
            return
        t, (num_full, _, num_pages) = self.geometry.page_tokens, plans[0]
        for r, (_, n, _) in enumerate(plans):
            masks[r, :, num_full * t: n] = True  # the partial newest page
        if num_pages:
            up, down = self._query_sides(queries)
            bounds = torch.stack([self._bound(state, num_full, up[r], down[r]) for r, state in enumerate(states)])
            pages = top_k_unsorted(bounds, num_pages)  # (R, kv, pages)
            whole = masks[:, :, : num_full * t].view(*masks.shape[:2], num_full, t)
            whole.scatter_(2, pages[..., None].expand(-1, -1, -1, t), True)
