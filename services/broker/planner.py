"""What a request's transfer plan says: which mode (for `auto`), which blocks the prefill pushes while it
computes, and in what order the rest follows. Pure arithmetic over the profile; no I/O.

The budget (path 1, docs/architecture.md "The three transfer paths") is a schedule, not a byte count
(`PushSchedule`): layer l's pushes can leave only once the prefill has stored layer l, and they leave in layer
order, so the last layers' bytes are what decode would wait for after the prefill. A plan is accepted only if
the link, at the rate the broker measured, carries all of it by the end of the prefill (plus the last layer's
metadata, which cannot leave earlier), with one exception below. In that order: the selector metadata (decode
cannot select without it), layers 0–1 in full (they stay dense), per layer the tokens the prompt's own last
query selects (what step 1 will attend to: `query_tokens` per KV head up to `query_stop_layer`, then
`query_tail_tokens`, step 1's own budget, in the last layers, whether or not they make it by the prefill's end:
step 1 would read them anyway), then profile blocks in importance order, each where its layer still has room.
Layers whose push, by the link's backlog when the prefill stores them, would leave only after the prefill node
could have run step 1 itself carry step 1's exact selection instead (`exact_push`; decided by the prefill node).
Roughly n_push ≈ N_blocks · T_prefill / T_full, less the last layers'.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas import (DEFAULT_KV_BUDGET, DENSE_LAYERS, OpenPlan, TransferPlan, mode_of, num_pages as pages_of, pack_bits,
                     pushed_aux_bytes, quantized_bytes, wire_entry_bytes)
from schemas.modes import ModeName, Push
from shared.runtime.profiles import page_importance

AUTO_MARGIN = 1.0  # auto picks full when T_full ≤ AUTO_MARGIN × T_prefill: full then hides behind the prefill
# NOTE: the schedule assumes the prefill takes this share of its estimated time, against a prefill faster than
# the measured rate (step 1's layer l waits for layer l's pushed bytes, so a late push costs TTST)
PUSH_MARGIN = 0.9
# The query-aware push selects up to this many times step 1's budget where the link carries it by the prefill's
# end: the last prompt position and the first decoded one pick largely, not exactly, the same entries. Measured on
# SmolLM2 with quest at 10% under the default floor (`python -m tools.bench.query_overlap`), the share of step 1's
# selection inside the push, 1.1K (2.1K) tokens: 0.90 (0.81) at 1×, 0.97 (0.93) at 1.5×, 0.99 (0.96) at 2×,
# 1.00 (0.98) at 3×. Each entry step 1 misses is an on-demand read on its critical path.
QUERY_PUSH_FACTOR = 3
# … and at least 1× in every layer, the last ones included, even where that runs past the prefill's end: step 1
# reads those entries anyway, and a push keeps the link busy from the prefill's first layer on, where on-demand
# reads would leave it idle until step 1 starts and then wait a round trip per layer (2K, R = 6.5: the push that
# fitted carried 38 tokens per KV head and step 1 waited 2.5 s for the other ~85% of its selection).


@dataclass(frozen=True)
class LinkEstimate:
    gbps: float  # 10⁹ bit/s
    prefill_tokens_per_s: float
    source: str  # "measured" or "default"


@dataclass
class PlannedTransfer:
    plan: TransferPlan
    queue: list[int]  # the speculative queue: blocks (flat layer·num_pages + page) not pushed, most important first


class PushSchedule:
    """The push as the link carries it: layer l's bytes can leave at avail_l = (l + 1)/L · T_prefill (when the
    prefill has stored it) and go out in layer order, one after another at `bytes_per_s`. All of it is out by
    T_prefill + `tail_s` iff for every l the bytes of layers l… fit in bytes_per_s · (T_prefill + tail_s −
    avail_l) (a single queue: the last byte leaves at max over l of avail_l + (bytes of layers l…) / rate).
    `room[l]` is what that suffix bound still allows."""

    def __init__(self, num_layers: int, t_prefill: float, bytes_per_s: float, tail_s: float):
        self.room = [bytes_per_s * (t_prefill * (num_layers - 1 - layer) / num_layers + tail_s)
                     for layer in range(num_layers)]

    def fits(self, layer: int, num_bytes: float) -> bool:
        """Can `layer` push `num_bytes` more and still be out in time (every suffix that holds it has room)?"""
        return min(self.room[: layer + 1]) >= num_bytes

    def per_layer(self, first: int, stop: int) -> float:
        """The most bytes each of layers first … stop − 1 can add alike."""
        return max(0.0, min(room / (stop - max(suffix, first)) for suffix, room in enumerate(self.room[:stop])))

    def add(self, layer: int, num_bytes: float) -> None:
        for suffix in range(layer + 1):
            self.room[suffix] -= num_bytes


def transfer_seconds(num_bytes: float, gbps: float) -> float:
    return num_bytes * 8 / (gbps * 1e9)


def prefill_seconds(req: OpenPlan, link: LinkEstimate) -> float:
    """How long the prefill computes, at the measured rate (the whole prompt's: a hit's time says nothing of it,
    services/prefill). With a prefix cache hit of C of the N tokens it computes only the rest, but each of those
    attends to every token before it, the cached ones too: where attention dominates, the time is the whole
    prompt's × (1 − (C/N)²). Measured at 8K with 75% cached: 0.41–0.50 of the no-hit prefill, against 0.44 by this
    and 0.25 by counting tokens (docs/results/prefix-hit-8k-2026-12-06). NOTE: at short prompts, where the
    per-token work dominates, this is long: the plan may push a little more than fits (PUSH_MARGIN)."""
    cached = min(max(0, req.prefill_cached_tokens), req.num_tokens)
    share = 1.0 - (cached / req.num_tokens) ** 2 if req.num_tokens else 0.0
    return share * req.num_tokens / link.prefill_tokens_per_s


def choose_mode(req: OpenPlan, link: LinkEstimate) -> tuple[str, str]:
    """`auto`: (mode, reason). Full transfer wins when it fits behind the prefill (fast link, short prompt):
    it keeps attention dense and costs nothing extra; and where step 1 attends densely anyway (a prompt under the
    decode worker's floor, `dense_below`), since selective transfer would then read the whole KV at step 1.
    Otherwise selective transfer with SmartGen's paths, exact.
    A request that consents to low-bit KV (kv_bits, AUTO_KV_BITS) gets quantized transfer where its codes fit
    behind the prefill (dense decoding, all local from step 1), and beyond that smartgen with its push in those
    bits (at 2K, R = 6.5, docs/results/serve-2k-goals: TTST 0.46 s against 2.9 s exact and 5.8 s quantized)."""
    t_prefill = prefill_seconds(req, link)
    t_full = transfer_seconds(req.num_tokens * req.layout.token_bytes, link.gbps)
    ratio = t_full / t_prefill
    hit = f", {req.prefill_cached_tokens} of them cached" if req.prefill_cached_tokens else ""
    facts = (f"full transfer {t_full:.3g} s vs prefill {t_prefill:.3g} s (R = {ratio:.2f}) on a {link.gbps:.3g} Gbit/s "
             f"link ({link.source}) for {req.num_tokens} tokens{hit}")
    if ratio <= AUTO_MARGIN:
        return ModeName.FULL, f"{facts}: the whole KV fits behind the prefill"
    if not step_one_tokens(req):  # the decode worker's floor makes step 1 dense (a short prompt): it would read it all
        if req.kv_bits:
            return ModeName.QUANTIZED, (f"{facts}; step 1 attends to the whole prompt under the decode worker's budget floor, "
                                 f"so its {req.kv_bits}-bit codes")
        return ModeName.FULL, (f"{facts}; step 1 attends to the whole prompt under the decode worker's budget floor, so "
                        f"selective transfer would read all of it then")
    if not req.kv_bits:
        return ModeName.SMARTGEN, f"{facts}: full transfer would stall decoding"
    t_codes = transfer_seconds(quantized_bytes(req.layout, req.num_tokens, req.kv_bits), link.gbps)
    if t_codes <= AUTO_MARGIN * t_prefill:
        return ModeName.QUANTIZED, f"{facts}; its {req.kv_bits}-bit codes take {t_codes:.3g} s and fit behind the prefill"
    return ModeName.SMARTGEN, (f"{facts}; even its {req.kv_bits}-bit codes take {t_codes:.3g} s: smartgen with a "
                        f"{req.kv_bits}-bit push")


def plan_transfer(req: OpenPlan, mode: str, importance: np.ndarray | None, link: LinkEstimate, broker_id: str,
                  profile: tuple[str, int, str] = ("", 0, ""), reason: str = "", selector: str = "") -> PlannedTransfer:
    """The plan for `mode` (already resolved), run with `selector` ("" = dense). `importance` (num_layers, M)
    orders blocks for the modes that order them by profile (smartgen)."""
    lay = req.layout
    num_pages = pages_of(req.num_tokens, lay.page_tokens)
    num_blocks = lay.num_layers * num_pages
    spec = mode_of(mode)
    kv_bits = 0 if spec.kv_bits_problem(req.kv_bits) else req.kv_bits  # auto chose a mode that moves exact KV: 0
    base = dict(request_id=req.request_id, transfer_mode=mode, broker_worker_id=broker_id, num_pages=num_pages,
                link_gbps=link.gbps, prefill_tokens_per_s=link.prefill_tokens_per_s,
                prefill_cached_tokens=req.prefill_cached_tokens,
                parallel="parallel" not in req.ablate, read_ahead="ahead" not in req.ablate,
                early_start="early" not in req.ablate, stall="stall" not in req.ablate, selector=selector,
                direct_reads="direct" not in req.ablate,
                kv_bits=kv_bits)
    if spec.pushes is not Push.PLAN_BLOCKS:
        return PlannedTransfer(TransferPlan(**base, reason=reason or f"{mode}: every layer during prefill"), [])

    bits = spec.push_width(kv_bits)  # smartgen's low-bit push: entries travel as codes
    block_bytes = lay.page_tokens * lay.num_kv_heads * wire_entry_bytes(lay, bits)  # one layer's K and V of one page
    t_prefill = PUSH_MARGIN * prefill_seconds(req, link)
    bytes_per_s = link.gbps * 1e9 / 8
    metadata_bytes = pushed_aux_bytes(lay, req.num_tokens, req.aux_bytes, bits)  # the codes region is room only
    # layers ≥ 2 each push their own (a model of DENSE_LAYERS layers or fewer has none: no metadata, no division)
    layer_metadata = metadata_bytes / max(1, lay.num_layers - DENSE_LAYERS)
    entry_bytes = lay.num_kv_heads * wire_entry_bytes(lay, bits)  # one token of every KV head, K and V
    by_query = spec.orders_by_profile and spec.pushes_by_query and not {"proactive", "query"} & set(req.ablate)
    query_tail = step_one_tokens(req) if by_query else 0  # tokens per KV head; 0: none
    # the last layer exists only when the prefill ends: its metadata and its query tail leave after it in any case
    last_layer_s = (layer_metadata + query_tail * entry_bytes) / bytes_per_s
    schedule = PushSchedule(lay.num_layers, t_prefill, bytes_per_s, last_layer_s)
    for layer in range(DENSE_LAYERS, lay.num_layers):
        schedule.add(layer, layer_metadata)
    query_tokens, query_stop, exact = 0, DENSE_LAYERS, False
    if not spec.orders_by_profile:  # partial, the baseline: the prompt's first pages (every layer), in memory order
        order = np.arange(num_blocks).reshape(lay.num_layers, num_pages).T.ravel()  # page-major
        pushed = _fill(schedule, order, num_pages, block_bytes)
        why = f"partial: the first {len(pushed)} of {num_blocks} blocks in memory order fit behind the prefill"
        use_background = False
    else:
        order = smartgen_order(importance, req.num_tokens, lay.page_tokens)
        dense = DENSE_LAYERS * num_pages  # layers 0–1 lead the order, pushed whatever the link
        for layer in range(DENSE_LAYERS):
            schedule.add(layer, num_pages * block_bytes)
        if "proactive" in req.ablate:
            pushed = order[:0]
            why = "smartgen without the proactive path: metadata only"
        else:
            query_part = ""
            if query_tail:
                room = schedule.per_layer(DENSE_LAYERS, lay.num_layers - 1)  # the last layer has none: it comes last
                query_tokens = min(req.num_tokens, QUERY_PUSH_FACTOR * query_tail, max(query_tail, int(room // entry_bytes)))
                while query_stop < lay.num_layers and schedule.fits(query_stop, query_tokens * entry_bytes):
                    schedule.add(query_stop, query_tokens * entry_bytes)
                    query_stop += 1
                for layer in range(query_stop, lay.num_layers):  # the tail: 1×, whether or not it fits in time
                    schedule.add(layer, query_tail * entry_bytes)
                if query_stop == DENSE_LAYERS:  # not even layer 2 had room: every layer pushes the tail's share
                    query_tokens = query_tail
                last = lay.num_layers - 1
                if query_tokens == query_tail:
                    query_part = f"{query_tail} tokens per KV head by the prompt's last query in layers 2–{last}"
                else:
                    query_part = (f"{query_tokens} tokens per KV head by the prompt's last query in layers "
                                  f"2–{query_stop - 1}, {query_tail} in layers {query_stop}–{last}")
                query_part += f" (from layer {query_stop} on whether or not in time), "
            pushed = np.concatenate([order[:dense], _fill(schedule, order[dense:], num_pages, block_bytes)])
            exact = bool(query_tail) and "exact" not in req.ablate
            if exact:
                query_part += "step 1's exact selection instead where a layer's push would leave after step 1, "
            why = (f"smartgen{f' ({bits}-bit push)' if bits else ''}: metadata, layers 0–1, {query_part}"
                   f"then {len(pushed) - dense} profile blocks ({len(pushed)} of {num_blocks} blocks) fit behind "
                   f"the prefill")
        use_background = "background" not in req.ablate
    flags = np.zeros(num_blocks, dtype=bool)
    flags[pushed] = True
    queue = [int(b) for b in order if not flags[b]] if use_background else []
    name, version, source = profile
    plan = TransferPlan(**base, push_blocks=pack_bits(flags), num_push_blocks=int(flags.sum()), profile=name,
                        profile_version=version, profile_source=source, background=use_background,
                        reason="; ".join(r for r in (reason, why) if r),
                        query_tokens=query_tokens, query_stop_layer=query_stop if query_tail else 0,
                        query_tail_tokens=query_tail, exact_push=exact)
    return PlannedTransfer(plan, queue)


def _fill(schedule: PushSchedule, blocks: np.ndarray, num_pages: int, block_bytes: float) -> np.ndarray:
    """The blocks (flat, in the order given) the schedule still takes, each where its layer has room."""
    taken = []
    for block in blocks:
        layer = int(block) // num_pages
        if schedule.fits(layer, block_bytes):
            schedule.add(layer, block_bytes)
            taken.append(block)
    return np.asarray(taken, dtype=blocks.dtype)


def step_one_tokens(req: OpenPlan) -> int:
    """Tokens per KV head step 1 will attend to in a selective layer (the request's budget under the decode
    worker's floor, at N + 1 cached tokens); 0 where it attends densely."""
    n = req.num_tokens + 1
    k = req.floor.tokens(req.kv_budget if req.kv_budget is not None else DEFAULT_KV_BUDGET, n)
    return 0 if k >= n else k


def smartgen_order(importance: np.ndarray | None, num_tokens: int, page_tokens: int) -> np.ndarray:
    """Every block, flat (layer·num_pages + page): layers 0–1 first (in page order), then the rest by
    decreasing page importance; ties by position, so the order is deterministic."""
    scores = page_importance(importance, num_tokens, page_tokens)  # (L, P)
    scores[:DENSE_LAYERS] = np.inf
    flat = -scores.ravel()
    return np.argsort(flat, kind="stable")
