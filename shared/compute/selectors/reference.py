"""The reference selection: the selectors' `select` and the decode step's sinks-and-recent floor as they were
before the fast path (issue #33), kept verbatim as the test oracle. The fast path (the selectors' `select`,
floor.py's `_with_sinks_and_recent`) must pick exactly these indices; tests/unit/test_fast_selection.py
checks it. Nothing at runtime calls this module.
"""
from __future__ import annotations

import torch

from shared.compute.selectors.base import row_std, top_k
from shared.compute.selectors.hata import _POPCOUNT, HataSelector, pack_codes
from shared.compute.selectors.infinigen import InfiniGenSelector
from shared.compute.selectors.quest import QuestSelector


def with_sinks_and_recent(idx: torch.Tensor, n: int, sinks: int, recent: int) -> torch.Tensor:
    mask = torch.zeros(idx.shape[0], n, dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx, True)
    mask[:, :sinks] = True
    mask[:, max(0, n - recent):] = True
    width = int(mask.sum(dim=1).max())
    score = mask.float() * 2 + torch.arange(n, device=idx.device) / n  # chosen first, then the most recent
    return score.topk(width, dim=1).indices.sort(dim=1).values


def hata_select(sel: HataSelector, layer: int, state, query: torch.Tensor, k: int) -> torch.Tensor:
    return top_k(*hata_scores(sel, layer, state, query, k))


def hata_scores(sel: HataSelector, layer: int, state, query: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    g = sel.geometry
    w = sel.weights[layer].repeat_interleave(g.group, dim=0)  # (num_heads, bits, d)
    q_codes = pack_codes(query[:, None, :], w).view(g.num_kv_heads, g.group, 1, -1)  # (kv, G, 1, bytes)
    diff = q_codes ^ state.codes.data[:, None]  # (kv, G, n, bytes)
    hamming = torch.take(_POPCOUNT.to(diff.device), diff.long()).sum((1, 3), dtype=torch.int32)  # (kv, n)
    return -hamming.float(), k


def infinigen_select(sel: InfiniGenSelector, layer: int, state, query: torch.Tensor, k: int) -> torch.Tensor:
    return top_k(*infinigen_scores(sel, layer, state, query, k))


def infinigen_scores(sel: InfiniGenSelector, layer: int, state, query: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
    g = sel.geometry
    skew, cols = sel.skew[layer].to(query.device), sel.channels[layer].to(query.device)
    skew, cols = (t.repeat_interleave(g.group, dim=0) for t in (skew, cols))
    skewed = torch.einsum("hnd,hde->hne", query[:, None, :].float(), skew)
    q = torch.gather(skewed, 2, cols[:, None, :].expand(-1, skewed.shape[1], -1)).view(g.num_kv_heads, g.group, -1)
    logits = q @ state.partial_keys.data / g.head_dim ** 0.5  # (kv, G, n): the keys are held (kv, c, n)
    rel = (logits - logits.amax(dim=-1, keepdim=True)).amax(1)  # (kv, n): best over the group
    count = int((rel >= -sel.alpha).sum(-1).max())
    return rel, max(1, min(k, count))


def quest_select(sel: QuestSelector, layer: int, state, query: torch.Tensor, k: int) -> torch.Tensor:
    g, t, n = sel.geometry, sel.geometry.page_tokens, state.num_tokens
    num_full = n // t
    device = query.device
    tail = torch.arange(num_full * t, n, device=device).expand(g.num_kv_heads, -1)
    num_pages = min(num_full, max(0 if tail.shape[1] else 1, (k - tail.shape[1]) // t))
    if num_pages == 0:
        return tail
    lo = state.page_min.data[:, None, :num_full]
    hi = state.page_max.data[:, None, :num_full]
    q = query.float().view(g.num_kv_heads, g.group, 1, -1)
    bound = torch.maximum(q * lo, q * hi).sum(-1)
    pages = top_k(bound.sum(1), num_pages)
    tokens = (pages[..., None] * t + torch.arange(t, device=device)).flatten(1)
    return torch.cat([tokens, tail], dim=1)


def select(selector, layer: int, state, query: torch.Tensor, k: int) -> torch.Tensor:
    """The reference selection of any selector (the ones without a fast path are their own reference)."""
    if isinstance(selector, HataSelector):
        return hata_select(selector, layer, state, query, k)
    if isinstance(selector, InfiniGenSelector):
        return infinigen_select(selector, layer, state, query, k)
    if isinstance(selector, QuestSelector):
        return quest_select(selector, layer, state, query, k)
    return selector.select(layer, state, query, k)


def select_with_floor(selector, layer: int, state, probe: torch.Tensor, k: int, n: int, floor) -> torch.Tensor:
    kept = min(n, floor.sinks + floor.recent)
    scores = {HataSelector: hata_scores, InfiniGenSelector: infinigen_scores}.get(type(selector))
    if floor.stick and state.picked is not None and scores is not None:  # the selection's memory (floor.py)
        s, picks = scores(selector, layer, state, probe, max(1, k - kept))
        m = min(state.picked.shape[1] - 1, n)
        s[:, :m] += state.picked[:, :m] * (row_std(s) * floor.stick)
        idx = top_k(s, picks)
    else:
        idx = select(selector, layer, state, probe, max(1, k - kept))
    return with_sinks_and_recent(idx, n, floor.sinks, floor.recent) if kept else idx
