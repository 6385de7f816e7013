"""The budget floor's token indices: a step's selection is the selector's top picks plus the first `sinks` and the
last `recent` tokens (schemas BudgetFloor), read off one bool mask per KV head by one nonzero, with no top-k and no
sort; `select_with_floor` is the rule the decode step and the prefill's query-aware push share. With the floor's
`stick`, entries the request's earlier steps picked at the layer (`remember_picks`) score higher (the selection's
memory: the union of a request's selections, what a slow link must carry, grows slower)."""
from __future__ import annotations

import torch

from schemas import BudgetFloor
from shared.compute.selectors import LayerState, Selector
from shared.compute.selectors.base import row_std, top_k_unsorted


def _with_sinks_and_recent(idx: torch.Tensor, n: int, sinks: int, recent: int) -> torch.Tensor:
    """`idx` (H_kv, k') with the first `sinks` and the last `recent` of `n` tokens added, per KV head, without
    duplicates; every row gets the longest row's length (a shorter one is topped up with its most recent tokens
    not yet in it), sorted. (H_kv, k'') with k'' ≤ k' + sinks + recent. The same indices as the reference
    (selectors/reference.py, a top-k over a score of every token), by a mask and one nonzero: no top-k, no sort."""
    mask = _floor_mask(idx.shape[0], n, sinks, recent, idx.device)
    mask.scatter_(1, idx, True)
    return _mask_indices(mask, n)


# (num_kv_heads, n, sinks, recent, device) → (num_kv_heads, n) bool with the sinks and the recent window set: built
# once per context length, then every layer of a step (and every row at that length) clones it
_FLOORS: dict[tuple, torch.Tensor] = {}


def _floor_mask(rows: int, n: int, sinks: int, recent: int, device: torch.device) -> torch.Tensor:
    """A fresh (rows, n) bool mask holding the floor: the first `sinks` and the last `recent` tokens."""
    key = (rows, n, sinks, recent, device)
    base = _FLOORS.get(key)
    if base is None:
        if len(_FLOORS) >= 64:  # contexts move on one token a step: keep only recent lengths
            _FLOORS.clear()
        base = _FLOORS[key] = torch.zeros(rows, n, dtype=torch.bool, device=device)
        base[:, :sinks] = True
        base[:, max(0, n - recent):] = True
    return base.clone()


def _mask_indices(mask: torch.Tensor, n: int) -> torch.Tensor:
    """mask (H_kv, n) bool → its set positions (H_kv, width), each row ascending, width the widest row's count: a
    shorter row is topped up with its most recent unset tokens (the reference's rule)."""
    counts = mask.sum(dim=1).tolist()
    width = max(counts)
    if min(counts) < width:
        # row r takes its last (width − count_r) free tokens: those whose running count of free tokens exceeds
        # n − width (row r has n − count_r free tokens in all). Past the last of them every token is set already,
        # so OR-ing the whole comparison in sets exactly those.
        mask |= (~mask).cumsum(1) > n - width
    return mask.nonzero()[:, 1].view(mask.shape[0], width)  # row-major: each row ascending


def floor_scores(selector: Selector, layer: int, state: LayerState, probe: torch.Tensor, n: int,
                 floor: BudgetFloor) -> tuple[torch.Tensor, int] | None:
    """For selectors that rank tokens (`token_scores`): (scores (H_kv, n) float with the selection's memory applied,
    the selector's own cap on picks), which `select_with_floor` picks from under any budget, so one scoring serves a
    step's selection, its wider ranking (path 3) and a read-behind selection; None for the other selectors."""
    scored = selector.token_scores(layer, state, probe, n)  # NOTE: k = n: the cap is the selector's own (InfiniGen's α)
    if scored is None:
        return None
    scores, cap = scored
    if floor.stick and state.picked is not None:
        prefer_picked(scores, state.picked, floor.stick)
    return scores, cap


def select_with_floor(selector: Selector, layer: int, state: LayerState, probe: torch.Tensor, k: int, n: int,
                      floor: BudgetFloor, absent: torch.Tensor | None = None,
                      scored: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """The (H_kv, k'') token indices a step with query `probe` (H, d) attends to over `n` cached tokens under a
    budget of `k` tokens per KV head: the selector's top k − (sinks + recent), plus the sinks and the recent
    window (the decode step's rule, shared with the prefill's query-aware push). The selector marks its picks in a
    mask that already holds the floor (`Selector.mark`), and one nonzero reads the indices off it. `absent`
    (H_kv, N ≤ n) bool, for selectors that rank tokens (`token_scores`): entries not on this node, picked (best first)
    only where a row has fewer other candidates than picks (a step that does not stall, services/decode/read_behind.py).
    `scored`: this step's `floor_scores` at the layer, if the caller has them (never changed here)."""
    kept = min(n, floor.sinks + floor.recent)
    picks = max(1, k - kept)
    if scored is None and (absent is not None or (floor.stick and state.picked is not None)):
        scored = floor_scores(selector, layer, state, probe, n, floor)
    if not kept and scored is None:
        return selector.select(layer, state, probe, picks)
    mask = _floor_mask(selector.geometry.num_kv_heads, n, floor.sinks, floor.recent, probe.device)
    if scored is None:
        selector.mark(layer, state, probe, picks, mask)
    else:
        scores, cap = scored
        if absent is not None:  # below every other entry of its row, in their own order
            span = scores.amax(dim=1, keepdim=True) - scores.amin(dim=1, keepdim=True) + 1
            scores = scores.clone()
            scores[:, :absent.shape[1]].sub_(absent * span)
        mask.scatter_(1, top_k_unsorted(scores, min(picks, cap)), True)
    return _mask_indices(mask, n)


def select_rows_with_floor(selector: Selector, layer: int, states: list[LayerState], probes: torch.Tensor,
                          ks: list[int], ns: list[int], floor: BudgetFloor) -> list[torch.Tensor]:
    """`select_with_floor` for several rows of one decode step at one layer (row r: states[r], probe probes[r]
    (H, d), budget ks[r] of ns[r] cached tokens), the same indices in fewer ops: one mask (R, H_kv, max n) holds
    every row's floor, the selector marks all rows (`Selector.mark_rows`), one nonzero reads every row's indices.
    For selectors that mark, not score: no selection's memory, no absent entries (`select_with_floor`'s case without
    scores, where a floor that keeps nothing asks `select` for the set `mark` marks)."""
    assert not any(floor.stick and state.picked is not None for state in states), "a selection's memory scores tokens"
    device, width = probes.device, max(ns)
    kept = [min(n, floor.sinks + floor.recent) for n in ns]
    at = torch.arange(width, device=device)
    n_of = torch.tensor(ns, device=device)[:, None, None]  # (R, 1, 1)
    recent_from = (n_of - floor.recent).clamp_(min=0)
    masks = ((at < floor.sinks) | (at >= recent_from)) & (at < n_of)  # (R, 1, width): the floor
    masks = masks.expand(-1, selector.geometry.num_kv_heads, -1).contiguous()
    selector.mark_rows(layer, states, probes, [max(1, k - kept_r) for k, kept_r in zip(ks, kept)], masks)
    return _masks_indices(masks, n_of)


def _masks_indices(masks: torch.Tensor, n_of: torch.Tensor) -> list[torch.Tensor]:
    """masks (R, H_kv, width) bool, row r's tokens below n_of[r] → `_mask_indices` of each row: (H_kv, width_r) set
    positions per row, each KV head's ascending, a head short of its row's widest topped up with its most recent
    unset tokens. One sum, one nonzero for all rows."""
    counts = masks.sum(dim=2)  # (R, H_kv)
    widest = counts.amax(dim=1)  # (R,)
    if bool((counts < widest[:, None]).any()):  # as `_mask_indices`, among each row's own n tokens only
        inside = torch.arange(masks.shape[2], device=masks.device) < n_of
        masks |= inside & ((~masks & inside).cumsum(2) > n_of - widest[:, None, None])
    heads = masks.shape[1]
    sizes = (widest * heads).tolist()
    columns = masks.nonzero()[:, 2]  # row-major: row by row, head by head, each ascending
    return [part.view(heads, size // heads) for part, size in zip(columns.split(sizes), sizes)]


def prefer_picked(scores: torch.Tensor, picked: torch.Tensor, stick: float) -> None:
    """scores (H_kv, n) += stick × each row's standard deviation at the entries `picked` (H_kv, N + 1) marks."""
    m = min(picked.shape[1] - 1, scores.shape[1])
    bonus = row_std(scores).mul_(stick)  # (H_kv, 1), in the selector's own units
    scores[:, :m].addcmul_(picked[:, :m], bonus)


def remember_picks(state: LayerState, idx: torch.Tensor, n: int, floor: BudgetFloor) -> None:
    """A step selected `idx` (H_kv, k) of `n` cached tokens at this layer: the selection's memory marks them (the
    first step fixes N = n; later tokens, never remote, are not remembered)."""
    if not floor.stick:
        return
    if state.picked is None:
        state.picked = torch.zeros(idx.shape[0], n + 1, dtype=torch.float32, device=idx.device)
    state.picked.scatter_(1, idx.clamp(max=state.picked.shape[1] - 1), 1.0)
