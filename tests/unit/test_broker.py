"""The broker's decisions: the proactive budget, block orders per mode, auto's choice, the plan states and
the speculative lane policy."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from schemas import NO_FLOOR, KvLayout, OpenPlan, entry_record_bytes, entry_region_bytes, quantized_bytes
from services.broker.planner import PUSH_MARGIN, LinkEstimate, choose_mode, plan_transfer, prefill_seconds
from services.broker.plans import Plan, PlanBook, PlanStateError
from schemas import pack_bits, unpack_bits
from shared.runtime.profiles import positional_importance

LAYOUT = KvLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_tokens=16, dtype="float32", token_bytes=46080)
N = 2048  # 128 pages per layer, 3,840 blocks of 24,576 bytes; the whole KV is 94,371,840 bytes


def request(mode: str, ablate: list[str] | None = None, aux_bytes: int = 0, kv_bits: int = 0) -> OpenPlan:
    aux_bytes += entry_region_bytes(LAYOUT, N, kv_bits)  # the decode node reserves room for the codes
    return OpenPlan("r", mode, "m", "quest", N, LAYOUT, aux_bytes, "prefill-1", "decode-1", ablate or [],
                    kv_bits=kv_bits, kv_budget=0.1)  # the numbers below are Quest at 10%


def link_for_ratio(r: float, rate: float = 200.0) -> LinkEstimate:
    """A link on which the full transfer takes r × the prefill."""
    t_prefill = N / rate
    return LinkEstimate(N * LAYOUT.token_bytes * 8 / (r * t_prefill) / 1e9, rate, "measured")


def pushed(plan) -> np.ndarray:
    return unpack_bits(plan.push_blocks, (LAYOUT.num_layers, plan.num_pages))


BLOCK_BYTES = 16 * LAYOUT.token_bytes / 30  # one layer's K and V of one page
ENTRY_BYTES = 2 * 64 * 4  # one (layer, KV head, token) entry's K and V in fp32


def push_finishes_at(planned, aux_bytes: int, link: LinkEstimate, entry_bytes: float = ENTRY_BYTES,
                     block_bytes: float = BLOCK_BYTES) -> tuple[float, float]:
    """Carry the plan's push over the link, independently of the planner: layer l's bytes (its metadata, its
    blocks, its query entries) can leave once the prefill has stored it, at (l + 1)/30 · T, and go out in layer
    order. Returns when the last byte leaves and the deadline the planner aims at: the prefill's end (T at
    PUSH_MARGIN × the estimated time) plus the last layer's pushes, which cannot leave earlier."""
    plan = planned.plan
    t_prefill = PUSH_MARGIN * N / link.prefill_tokens_per_s
    rate = link.gbps * 1e9 / 8
    metadata = aux_bytes / 28
    per_layer = pushed(plan).sum(axis=1) * float(block_bytes)
    per_layer[2:] += metadata
    per_layer[2:plan.query_stop_layer] += plan.query_tokens * 3 * entry_bytes
    per_layer[plan.query_stop_layer:] += plan.query_tail_tokens * 3 * entry_bytes
    t = 0.0
    for layer, num_bytes in enumerate(per_layer):
        t = max(t, (layer + 1) / 30 * t_prefill) + num_bytes / rate
    return t, t_prefill + (metadata + plan.query_tail_tokens * 3 * entry_bytes) / rate


def with_block(planned, block: int):
    """The plan with one more block pushed."""
    blocks = pushed(planned.plan).ravel().copy()
    blocks[block] = True
    return type(planned)(replace(planned.plan, push_blocks=pack_bits(blocks)), [])


def test_smartgen_pushes_what_the_link_carries_by_the_end_of_the_prefill():
    """At R = T_full/T_prefill = 2.5: metadata, layers 0–1, per layer ≥ 2 three times the tokens step 1 will
    attend to as the prompt's last query picks them (the 10% budget of 2,049 tokens: 205 per KV head, so 615),
    then profile blocks. The link carries all of it by the end of the prefill (plus the last layer's metadata),
    and no block left out would have made it: the push fills the link rather than a fixed share of it. The last
    layer, which exists only when the prefill ends, pushes its metadata and step 1's budget by query (the
    tail), after the prefill's end."""
    aux, link = 1_000_000, link_for_ratio(2.5)
    planned = plan_transfer(request("smartgen", aux_bytes=aux), "smartgen", positional_importance(30), link, "b")
    blocks = pushed(planned.plan)
    assert (planned.plan.query_tokens, planned.plan.query_stop_layer, planned.plan.query_tail_tokens) == (615, 29, 205)
    assert blocks[:2].all() and not blocks[29].any()
    finish, deadline = push_finishes_at(planned, aux, link)
    assert finish <= deadline * (1 + 1e-9)
    assert all(push_finishes_at(with_block(planned, b), aux, link)[0] > deadline for b in planned.queue[:50])
    moved = aux + blocks.sum() * BLOCK_BYTES + 615 * 3 * ENTRY_BYTES * 27 + 205 * 3 * ENTRY_BYTES
    assert moved > 0.95 * link.gbps * 1e9 / 8 * PUSH_MARGIN * N / link.prefill_tokens_per_s  # the link is kept busy
    assert planned.plan.num_push_blocks == blocks.sum()
    assert len(planned.queue) == 30 * 128 - blocks.sum() and not set(planned.queue) & set(np.flatnonzero(blocks.ravel()))


def test_the_query_aware_push_sends_step_ones_budget_even_past_the_prefill_and_can_be_switched_off():
    """A tight link (R = 8): layers 0–1 take most of it; the query-aware push still sends step 1's budget
    (205 tokens per KV head) in every layer ≥ 2, in time up to query_stop_layer and after the prefill's end from
    there on (step 1 would read those entries anyway), and no profile block; `ablate: ["query"]` gives the room
    back to profile blocks; partial never pushes by query."""
    link = link_for_ratio(8.0)
    tight = plan_transfer(request("smartgen"), "smartgen", positional_importance(30), link, "b")
    plan = tight.plan
    assert plan.query_tokens == plan.query_tail_tokens == 205 and 2 < plan.query_stop_layer < 30
    assert plan.num_push_blocks == 2 * 128  # layers 0–1 only
    finish, deadline = push_finishes_at(tight, 0, link)
    assert finish > deadline  # the tail of layers query_stop_layer… comes late: on-demand reads would come later
    no_query = plan_transfer(request("smartgen", ["query"]), "smartgen", positional_importance(30), link, "b")
    assert no_query.plan.query_tokens == 0 and no_query.plan.num_push_blocks > tight.plan.num_push_blocks
    partial = plan_transfer(request("partial"), "partial", None, link_for_ratio(4.0), "b")
    assert partial.plan.query_tokens == 0


def test_the_exact_push_is_allowed_where_the_push_goes_by_query_and_can_be_switched_off():
    """`exact_push` lets the prefill node hold back the layers whose push would leave after its prefill anyway and
    push step 1's exact selection there (it decides from the link's backlog: tests/integration/test_smartgen.py):
    on wherever smartgen pushes by query, off with `ablate: ["exact"]` (the rest of the plan unchanged), without
    the query-aware push, and in partial."""
    link = link_for_ratio(8.0)
    plan = plan_transfer(request("smartgen"), "smartgen", positional_importance(30), link, "b").plan
    assert plan.exact_push and "step 1's exact selection" in plan.reason
    off = plan_transfer(request("smartgen", ["exact"]), "smartgen", positional_importance(30), link, "b").plan
    assert not off.exact_push and (off.query_tokens, off.query_stop_layer, off.push_blocks) == \
        (plan.query_tokens, plan.query_stop_layer, plan.push_blocks)
    assert not plan_transfer(request("smartgen", ["query"]), "smartgen", positional_importance(30), link, "b").plan.exact_push
    assert not plan_transfer(request("partial"), "partial", None, link, "b").plan.exact_push


def test_a_low_bit_push_fits_its_codes_where_exact_entries_would_not():
    """kv_bits 4 on smartgen: on the tight link above, each entry costs its record (104 bytes of fp32's
    512 here), so the query-aware push gets its whole 3× budget and more profile blocks follow, still in time;
    the codes region is room the decode node reserves, not bytes that move."""
    link = link_for_ratio(8.0)
    exact = plan_transfer(request("smartgen"), "smartgen", positional_importance(30), link, "b")
    low = plan_transfer(request("smartgen", kv_bits=4), "smartgen", positional_importance(30), link, "b")
    assert exact.plan.query_tokens < low.plan.query_tokens == 615
    assert low.plan.num_push_blocks > exact.plan.num_push_blocks
    record = entry_record_bytes(64, 4)
    finish, deadline = push_finishes_at(low, 0, link, entry_bytes=record, block_bytes=16 * 3 * record)
    assert finish <= deadline * (1 + 1e-9)
    assert "4-bit push" in low.plan.reason


def test_smartgen_follows_the_profile():
    """Profile blocks are pushed by importance: a profile that favours the middle of the prompt gets the
    middle pages pushed (in the layers with room: not the last), and the speculative queue is in decreasing
    importance."""
    importance = np.zeros((30, 1024), dtype=np.float32)
    importance[:, 500:520] = 1.0
    # NOTE: without the query-aware push, which would take this budget first (the test above)
    planned = plan_transfer(request("smartgen", ["query"]), "smartgen", importance, link_for_ratio(8.0), "b")
    blocks = pushed(planned.plan)
    middle = slice(500 * N // 1024 // 16, 520 * N // 1024 // 16)
    assert blocks[2:28, middle].all() and not blocks[2:, -10:].any()  # the rest of the budget goes by position
    tight = plan_transfer(request("smartgen"), "smartgen", importance, link_for_ratio(40.0), "b")  # layers 0–1 only
    assert tight.plan.num_push_blocks == 2 * 128
    first_queued = [divmod(b, 128) for b in tight.queue[:28 * 3]]
    assert all(layer >= 2 and middle.start <= page < middle.stop for layer, page in first_queued)


def test_partial_pushes_the_first_pages_in_memory_order():
    """The partial baseline sends the prompt's first pages (every layer) and queues nothing for background."""
    planned = plan_transfer(request("partial"), "partial", None, link_for_ratio(4.0), "b")
    blocks = pushed(planned.plan)
    pages = blocks.any(axis=0)
    assert pages[:10].all() and not pages[-10:].any()
    assert planned.queue == [] and planned.plan.background is False


def test_ablations_switch_paths_off():
    """No proactive path: nothing pushed but metadata. No background: an empty queue. No parallel: serial reads."""
    link = link_for_ratio(2.0)
    no_push = plan_transfer(request("smartgen", ["proactive"]), "smartgen", positional_importance(30), link, "b")
    assert no_push.plan.num_push_blocks == 0 and len(no_push.queue) == 30 * 128
    no_bg = plan_transfer(request("smartgen", ["background"]), "smartgen", positional_importance(30), link, "b")
    assert no_bg.queue == [] and not no_bg.plan.background and no_bg.plan.parallel
    serial = plan_transfer(request("smartgen", ["parallel"]), "smartgen", positional_importance(30), link, "b")
    assert not serial.plan.parallel and serial.plan.background


def test_a_prefix_cache_hit_shortens_the_prefill_the_push_is_sized_for():
    """With 75% of the prompt expected in the prefill's prefix cache (OpenPlan.prefill_cached_tokens), the prefill
    computes the rest while attending to all of it: (1 − 0.75²) of the whole prompt's time. The push is sized for
    that shorter prefill (fewer blocks: those of a prompt without a hit whose prefill takes as long), the plan
    says which hit it was sized with, and `auto` weighs the transfer against that prefill (full at R = 0.5 of the whole prompt is R = 1.14 here)."""
    aux, link = 1_000_000, link_for_ratio(2.5)
    whole = plan_transfer(request("smartgen", aux_bytes=aux), "smartgen", positional_importance(30), link, "b")
    hit = replace(request("smartgen", aux_bytes=aux), prefill_cached_tokens=3 * N // 4)
    assert prefill_seconds(hit, link) == pytest.approx((1 - 0.75 ** 2) * N / link.prefill_tokens_per_s)
    planned = plan_transfer(hit, "smartgen", positional_importance(30), link, "b")
    assert planned.plan.prefill_cached_tokens == 3 * N // 4 and whole.plan.prefill_cached_tokens == 0
    assert 0 < planned.plan.num_push_blocks < whole.plan.num_push_blocks
    # the same push as a prompt without a hit whose prefill takes as long
    short_link = LinkEstimate(link.gbps, link.prefill_tokens_per_s / (1 - 0.75 ** 2), "measured")
    same = plan_transfer(request("smartgen", aux_bytes=aux), "smartgen", positional_importance(30), short_link, "b")
    assert same.plan.push_blocks == planned.plan.push_blocks and same.queue == planned.queue
    assert (same.plan.query_tokens, same.plan.query_stop_layer) == (planned.plan.query_tokens, planned.plan.query_stop_layer)
    assert choose_mode(request("auto"), link_for_ratio(0.5))[0] == "full"
    mode, why = choose_mode(replace(request("auto"), prefill_cached_tokens=3 * N // 4), link_for_ratio(0.5))
    assert mode == "smartgen" and f"{3 * N // 4} of them cached" in why


def test_auto_picks_full_when_it_fits_and_smartgen_when_it_stalls():
    """auto: full transfer when it hides behind the prefill, selective otherwise; the reason says why."""
    mode, why = choose_mode(request("auto"), link_for_ratio(0.5))
    assert mode == "full" and "fits behind the prefill" in why
    mode, why = choose_mode(request("auto"), link_for_ratio(6.5))
    assert mode == "smartgen" and "R = 6.50" in why


def test_auto_with_kv_bits_picks_quantized_where_its_codes_fit_and_a_low_bit_push_beyond():
    """auto with kv_bits 4 (consent to low-bit KV): full still wins when it fits; quantized where its 4-bit codes
    (about a quarter of 16-bit KV) fit behind the prefill; smartgen with a 4-bit push where even they do not.
    The plan carries the width the chosen mode runs with: 0 for full, 4 otherwise."""
    lay16 = replace(LAYOUT, dtype="bfloat16", token_bytes=LAYOUT.token_bytes // 2)
    codes_ratio = quantized_bytes(lay16, N, 4) / (N * lay16.token_bytes)
    assert 0.25 < codes_ratio < 0.3  # 4-bit codes plus their fp16 scales and minimums, against 16-bit KV

    def asked(r: float) -> tuple[str, str, int]:
        req = replace(request("auto", kv_bits=4), layout=lay16)
        link = LinkEstimate(N * lay16.token_bytes * 8 / (r * N / 200.0) / 1e9, 200.0, "measured")
        mode, why = choose_mode(req, link)
        return mode, why, plan_transfer(req, mode, positional_importance(30), link, "b", reason=why).plan.kv_bits

    assert asked(0.8)[::2] == ("full", 0)
    mode, why, bits = asked(2.0)
    assert (mode, bits) == ("quantized", 4) and "4-bit codes" in why and "fit behind the prefill" in why
    assert asked(0.95 / codes_ratio)[::2] == ("quantized", 4)
    mode, why, bits = asked(1.05 / codes_ratio)
    assert (mode, bits) == ("smartgen", 4) and "4-bit push" in why
    mode, why, bits = asked(6.5)
    assert (mode, bits) == ("smartgen", 4)
    exact = replace(request("auto"), layout=lay16)  # no consent: exact KV only, whatever the link
    assert choose_mode(exact, LinkEstimate(1e-3, 200.0, "measured"))[0] == "smartgen"


def test_auto_picks_full_where_step_one_would_attend_to_the_whole_prompt():
    """A prompt under the decode worker's floor (`dense_below`, 1,024 tokens by default) is attended densely at
    step 1, so selective transfer would read all of it on demand then (smartgen up, 791 tokens at R = 2: TTST 3.2 s):
    auto moves it whole instead, full or (with kv_bits) quantized, whatever the link."""
    short = replace(request("auto"), num_tokens=800)
    mode, why = choose_mode(short, link_for_ratio(2.0))
    assert mode == "full" and "budget floor" in why
    assert choose_mode(replace(short, kv_bits=4), link_for_ratio(6.5))[0] == "quantized"
    assert choose_mode(request("auto"), link_for_ratio(2.0))[0] == "smartgen"  # 2,048 tokens: sparse from step 1
    assert choose_mode(replace(short, floor=NO_FLOOR), link_for_ratio(2.0))[0] == "smartgen"


def test_the_quantized_size_the_broker_reckons_is_quantized_modes_own():
    """schemas.quantized_bytes (the broker has no torch) against QuantLayout, which lays the codes out."""
    from shared.compute.quantization import QuantLayout

    for n, bits in ((1, 4), (5, 2), (100, 4), (2017, 4), (4097, 2)):
        exact = QuantLayout(30, 3, 64, n, bits).nbytes
        assert abs(quantized_bytes(LAYOUT, n, bits) - exact) <= 0.01 * exact, (n, bits)


def make_plan(book: PlanBook, queue: int = 100, background: bool = True) -> Plan:
    planned = plan_transfer(request("smartgen", [] if background else ["background"]), "smartgen",
                            positional_importance(30), link_for_ratio(6.5), "b")
    from collections import deque
    return book.add(Plan(planned.plan, "p", "d", N, deque(planned.queue[:queue])))


def test_plan_states_only_move_forward():
    """opening → transferring → all_local → released; failed from anywhere; never backwards; finished plans
    leave the live table for the history."""
    book = PlanBook()
    make_plan(book)
    book.advance("r", "transferring")
    book.advance("r", "all_local")
    with pytest.raises(PlanStateError):
        book.advance("r", "transferring")
    book.advance("r", "released")
    assert book.get("r") is None and book.history[-1]["state"] == "released"
    assert book.advance("r", "failed") is None  # unknown now: ignored
    make_plan(book)
    book.advance("r", "failed", "aborted")
    assert book.num_by_final_state == {"released": 1, "failed": 1, "expired": 0}


def test_background_batches_follow_the_ratio_and_wait_for_the_backlog():
    """Each iteration gets 10% of what remained when decoding began, most important first, and nothing while
    the decode node still holds a batch."""
    book = PlanBook(ratio=0.1)
    plan = make_plan(book, queue=95)
    first_ten = list(plan.queue)[:10]
    batch, remaining = book.next_batch("r", backlog_blocks=0)
    assert batch == first_ten and remaining == 85 and plan.state == "transferring"
    assert book.next_batch("r", backlog_blocks=10) == ([], 85)
    sizes = []
    while True:
        batch, _ = book.next_batch("r", backlog_blocks=0)
        if not batch:
            break
        sizes.append(len(batch))
    assert sizes == [10] * 8 + [5]  # ~10 iterations move everything


def test_no_background_means_no_batches_and_stale_plans_expire():
    """A plan without path 3 never feeds the lane; an untouched plan expires."""
    book = PlanBook(ttl_s=5)
    plan = make_plan(book, background=False)
    assert book.next_batch("r", 0) == ([], 0)
    assert book.expire(now=plan.touched + 6) == ["r"] and book.num_by_final_state["expired"] == 1


def test_a_decode_node_that_wants_no_background_gets_none():
    """Progress with wants_background False (the rest cannot arrive before the request ends) hands out nothing
    and keeps the queue for a later step that wants it."""
    book = PlanBook(ratio=0.1)
    make_plan(book, queue=95)
    assert book.next_batch("r", 0, wanted=False) == ([], 95)
    batch, remaining = book.next_batch("r", 0)
    assert len(batch) == 10 and remaining == 85


def test_a_model_without_selective_layers_is_planned_without_metadata():
    """A model of DENSE_LAYERS (2) layers attends densely at every layer: smartgen plans its push with no metadata
    (found as a ZeroDivisionError and a 502 for smartgen on a 2-layer tiny model)."""
    two = replace(LAYOUT, num_layers=2)
    req = replace(request("smartgen"), layout=two, aux_bytes=0)
    planned = plan_transfer(req, "smartgen", positional_importance(2), link_for_ratio(2.5), "b")
    assert planned.plan.transfer_mode == "smartgen"
    assert unpack_bits(planned.plan.push_blocks, (2, planned.plan.num_pages)).all()  # layers 0–1 lead, always
