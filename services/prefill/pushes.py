"""What one request's prefill pushes, layer by layer (step 2 of the life cycle in services/prefill/service.py).

A `Transfer` is one request's KV on its way out. Per layer, by mode, `layer_pushes` says which bytes go where:
the aux area (selector metadata with the query-aware push's bitmap, or low-bit codes), then the slab rows (the
entries the layer's last-position query picked, then the plan's blocks). `Transfer` also keeps the plan's link
model, when the link would have carried every push queued so far (`queue`), which the exact push's rule asks
(`holds_back`). The service starts the pushes and runs step 1; nothing here awaits.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from schemas import KvHandle, TransferMode, TransferPlan, token_runs
from shared.compute.kvstore import KvStore, Slab, slab_rows
from shared.compute.prefill_engine import QueryPush
from shared.compute.selectors import DENSE_LAYERS
from shared.dataplane import Grant, Segment

# The exact push holds a layer back when the bytes before it would keep the link busy at least this long past the
# prefill's end: about one decode step run here (SmolLM2 at 2K: ~55 ms on this CPU) and the hand-offs around it,
# so the link never waits for step 1. The last prompt position picks ~83% of step 1's selection (2K and 4K, R = 6.5).
EXACT_AFTER_S = 0.1
# Measured at 2K, R = 6.5, in-process data plane, no guard (docs/results/serve-2k-exact-model): held back from
# layer 17–20 of 30 by the link model, the second token came 0.3–0.6 s sooner than with the last query's picks in
# 5 of 5 requests. By acked bytes instead, the rule held back from layer 13 and came 0.6–1.4 s later (acks lag).


@dataclass
class Transfer:
    """One request's KV on its way out: the local slab, where it goes, and the pushes in flight."""

    handle: KvHandle
    slab: Slab
    mode: TransferMode
    plan: TransferPlan | None
    pushes: list[asyncio.Task[None]] = field(default_factory=list)
    num_bytes: int = 0  # acked so far
    aux_ranges: list[tuple[int, int]] = field(default_factory=list)  # per layer: (offset in aux, length); may be empty
    aux_filled: int = 0  # bytes of the aux area this request fills (≤ the reservation: auto reserves for each choice)
    layer_push_bytes: list[int] = field(default_factory=list)  # per layer: the bytes its pushes carry, in order
    row_runs: list[list[tuple[int, int]]] = field(default_factory=list)  # per layer: the token ranges it pushes
    read_grant: Grant | None = None  # selective modes, after prefill: what the decode node may read
    lease: asyncio.TimerHandle | None = None
    query_push: QueryPush | None = None  # smartgen: the entries each layer's last-position query picked
    exact: bool = False  # plan.exact_push, and the mode pushes by query: layers may be held back for step 1
    prefill_started: float = 0.0  # perf_counter when the prefill began computing
    held: list[int] = field(default_factory=list)  # layers held back for step 1's exact selection, in order
    exact_from_layer: int = 0  # the first of them, once pushed (PrefillDone.exact_from_layer)
    step_one_s: float = 0.0  # the exact push: step 1 run here (seconds on the torch thread)
    link_free_at: float = 0.0  # perf_counter when the plan's link would have sent every push queued so far

    def queue(self, layer: int, num_bytes: int) -> None:
        """`layer`'s pushes, `num_bytes` in all, are queued now: they occupy the plan's link after those before."""
        self.layer_push_bytes[layer] = num_bytes
        if self.plan is not None and self.plan.link_gbps > 0:
            self.link_free_at = max(self.link_free_at, time.perf_counter()) + num_bytes * 8 / (self.plan.link_gbps * 1e9)

    def holds_back(self, layer: int, exact_from_share: float) -> bool:
        """The exact push (plan.exact_push): hold `layer`'s push back for step 1's exact selection when the pushes
        queued before it would keep the plan's link busy past the prefill's end (its layers left, at its pace
        so far) and step 1 run here (EXACT_AFTER_S): then it would not leave earlier anyway. The link's backlog
        is the plan's link model (`link_free_at`), not the bytes acked so far: a push is acked only once all of
        it has landed, and pushes of several layers share the link, so acks lag what the link has carried (by
        acks, the rule held back from layer 13 of 30 where the link was free before the prefill's end, and
        the second token came 0.6–1.4 s later). Only from `exact_from_share` of the layers on (0 by default)."""
        plan, num_layers = self.plan, len(self.layer_push_bytes)
        if not self.exact or layer < max(DENSE_LAYERS, exact_from_share * num_layers) or plan is None or \
                plan.link_gbps <= 0 or not self.prefill_started:
            return False
        now = time.perf_counter()
        prefill_left_s = (now - self.prefill_started) / (layer + 1) * (num_layers - 1 - layer)
        return self.link_free_at - now >= prefill_left_s + EXACT_AFTER_S

    def link_during_prefill(self, prefill_s: float) -> dict[str, Any]:
        """For the log: what the pushes achieved while the prefill computed, against what the plan's link rate
        allows in that time (a push counts once acked, so this lags by up to one push)."""
        if self.plan is None or self.plan.link_gbps <= 0 or not self.num_bytes:
            return {}
        allowed = self.plan.link_gbps * 1e9 / 8 * prefill_s
        return {"pushed_mb": round(self.num_bytes / 1e6, 3),
                "queued_mb": round((sum(self.layer_push_bytes) - self.num_bytes) / 1e6, 3),
                "link_allows_mb": round(allowed / 1e6, 3)}


def layer_pushes(store: KvStore, transfer: Transfer, layer: int) -> list[tuple[str, list[Segment]]]:
    """What this layer sends during prefill, per the mode (services/prefill/service.py's life cycle), by KV path."""
    handle = transfer.handle
    pushes = []
    if transfer.aux_ranges and transfer.aux_ranges[layer][1]:
        at, length = transfer.aux_ranges[layer]
        aux = [Segment(store.aux_offset(transfer.slab) + at, handle.aux_offset + at, length)]
        pushes.append((transfer.mode.aux_path, aux))
    codes = transfer.query_push.codes if transfer.query_push is not None else None
    if codes is not None:  # the low-bit push: this layer's blocks and query entries, as one run of records
        assert transfer.query_push is not None
        at, length = codes.layer_range(layer, transfer.query_push.num_records[layer])
        if length:
            aux_at = store.aux_offset(transfer.slab)
            pushes.append((transfer.mode.rows_path, [Segment(aux_at + at, handle.aux_offset + at, length)]))
        return pushes
    rows = []
    if transfer.query_push is not None and layer in transfer.query_push.picked:
        rows += entry_segments(store, transfer, layer, transfer.query_push.picked[layer])
    for start, stop in transfer.row_runs[layer]:
        src = store.rows(transfer.slab, layer, start, stop)
        dst = slab_rows(handle.layout, handle.offset, handle.capacity, layer, start, stop)
        rows += [Segment(s, d, length) for (s, length), (d, _) in zip(src, dst)]
    if rows:
        pushes.append((transfer.mode.rows_path, rows))
    return pushes


def entry_segments(store: KvStore, transfer: Transfer, layer: int, picked: np.ndarray) -> list[Segment]:
    """`picked` (num_kv_heads, N) bool entries of `layer`: one K and one V segment per run of consecutive
    tokens of a head (a slab keeps each head's tokens contiguous)."""
    handle, lay = transfer.handle, store.layout
    src_rows = store.rows(transfer.slab, layer, 0, handle.num_tokens)  # (K|V, head) rows, in order
    dst_rows = slab_rows(handle.layout, handle.offset, handle.capacity, layer, 0, handle.num_tokens)
    entry = src_rows[0][1] // handle.num_tokens  # one token of one head's K (or V), bytes
    segments = []
    for (src, _), (dst, _), heads in zip(src_rows, dst_rows, [*range(lay.num_kv_heads)] * 2):
        for start, stop in token_runs(picked[heads]):
            segments.append(Segment(src + start * entry, dst + start * entry, (stop - start) * entry))
    return segments
