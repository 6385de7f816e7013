"""What a decode request reports when it ends: the final TokenEvent (bytes per KV path, local shares, waits,
step-1 figures for `ttst_bound_s`) and, for online profiling, the SelectionStats of what it selected."""
from __future__ import annotations

import numpy as np

from schemas import (DENSE_LAYERS, Generate, KvLayout, SelectionStats, TokenEvent, mode_of, pushed_aux_bytes,
                     wire_entry_bytes)
from schemas.modes import Aux
from shared.compute.modeling import ModelRunner
from shared.compute.selective import Selection
from shared.runtime.profiles import NUM_BLOCKS, tokens_per_block
from services.decode.request import DecodeRequest


def _metadata_bytes(state: DecodeRequest, layout: KvLayout) -> int:
    """What of the slab's aux area the prefill filled whole (transfer.pushed_aux_bytes)."""
    req = state.generate
    bits = mode_of(req.transfer_mode).push_width(req.kv_bits)
    return pushed_aux_bytes(layout, len(req.token_ids), state.push.aux_filled, bits)


def final_event(state: DecodeRequest, selection: Selection | None, index: int, reason: str,
                error: str, kv_wait_s: float, layout: KvLayout) -> TokenEvent:
    """The stream's last event: how it ended (`reason`, `error`) and what moved on which path."""
    req = state.generate
    landed = state.grant.bytes_landed if state.grant else 0
    mode, remote = mode_of(req.transfer_mode), state.remote
    if mode.keeps_source:
        aux = _metadata_bytes(state, layout)
        kv_bytes = {mode.aux_path: min(aux, landed), mode.rows_path: max(0, landed - aux),
                    "on_demand": remote.bytes_on_demand if remote else 0,
                    "background": remote.bytes_background if remote else 0}
    elif mode.is_disaggregated:  # everything was pushed: as codes, or row by row
        kv_bytes = {mode.aux_path if mode.aux is Aux.CODES else mode.rows_path: landed}
    else:
        kv_bytes = {}
    share = selection.selected_share if selection and selection.selected_share is not None else 1.0
    return TokenEvent(req.request_id, index, -1, reason, error, kv_bytes, kv_wait_s, share,
                      local_share=remote.local_share if remote else 1.0,
                      on_demand_wait_s=sum(remote.step_wait) if remote else 0.0,
                      step_local_share=[round(x, 4) for x in remote.step_local_share] if remote else [],
                      step_wait_s=[round(x, 6) for x in remote.step_wait] if remote else [],
                      all_local_step=state.progress.all_local_step, background_declined=state.progress.background_declined,
                      recompute_reason=state.report.recompute_reason,
                      step1_kv_bytes=state.report.step1_kv_bytes, step1_compute_s=round(state.report.step1_compute_s, 6),
                      kv_load_s=round(state.report.kv_load_s, 6), started_while_pushing=state.push.on_layer_landed is not None and remote is not None,
                      push_landing_wait_s=round(remote.landing_wait_s, 6) if remote else 0.0, fetch_reads=remote.num_fetch_reads if remote else 0,
                      speculative_reads=remote.num_speculative_reads if remote else 0,
                      ranked_reads=remote.num_ranked_reads if remote else 0,
                      ranked_bytes=remote.bytes_ranked if remote else 0)


def step1_kv_bytes(state: DecodeRequest, layout: KvLayout, selection: Selection | None) -> int:
    """What decode step 1 needed from the link, on the wire: nothing (colocated, or recomputed here), the
    metadata, the dense layers and step 1's own selection (selective modes; `selection` after step 1), or
    everything the mode pushes (full, quantized)."""
    req = state.generate
    mode, n = mode_of(req.transfer_mode), len(req.token_ids)
    if not mode.is_disaggregated or state.report.recompute_reason:
        return 0
    if mode.keeps_source and selection is not None:
        entry_bytes = wire_entry_bytes(layout, mode.push_width(req.kv_bits))  # exact, or a low-bit push's record
        dense_entries = DENSE_LAYERS * n * layout.num_kv_heads
        return _metadata_bytes(state, layout) + (dense_entries + selection.num_selected) * entry_bytes
    return state.push.expected_bytes


def selection_stats(req: Generate, selection: Selection, runner: ModelRunner | None) -> SelectionStats | None:
    """Online profiling: what this request selected, per layer and relative block of its prompt, over the steps
    that selected (None when none did: a context under the floor's dense threshold says nothing about importance)."""
    if selection.block_counts is None or not selection.num_sparse_steps or runner is None:
        return None
    n = len(req.token_ids)
    offered = tokens_per_block(n, NUM_BLOCKS) * selection.num_sparse_steps * runner.num_kv_heads
    return SelectionStats(runner.name, req.selector, n, runner.num_layers, NUM_BLOCKS,
                          selection.block_counts.astype(np.float32).tobytes(), offered.astype(np.float32).tobytes())
