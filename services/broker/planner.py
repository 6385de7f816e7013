"""What a request's transfer plan says: which mode (for `auto`), which blocks the prefill pushes while it
computes, and in what order the rest follows. Pure arithmetic over the profile; no I/O.

The budget (path 1, docs/architecture.md "The three transfer paths"): pushes may take as long as the prefill itself, so
    bytes that fit = link rate × T_prefill,   T_prefill = N / measured prefill rate,
i.e. n_push ≈ N_blocks · T_prefill / T_full. The selector metadata is pushed first (decode cannot select
without it), then layers 0–1 in full (they stay dense), then, per layer, the tokens the prompt's own last
query selects (`query_tokens` per KV head: what step 1 will attend to, as far as the budget allows), then
profile blocks in importance order with what is left.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas import (DEFAULT_KV_BUDGET, DENSE_LAYERS, OpenPlan, TransferPlan, mode_of, num_pages as pages_of, pack_bits,
                     pushed_aux_bytes, wire_entry_bytes)
from schemas.transfer import Push
from shared.profiles import page_importance

AUTO_MARGIN = 1.0  # auto picks full when T_full ≤ AUTO_MARGIN × T_prefill: full then hides behind the prefill
# NOTE: the push may fill this share of the link time the prefill takes, not all of it: the last layer's blocks
# exist only when the prefill ends, and decode waits for every pushed byte before its first step (measured on a
# paced link: a full budget left 1–3 s of pushes after a 10 s prefill)
PUSH_MARGIN = 0.8
# The query-aware push selects this many times step 1's budget: the last prompt position and the first decoded
# one pick largely, not exactly, the same entries. Measured on SmolLM2 with quest at 10% under the default floor
# (`python -m tools.bench.query_overlap`), the share of step 1's selection inside the push, 1.1K (2.1K) tokens:
# 0.90 (0.81) at 1×, 0.97 (0.93) at 1.5×, 0.99 (0.96) at 2×, 1.00 (0.98) at 3× — 2× buys most of it.
QUERY_PUSH_FACTOR = 2


@dataclass(frozen=True)
class LinkEstimate:
    gbps: float  # 10⁹ bit/s
    prefill_tokens_per_s: float
    source: str  # "measured" or "default"


@dataclass
class PlannedTransfer:
    plan: TransferPlan
    queue: list[int]  # the speculative queue: blocks (flat layer·num_pages + page) not pushed, most important first


def transfer_seconds(num_bytes: float, gbps: float) -> float:
    return num_bytes * 8 / (gbps * 1e9)


def choose_mode(req: OpenPlan, link: LinkEstimate) -> tuple[str, str]:
    """`auto`: (mode, reason). Full transfer wins when it fits behind the prefill (fast link, short prompt):
    it keeps attention dense and costs nothing extra; otherwise selective transfer with SmartGen's paths."""
    t_prefill = req.num_tokens / link.prefill_tokens_per_s
    t_full = transfer_seconds(req.num_tokens * req.layout.token_bytes, link.gbps)
    ratio = t_full / t_prefill
    facts = (f"full transfer {t_full:.3g} s vs prefill {t_prefill:.3g} s (R = {ratio:.2f}) on a {link.gbps:.3g} Gbit/s "
             f"link ({link.source}) for {req.num_tokens} tokens")
    if ratio <= AUTO_MARGIN:
        return "full", f"{facts}: the whole KV fits behind the prefill"
    return "smartgen", f"{facts}: full transfer would stall decoding"


def plan_transfer(req: OpenPlan, mode: str, importance: np.ndarray | None, link: LinkEstimate, broker_id: str,
                  profile: tuple[str, int, str] = ("", 0, ""), reason: str = "", selector: str = "") -> PlannedTransfer:
    """The plan for `mode` (already resolved), run with `selector` ("" = dense). `importance` (num_layers, M)
    orders blocks for the modes that order them by profile (smartgen)."""
    lay = req.layout
    num_pages = pages_of(req.num_tokens, lay.page_tokens)
    num_blocks = lay.num_layers * num_pages
    base = dict(request_id=req.request_id, mode=mode, broker_worker_id=broker_id, num_pages=num_pages,
                link_gbps=link.gbps, prefill_tokens_per_s=link.prefill_tokens_per_s,
                parallel="parallel" not in req.ablate, selector=selector)
    spec = mode_of(mode)
    if spec.pushes is not Push.PLAN_BLOCKS:
        return PlannedTransfer(TransferPlan(**base, reason=reason or f"{mode}: every layer during prefill"), [])

    bits = spec.push_width(req.kv_bits)  # smartgen's low-bit push: entries travel as codes
    block_bytes = lay.page_tokens * lay.num_kv_heads * wire_entry_bytes(lay, bits)  # one layer's K and V of one page
    t_prefill = req.num_tokens / link.prefill_tokens_per_s
    metadata_bytes = pushed_aux_bytes(lay, req.num_tokens, req.aux_bytes, bits)  # the codes region is room only
    fits = max(0.0, PUSH_MARGIN * link.gbps * 1e9 / 8 * t_prefill - metadata_bytes)
    budget = min(num_blocks, int(fits // block_bytes))
    if not spec.orders_by_profile:  # partial, the baseline: the prompt's first pages (every layer), in memory order
        order = np.arange(num_blocks).reshape(lay.num_layers, num_pages).T.ravel()  # page-major
        pushed = order[:budget]
        why = f"partial: the first {budget} of {num_blocks} blocks in memory order fit behind the prefill"
        queue: list[int] = []
        use_background = False
    else:
        query_tokens = 0
        order = smartgen_order(importance, req.num_tokens, lay.page_tokens)
        dense = DENSE_LAYERS * num_pages  # layers 0–1 lead the order
        if "proactive" in req.ablate:
            pushed = order[:0]
            why = "smartgen without the proactive path: metadata only"
        else:
            left = max(0.0, fits - dense * block_bytes)
            query_tokens = 0 if "query" in req.ablate else query_push_tokens(req, left, bits)
            left -= query_tokens * query_entry_bytes(req, bits)
            pushed = order[:max(dense + int(left // block_bytes), dense)]
            why = (f"smartgen{f' ({bits}-bit push)' if bits else ''}: metadata, layers 0–1, {query_tokens} tokens "
                   f"per KV head by the prompt's last query, "
                   f"then {len(pushed) - dense} profile blocks ({len(pushed)} of {num_blocks} blocks) fit behind "
                   f"the prefill")
        use_background = "background" not in req.ablate
        queue = [int(b) for b in order[len(pushed):]] if use_background else []
    flags = np.zeros(num_blocks, dtype=bool)
    flags[pushed] = True
    name, version, source = profile
    plan = TransferPlan(**base, push_blocks=pack_bits(flags), num_push_blocks=int(flags.sum()), profile=name,
                        profile_version=version, profile_source=source, background=use_background,
                        reason="; ".join(r for r in (reason, why) if r),
                        query_tokens=query_tokens if spec.pushes_by_query and "proactive" not in req.ablate else 0)
    return PlannedTransfer(plan, queue)


def query_entry_bytes(req: OpenPlan, bits: int = 0) -> int:
    """Bytes one token per KV head costs in the query-aware push: its K and V in every layer ≥ DENSE_LAYERS."""
    lay = req.layout
    return (lay.num_layers - DENSE_LAYERS) * lay.num_kv_heads * wire_entry_bytes(lay, bits)


def query_push_tokens(req: OpenPlan, budget_bytes: float, bits: int = 0) -> int:
    """Tokens per KV head the prefill should select with its last-position query and push: QUERY_PUSH_FACTOR ×
    what step 1 will attend to (the request's budget under the decode worker's floor, at N + 1 cached tokens),
    as far as `budget_bytes` allows; 0 where step 1 attends densely (nothing to choose)."""
    n = req.num_tokens + 1
    k = req.floor.tokens(req.kv_budget or DEFAULT_KV_BUDGET, n)
    if k >= n:
        return 0
    wanted = min(req.num_tokens, QUERY_PUSH_FACTOR * k)
    return max(0, min(wanted, int(budget_bytes // query_entry_bytes(req, bits))))


def smartgen_order(importance: np.ndarray | None, num_tokens: int, page_tokens: int) -> np.ndarray:
    """Every block, flat (layer·num_pages + page): layers 0–1 first (in page order), then the rest by
    decreasing page importance; ties by position, so the order is deterministic."""
    scores = page_importance(importance, num_tokens, page_tokens)  # (L, P)
    scores[:DENSE_LAYERS] = np.inf
    flat = -scores.ravel()
    return np.argsort(flat, kind="stable")
