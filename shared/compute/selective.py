"""Selective attention for decode steps, through transformers' attention interface.

The model runs with attention implementation "smartgen_selective". The cache may hold K/V in a narrower
dtype than the model computes in (kv_dtype bf16, compute fp32): what attention reads is cast up, the whole
layer when dense, only the selected entries when selective. For prefill (many queries) it is plain SDPA, bit
for bit. A decode step runs a batch of requests (continuous batching: the projections and MLPs see all rows
at once) over a `BatchCache`, and each row attends over its own slab: a row without a `Selection`, or at layers
0–1, attends densely; at each layer ≥ 2 a row with one asks its selector for token indices per KV head, gathers
those K/V and attends to them only (on more than one thread, every such row's gather and attention together:
`_attend_selected`). Attention is order-invariant and RoPE is already in the cached keys: no re-positioning.

When part of the KV is still on the prefill node (`Selection.remote`, the partial and smartgen modes), the
selected indices split into local and remote (path 2): every row's remote read starts first, the local
entries are gathered while they are in flight, then the remote positions are filled in from the slab where
the read landed them. The gathered tensor is then exactly what an all-local gather gives (same values, same order),
so transfer never changes tokens.

Speculation (the speculative part of path 2): while a row's layer i is issued, the next layer's selection is
predicted from layer i's input (its query computed as layer i+1 would compute it, InfiniGen's speculation) over
the next layer's metadata, and the remote part of that prediction starts reading at once (`RemoteEntries.
speculate`); layer i+1 then waits for it and reads only what it missed. For InfiniGen, whose selection is
defined by that very query, the prediction misses at most tokens the step itself adds (always local); for the
other selectors it is a guess. Only where `RemoteEntries.wants_speculation` (the decode service's policy: which
selectors, which steps, and only where the next layer still has remote entries). The speculated query is made once
a step (`Step.probes`): InfiniGen's own selection at layer i+1 takes the one its speculation made at layer i.

Ranked reads (path 3 by the latest query): where a layer had to read this step, its selection for the same query
is taken again under RANKED_READ_FACTOR × the budget, and what that adds and is not local is handed to the
remote view (`RemoteEntries.rank`), which reads it on the background lane between on-demand reads: the entries
the next steps are most likely to select, ranked by the latest query rather than by a static profile.

Read-behind (a request that ablates "stall", selectors that rank tokens): after step 1, where a layer's selection
picks entries that are not local, the remote view starts reading them with nobody waiting (`RemoteEntries.
read_behind`) and the layer attends to its best local entries instead, so a step never waits on the link; a later
step finds the picks here. The tokens may then differ from an all-local run's: the measured trade is in
services/decode/read_behind.py.

NOTE: the step's context (`STEP`) is a module global set around one forward pass. Only the engine's single
torch thread runs the model, so there is never more than one step in flight.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import groupby

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from shared.compute.selectors import DENSE_LAYERS
# NOTE: imported into this module's namespace on purpose: tools (eval drift, bench query_overlap) wrap
# `selective.select_with_floor` for a run, and the step below calls it through this namespace (those tools step one
# request at a time: rows that select together, two or more, call `select_rows_with_floor` instead)
from shared.compute.floor import floor_scores, remember_picks, select_rows_with_floor, select_with_floor
from shared.compute.gather import SelectedRows, block
from shared.compute.queries import speculated_query
from shared.compute.remote_entries import PendingRead
from shared.compute.selection import Selection

ATTENTION_NAME = "smartgen_selective"
# Path 3 by the latest query: a layer that read this step ranks again under this many times its budget (module
# docstring). One more selection of the layer (~0.1 ms for Quest at 2K on this CPU), only where the layer read.
RANKED_READ_FACTOR = 2
# A selective row's selection runs on one torch thread (the rest of the step on all of them), and so do its gather and
# attention when it is the step's only selective row (several rows' go together, on every thread: `_attend_selected`):
# a few dozen ops over tens to hundreds of KB, where with OMP_WAIT_POLICY=PASSIVE waking the sleeping OpenMP threads
# (~8 µs a time here) costs more than a second thread saves (measured: a 73K-element mul 6.6 µs on one, 14.6 on two;
# a whole 8K step ~6 ms slower with one row's gather and attention on two). One thread computes the same values. CPU,
# fp32 compute only: torch.set_num_threads also clears oneDNN's primitive cache, which bf16 would rebuild every layer.
SERIAL_SELECTIVE = True


@dataclass
class Step:
    """One decode step of a batch of requests, while the model runs it: row b is request b."""

    selections: list[Selection | None]  # per row: its selective-attention state (None: dense)
    errors: dict[int, Exception] = field(default_factory=dict)  # rows whose reads failed: their output is void
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # decoder-layer inputs (B, 1, D) (speculation)
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin), each (B, 1, d)
    # (row, layer) → InfiniGen's query for that layer speculated from the layer before's input, (H, d): made once a
    # step, by the layer before's speculation (`_speculate_next_layer`) or by the layer's own selection (`_issue`)
    probes: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)


STEP: Step | None = None
_CAPTURE: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # layer → [(query, key)] (capture())


@contextmanager
def stepping(selections: list[Selection | None]) -> Iterator[Step]:
    """While inside, the model's forward is one decode step of these rows (the engine's torch thread only)."""
    global STEP
    STEP = step = Step(selections)
    try:
        yield step
    finally:
        STEP = None


@contextmanager
def capture() -> Iterator[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Offline calibration (tools/prepare_selectors.py): while inside, every attention call of a model that
    `install` switched appends its post-RoPE (query (H, n, d), key (H_kv, n, d)) to the yielded dict, per layer."""
    global _CAPTURE
    _CAPTURE = captured = {}
    try:
        yield captured
    finally:
        _CAPTURE = None


def selective_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Prefill, or a plain cache: query (B, H, q, d), key/value (B, H_kv, n, d), plain SDPA.
    A decode step over a `BatchCache` (see slab_cache.py): query (B, H, 1, d); key/value are lists of each
    row's whole cache, (1, H_kv, n_b, d). Returns (B, q, H, d), None."""
    if isinstance(key, list):
        return _attend_batch(module, query, key, value, scaling), None
    if _CAPTURE is not None:  # offline calibration: keep post-RoPE queries and keys (see capture())
        _CAPTURE.setdefault(module.layer_idx, []).append((query[0].detach(), key[0].detach()))
    return sdpa_attention_forward(module, query, _as(query, key), _as(query, value), attention_mask,
                                  dropout=dropout, scaling=scaling, **kwargs)


@dataclass
class _Row:
    """One row's attention at one layer, between issuing its remote read and attending."""

    query: torch.Tensor  # (1, H, 1, d)
    keys: torch.Tensor  # (H_kv, n, d), the row's whole cache
    values: torch.Tensor
    idx: torch.Tensor | None = None  # (H_kv, k') selected token indices; None: dense
    pending: PendingRead | None = None  # the remote read of what it needs and is not local


def _attend_batch(module, query, keys: list[torch.Tensor], values: list[torch.Tensor], scaling) -> torch.Tensor:
    """Every row selects and issues its remote read first (rows with reads first, then the rows that select
    together: `_select_together`), then each attends in turn, so the rows' reads are in flight together. A row
    whose read fails is voided (zeros, its error kept in `STEP.errors`); the others carry on. Returns (B, 1, H, d)."""
    step, layer = STEP, module.layer_idx
    assert step is not None and len(step.selections) == query.shape[0], "a BatchCache step outside stepping()"
    out = query.new_zeros(query.shape[0], 1, query.shape[1], query.shape[3])
    rows: list[_Row | None] = [None] * query.shape[0]
    serial_ok = SERIAL_SELECTIVE and query.device.type == "cpu" and query.dtype == torch.float32
    threads = torch.get_num_threads() if serial_ok else 1
    groups = _groups_selecting_together(layer, step, keys)
    later = {b for members in groups for b in members}

    def issue(b: int, sel: Selection | None, idx: torch.Tensor | None = None) -> None:
        serial = threads > 1 and _narrow(sel, layer, keys[b]) and idx is None
        try:
            if serial:
                torch.set_num_threads(1)
            rows[b] = _issue(module, layer, b, sel, _Row(query[b: b + 1], keys[b][0], values[b][0], idx))
        except Exception as exc:  # noqa: BLE001 (a read that could not start: this row only)
            step.errors[b] = exc
        finally:
            if serial:
                torch.set_num_threads(threads)

    for b, sel in enumerate(step.selections):
        if b not in step.errors and b not in later:
            issue(b, sel)
    for members in groups:
        chosen = _select_together(layer, step, members, query, keys, threads)
        for b in members:
            issue(b, step.selections[b], chosen.get(b))
    for b, row in enumerate(rows):
        if row is None or row.idx is not None:
            continue
        try:
            out[b] = _attend_dense(module, row, scaling)[0]
        except Exception as exc:  # noqa: BLE001 (a read that failed or timed out: this row only)
            step.errors[b] = exc
    narrow = [(b, row) for b, row in enumerate(rows) if row is not None and row.idx is not None]
    # the selective rows' gathers and attention: all together where that is large enough to use every thread (or an
    # accelerator), else one row at a time on one thread, where a row's gather stays in the cache until its attention
    # reads it (measured: docs/results/decode-step-2026-12-07, "Rows together")
    together = len(narrow) > 1 and (threads > 1 or query.device.type != "cpu")
    serial = threads > 1 and not together
    try:
        if serial:
            torch.set_num_threads(1)
        for chunk in [narrow] if together else [[r] for r in narrow]:
            try:
                _attend_selected(module, step, chunk, out, scaling)
            except Exception as exc:  # noqa: BLE001 (not a read: a read's failure voids its row inside) the chunk's rows
                for b, _ in chunk:
                    step.errors.setdefault(b, exc)
    finally:
        if serial:
            torch.set_num_threads(threads)
    return out


def _groups_selecting_together(layer: int, step: Step, keys: list[torch.Tensor]) -> list[list[int]]:
    """The rows that select together at `layer` (`_select_together`), in groups of two or more of one selector and
    floor: rows attending to a subset, all local (no reads to plan around), selecting by their own query (not
    InfiniGen's speculated one), with no selection's memory (a selector that ranks tokens under a floor that
    sticks scores every token: it selects alone)."""
    groups: dict[tuple, list[int]] = {}
    for b, sel in enumerate(step.selections):
        if b in step.errors or not _narrow(sel, layer, keys[b]) or sel.remote is not None \
                or getattr(sel.selector, "speculates", False) or (sel.budget.floor.stick and sel.selector.ranks_tokens):
            continue
        groups.setdefault((id(sel.selector), sel.budget.floor), []).append(b)
    return [members for members in groups.values() if len(members) > 1]


def _select_together(layer: int, step: Step, members: list[int], query: torch.Tensor, keys: list[torch.Tensor],
                     threads: int) -> dict[int, torch.Tensor]:
    """The selections at `layer` of a group of rows (`_groups_selecting_together`), made together: each row's
    selector state extended by its new key, then one `select_rows_with_floor` (one floor mask, one `mark_rows`,
    one nonzero for the group, where row by row each is a dozen small ops), on one thread as a row's selection.
    The same indices as row by row (tests). Returns row → its indices (H_kv, k'); empty if anything failed: then
    each row selects again in `_issue`, where a failure is its own (extending is idempotent: a row's state takes
    only keys past what it holds)."""
    sels = [step.selections[b] for b in members]
    selector, floor = sels[0].selector, sels[0].budget.floor
    serial = threads > 1
    try:
        if serial:
            torch.set_num_threads(1)
        states = [sel.state(layer) for sel in sels]
        for b, state in zip(members, states):
            selector.extend(layer, state, keys[b][0])
        ns = [keys[b].shape[2] for b in members]
        idx = select_rows_with_floor(selector, layer, states, query[members, :, 0],
                                     [sel.tokens(n) for sel, n in zip(sels, ns)], ns, floor)
    except Exception:  # noqa: BLE001 (see the docstring)
        return {}
    finally:
        if serial:
            torch.set_num_threads(threads)
    return dict(zip(members, idx))


def _narrow(sel: Selection | None, layer: int, keys: torch.Tensor) -> bool:
    """Whether the row attends to a budget's subset at `layer` (keys (1, H_kv, n, d)): its selection and attention are
    a few dozen small ops (see SERIAL_SELECTIVE)."""
    n = keys.shape[2]
    return sel is not None and layer >= DENSE_LAYERS and sel.tokens(n) < n


def _issue(module, layer: int, b: int, sel: Selection | None, row: _Row) -> _Row:
    """Choose what `row` attends to at `layer` and start reading the part of it that is not local."""
    if sel is None:
        return row
    if sel.remote is not None:
        sel.remote.ready(layer)  # its pushed KV may still be landing (step 1)
    n = row.keys.shape[1]
    k = sel.tokens(n)
    if layer < DENSE_LAYERS or k >= n:  # the whole cache: exactly dense
        if layer >= DENSE_LAYERS:
            sel.num_selections += 1
            sel.mass_sum += 1.0
            sel.num_selected += n * row.keys.shape[0]
            sel.num_candidates += n * row.keys.shape[0]
        row.pending = sel.remote.fetch(layer, None) if sel.remote is not None else None
    else:
        state = sel.state(layer)
        floor = sel.budget.floor
        if row.idx is None:
            sel.selector.extend(layer, state, row.keys)
            speculates = getattr(sel.selector, "speculates", False)
            probe = _speculated_probe(module._smartgen_decoder_layer, layer, b) if speculates else row.query[0, :, 0]
            # with remote KV, one scoring serves the selection, a read-behind one and the wider ranking (path 3). NOTE:
            # only then passed, so an all-local step's call stays the 7-argument one that tools and tests record
            once = {"scored": floor_scores(sel.selector, layer, state, probe, n, floor)} if sel.remote is not None else {}
            row.idx = select_with_floor(sel.selector, layer, state, probe, k, n, floor, **once)  # (H_kv, k')
        else:  # selected together with other rows (`_select_together`): all local, so nothing below reads these
            assert sel.remote is None
            probe, once = None, {}
        if sel.selector.ranks_tokens:  # the selection's memory weighs token scores: only these selectors read it
            remember_picks(state, row.idx, n, floor)
        if sel.picks is not None:
            sel.picks[layer] = row.idx
        if sel.remote is not None and sel.selector.ranks_tokens:
            absent = sel.remote.read_behind(layer, row.idx)
            if absent is not None:  # some picks are not here and the step does not stall: the best local ones instead
                row.idx = select_with_floor(sel.selector, layer, state, probe, k, n, floor, absent, **once)
        row.pending = sel.remote.fetch(layer, row.idx) if sel.remote is not None else None
        if sel.remote is not None and sel.remote.wants_ranking(layer):  # path 3 by the latest query
            wide = min(n, RANKED_READ_FACTOR * k)
            sel.remote.rank(layer, select_with_floor(sel.selector, layer, state, probe, wide, n, floor, **once))
    # the next layer's selection, predicted from this layer's input: from the last dense layer on, while selective
    if layer + 1 >= DENSE_LAYERS and k < n and sel.remote is not None and sel.remote.wants_speculation(layer + 1):
        _speculate_next_layer(module, layer, b, sel, k, n)
    if row.idx is not None and row.pending is not None and not sel.remote.parallel:
        row.pending.wait()  # path 2 switched off: fetch first, then gather
        row.pending = None
    return row


def _speculate_next_layer(module, layer: int, b: int, sel: Selection, k: int, n: int) -> None:
    """Predict row b's selection at layer + 1 from layer's input (module docstring) and start reading it."""
    nxt = module._smartgen_next_decoder_layer
    assert sel.remote is not None
    state = sel.states.get(layer + 1)
    if state is None and sel.restore is not None and sel.remote.is_ready(layer + 1):  # its metadata has landed
        state = sel.states[layer + 1] = sel.restore(layer + 1)
    if nxt is None or state is None:
        return
    probe = _speculated_probe(nxt, layer + 1, b)  # (H, d): layer + 1's query, speculated
    sel.remote.speculate(layer + 1, select_with_floor(sel.selector, layer + 1, state, probe, k, n, sel.budget.floor))


def _speculated_probe(decoder_layer, layer: int, b: int) -> torch.Tensor:
    """Row b's query at `layer` (its `decoder_layer`) speculated from layer − 1's input, (H, d): computed once a step,
    though both the layer before's speculation and the layer's own selection use it (a q_proj with its norm and RoPE:
    ~0.18 ms a layer inside a 2K step on this CPU, its weights read cold)."""
    probes = STEP.probes if STEP is not None else {}  # (no step: speculated_query says what is missing)
    probe = probes.get((b, layer))
    if probe is None:
        probe = probes[(b, layer)] = speculated_query(STEP, decoder_layer, layer - 1, b)
    return probe


def _attend_dense(module, row: _Row, scaling) -> torch.Tensor:
    """A dense row's attention output (1, 1, H, d) over its whole cache, local once the read of the missing
    entries has landed."""
    if row.pending is not None:
        row.pending.wait()
    return sdpa_attention_forward(module, row.query, _as(row.query, row.keys[None]), _as(row.query, row.values[None]),
                                  None, scaling=scaling)[0]


# the selected K/V of a layer's selective rows (one buffer, reused: the engine's one torch thread steps)
_SELECTED = SelectedRows()


def _attend_selected(module, step: Step, rows: list[tuple[int, _Row]], out: torch.Tensor, scaling) -> None:
    """The rows that attend to a selection, into out[b] (1, H, d): one gather of every row's selected K and V
    (`SelectedRows`: one index_select over the arena and one cast, on every thread), then each row's remote
    entries filled in from its slab once its read has landed (the local ones were gathered while it was in
    flight), then one SDPA over the KV heads (enable_gqa, no repeat_interleave copies) per run of rows of one
    width. Rows are taken widest first, so rows of one width lie next to each other in the buffer. A row whose
    read fails is voided (its error in `step.errors`); the others carry on."""
    rows = sorted(rows, key=lambda r: -r[1].idx.shape[1])
    query = rows[0][1].query
    picked = _SELECTED.gather([row.keys for _, row in rows], [row.values for _, row in rows],
                              [row.idx for _, row in rows], query.dtype)
    for (b, row), (k_sel, v_sel) in zip(rows, picked):
        if row.pending is None:
            continue
        try:
            row.pending.wait()
        except Exception as exc:  # noqa: BLE001 (a read that failed or timed out: this row only)
            step.errors[b] = exc
            continue
        heads, cols = row.pending.remote.nonzero(as_tuple=True)
        k_sel[heads, cols] = row.keys[heads, row.idx[heads, cols]].to(k_sel.dtype)  # now landed in the slab
        v_sel[heads, cols] = row.values[heads, row.idx[heads, cols]].to(v_sel.dtype)
    group = query.shape[1] // rows[0][1].keys.shape[0]
    for _, run in groupby(zip(rows, picked), key=lambda r: r[0][1].idx.shape[1]):
        run = list(run)
        joined = block([kv for _, kv in run]) if len(run) > 1 else None
        calls = [([r for r, _ in run], joined)] if joined else [([r], (k[None], v[None])) for r, (k, v) in run]
        for members, (k_sel, v_sel) in calls:  # members: rows of one width; k_sel, v_sel (rows, H_kv, k, d)
            q = torch.cat([row.query for _, row in members]) if len(members) > 1 else members[0][1].query
            att = torch.nn.functional.scaled_dot_product_attention(q, k_sel, v_sel, scale=scaling, enable_gqa=group > 1)
            for r, (b, row) in enumerate(members):
                if b not in step.errors:
                    out[b] = att[r].transpose(0, 1)
                    step.selections[b].account(module.layer_idx, row.query, row.keys, row.idx, scaling)


def _as(like: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`x` in `like`'s dtype (no copy when it already is)."""
    return x if x.dtype == like.dtype else x.to(like.dtype)


def install(model) -> None:
    """Switch `model` to selective attention and add the hooks speculation needs (inputs, RoPE)."""
    AttentionInterface.register(ATTENTION_NAME, selective_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    layers = model.get_decoder().layers
    for i, decoder_layer in enumerate(layers):
        # NOTE: object.__setattr__, so the back-references are not registered as submodules (no cycle in the tree)
        object.__setattr__(decoder_layer.self_attn, "_smartgen_decoder_layer", decoder_layer)
        object.__setattr__(decoder_layer.self_attn, "_smartgen_next_decoder_layer",
                           layers[i + 1] if i + 1 < len(layers) else None)

        def keep_input(_module, args, kwargs, i=i):
            if STEP is not None:
                STEP.layer_inputs[i] = args[0] if args else kwargs["hidden_states"]

        def keep_rope(_module, args, kwargs):
            if STEP is not None and kwargs.get("position_embeddings") is not None:
                STEP.position_embeddings = kwargs["position_embeddings"]

        decoder_layer.register_forward_pre_hook(keep_input, with_kwargs=True)
        decoder_layer.self_attn.register_forward_pre_hook(keep_rope, with_kwargs=True)
