"""Prefill compute: run a prompt layer by layer into the KV store. Synchronous torch; no asyncio."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from schemas import DEFAULT_FLOOR, BudgetFloor, Sampling
from shared.compute import queries, selective
from shared.compute.decode_engine import DecodeEngine
from shared.compute.entry_codes import EntryCodes, every_entry, pushed_mask
from shared.compute.kvstore import KvStore, Slab
from shared.compute.modeling import ModelRunner
from shared.compute.prefix_cache import PrefixCache
from shared.compute.quantization import QuantLayout
from shared.compute.sampling import FirstToken, first_token
from shared.compute.selectors import DENSE_LAYERS, Geometry, Selector, make_selector
from shared.compute.selectors.metadata import MetadataLayout

# encode(layer, keys, values): derive what travels instead of, or ahead of, the layer's KV (into the aux area)
LayerEncoder = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass
class QueryPush:
    """smartgen's query-aware push for one request: per layer ≥ DENSE_LAYERS, the entries the prompt's last
    position selects (its own query, the step rule of selective.select_with_floor with `tokens` per KV head),
    less those the plan's blocks already push. The torch thread fills `picked` as each layer is stored."""

    tokens: int  # TransferPlan.query_tokens: in layers DENSE_LAYERS … stop_layer − 1
    pushed_pages: np.ndarray  # (num_layers, num_pages) bool: the plan's blocks
    page_tokens: int
    floor: BudgetFloor = DEFAULT_FLOOR
    stop_layer: int = 0  # TransferPlan.query_stop_layer
    tail_tokens: int = 0  # TransferPlan.query_tail_tokens: in layers stop_layer … L − 1
    # TransferPlan.exact_push: a layer whose push the prefill service held back gets step 1's exact selection as
    # its picks once the prefill is done (`PrefillEngine.step_one_selection`): `pick_exact(layer, picked)`, set by
    # `metadata_encoder`, replaces the layer's picks, its bitmap and its codes (nothing of it has left yet)
    pick_exact: Callable[[int, np.ndarray], None] | None = None
    picked: dict[int, np.ndarray] = field(default_factory=dict)  # layer → (num_kv_heads, N) bool
    # the low-bit push (kv_bits on smartgen): every entry pushed during prefill, blocks included, goes as codes
    codes: EntryCodes | None = None
    num_records: dict[int, int] = field(default_factory=dict)  # layer → records written (codes)
    # ... and the reads (paths 2 and 3) too: every entry's record at a fixed place, head·N + token (entry_codes.py)
    read_codes: EntryCodes | None = None

    @property
    def num_entries(self) -> int:
        return int(sum(p.sum() for p in self.picked.values()))


class PrefillEngine:
    def __init__(self, runner: ModelRunner, store: KvStore, prep_dir: Path | None = None,
                 prefix_cache: PrefixCache | None = None):
        self.runner, self.store, self.prep_dir = runner, store, prep_dir
        self.prefix_cache = prefix_cache  # None: every prompt computed whole
        self.geometry = Geometry(runner.num_layers, runner.config.num_attention_heads, runner.num_kv_heads,
                                 runner.head_dim, store.layout.page_tokens, getattr(torch, store.layout.dtype))
        self._selectors: dict[str, Selector] = {}
        self.last_query: dict[int, torch.Tensor] = {}  # layer → (H, d), during a run with a query-aware push
        self._decoder: DecodeEngine | None = None  # step 1 run here (`step_one_selection`), built on first use

    def selector(self, name: str) -> Selector:
        """The named selector (raises PreparationMissing or ValueError with the fix), built once."""
        if name not in self._selectors:
            self._selectors[name] = make_selector(name, self.geometry, self.prep_dir)
        return self._selectors[name]

    def run(self, slab: Slab, token_ids: Sequence[int], sampling: Sampling, on_layer_stored: Callable[[int], None],
            encode: LayerEncoder | None = None, last_queries: bool = False, reuse_prefix: bool = False) -> int:
        """`run_scored`'s first token."""
        return self.run_scored(slab, token_ids, sampling, on_layer_stored, encode, last_queries, reuse_prefix).token

    def run_scored(self, slab: Slab, token_ids: Sequence[int], sampling: Sampling,
                   on_layer_stored: Callable[[int], None], encode: LayerEncoder | None = None,
                   last_queries: bool = False, reuse_prefix: bool = False) -> FirstToken:
        """`run_then_keep`, the prompt's new pages kept in the prefix cache before it returns."""
        first, keep = self.run_then_keep(slab, token_ids, sampling, on_layer_stored, encode, last_queries, reuse_prefix)
        keep()
        return first

    def run_then_keep(self, slab: Slab, token_ids: Sequence[int], sampling: Sampling,
                      on_layer_stored: Callable[[int], None], encode: LayerEncoder | None = None,
                      last_queries: bool = False, reuse_prefix: bool = False) -> tuple[FirstToken, Callable[[], int]]:
        """Prefill `token_ids` into `slab`; `encode` runs on each layer's K/V as stored (rounded to the store's
        dtype, so metadata and codes describe exactly the KV decode will attend to), then `on_layer_stored(layer)`
        fires as each layer has landed. `last_queries`: keep each layer's last-position query for `encode` (a
        query-aware push). `reuse_prefix` (with a prefix cache): take the prompt's cached pages instead of computing
        them. Either way every layer lands whole, all N tokens, in `slab`. Returns the first completion token (and
        the log-probabilities `sampling` asks for, and how many tokens were cached), and `keep`: run on the torch
        thread, it puts the prompt's new full pages in the prefix cache and returns how many (0 without
        `reuse_prefix`). The prefill service runs it once token 1 is on its way: copying the pages is not TTFT's."""
        cache = self.prefix_cache if reuse_prefix else None
        # NOTE: echo's prompt scores need every position computed: it looks nothing up (but still fills the cache)
        hit = cache.acquire(token_ids) if cache is not None and not sampling.echo else None
        # at least the last token runs: its logits give the first completion token
        num_cached = min(hit.num_tokens, len(token_ids) - 1) if hit is not None else 0
        computed: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, (H, N, D) in the compute dtype

        def store_layer(layer: int, keys, values) -> None:
            if cache is not None:
                computed.append((keys, values))
            self.store.write_layer(slab, layer, keys, values)
            if encode is not None:
                stored_k, stored_v = self.store.read_layer(slab, layer, keys.shape[1])
                encode(layer, stored_k.to(keys.device, keys.dtype), stored_v.to(values.device, values.dtype))
            on_layer_stored(layer)

        try:
            past = hit.layer_kv(num_cached) if hit is not None and num_cached else None
            with self._last_queries() if last_queries else _nothing():
                first = first_token(self.runner, token_ids, sampling, store_layer, past)
        finally:
            if cache is not None and hit is not None:
                cache.release(hit)
        first.num_cached_tokens = num_cached

        def keep() -> int:  # NOTE: `computed` is the prefill's own KV (not the slab's): nothing writes it after the run
            return cache.insert(token_ids, computed) if cache is not None else 0

        return first, keep

    def step_one_selection(self, slab: Slab, num_tokens: int, first: int, selector: str, budget: float,
                           floor: BudgetFloor) -> dict[int, np.ndarray]:
        """smartgen's exact push: run decode step 1 here, over the prompt's KV in `slab` (capacity ≥ N + 1) and
        the selector state rebuilt from the metadata the prefill wrote (as the decode node rebuilds it), feeding
        the first token `first`. Returns, per selective layer, (num_kv_heads, N) bool: the prompt entries step 1
        selects. The decode node, running the same step on the same bytes, selects the same ones."""
        if self._decoder is None:
            self._decoder = DecodeEngine(self.runner, self.store, self.prep_dir)
        decoder, rid = self._decoder, f"step-one/{slab.request_id}"
        decoder.floor = floor
        decoder.load_from_store(rid, slab, num_tokens)
        try:
            decoder.use_selection(rid, selector, budget, slab=slab, query_bitmap=True)
            selection = decoder.selections[rid]
            selection.picks = {}
            decoder.step_logits(rid, first)
            picks = {}
            for layer, idx in selection.picks.items():
                picked = np.zeros((idx.shape[0], num_tokens + 1), dtype=bool)
                np.put_along_axis(picked, idx.cpu().numpy(), True, axis=1)
                picks[layer] = picked[:, :num_tokens]  # the first token's own entry is the decode node's
            return picks
        finally:
            decoder.end(rid)
            slab.num_tokens = num_tokens

    @contextmanager
    def _last_queries(self) -> Iterator[None]:
        """While inside, each decoder layer's post-RoPE query at the prompt's last position lands in
        `self.last_query[layer]` (H, d) as the layer starts (the query-aware push selects with it)."""
        hooks = []
        for i, decoder_layer in enumerate(self.runner.model.get_decoder().layers):
            def keep(_module, args, kwargs, i=i, decoder_layer=decoder_layer):
                hidden = args[0] if args else kwargs["hidden_states"]
                cos, sin = kwargs["position_embeddings"]
                self.last_query[i] = queries.query_of(decoder_layer, hidden[:, -1:], cos[:, -1:], sin[:, -1:])
            hooks.append(decoder_layer.register_forward_pre_hook(keep, with_kwargs=True))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self.last_query.clear()

    def metadata_encoder(self, slab: Slab, selector: str, num_tokens: int, query_push: QueryPush | None = None,
                         push_bits: int = 0, read_codes_at: int = -1) -> tuple[MetadataLayout, LayerEncoder]:
        """Selective modes: each layer ≥ 2's selector metadata for every prompt token, into the aux area; with
        `query_push`, also the entries the layer's last-position query selects, and their bitmap; with
        `push_bits` too, every entry the layer pushes (blocks and query entries) as codes, after the metadata,
        and, with `read_codes_at` ≥ 0, every entry's record at a fixed place from that byte of the aux area on
        (the read codes the decode node's reads move: shared/compute/entry_codes.py)."""
        sel = self.selector(selector)
        layout = MetadataLayout(sel, self.runner.num_layers, num_tokens, query_bitmap=query_push is not None)
        aux = self.store.aux(slab)
        if push_bits:
            assert query_push is not None, "the low-bit push is smartgen's, which pushes by query"
            lay = self.store.layout
            query_push.codes = EntryCodes(lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, push_bits,
                                          offset=layout.nbytes)
            if read_codes_at >= 0:
                query_push.read_codes = EntryCodes(lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens,
                                                   push_bits, offset=read_codes_at)

        def encode(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            if layer >= DENSE_LAYERS:
                encode_metadata(layer, keys)
            if query_push is not None and query_push.codes is not None:
                encode_codes(layer, keys, values)
            if query_push is not None and query_push.read_codes is not None:
                query_push.read_codes.encode(aux, layer, keys, values, every_entry(keys.shape[0], num_tokens))

        def encode_codes(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
            assert query_push is not None and query_push.codes is not None
            mask = pushed_mask(query_push.pushed_pages[layer], query_push.page_tokens, num_tokens, keys.shape[0],
                               query_push.picked.get(layer))
            query_push.num_records[layer] = query_push.codes.encode(aux, layer, keys, values, mask)

        def encode_metadata(layer: int, keys: torch.Tensor) -> None:
            state = sel.new_state(layer)
            sel.extend(layer, state, keys)
            layout.write(aux, layer, sel.export(state))
            if query_push is not None:
                picked = np.zeros((keys.shape[0], num_tokens), dtype=bool)
                tokens = query_push.tokens if layer < query_push.stop_layer else query_push.tail_tokens
                if tokens > 0:
                    idx = selective.select_with_floor(sel, layer, state, self.last_query[layer], tokens, num_tokens,
                                                      query_push.floor)
                    np.put_along_axis(picked, idx.cpu().numpy(), True, axis=1)
                record_picks(layer, picked)

        def record_picks(layer: int, picked: np.ndarray) -> None:
            assert query_push is not None
            in_blocks = np.repeat(query_push.pushed_pages[layer], query_push.page_tokens)[:num_tokens]
            picked[:, in_blocks] = False  # the plan's blocks bring those already
            query_push.picked[layer] = picked
            layout.write_query_bitmap(aux, layer, picked)

        def pick_exact(layer: int, picked: np.ndarray) -> None:  # a held-back layer, once step 1 has run here
            record_picks(layer, picked)
            if query_push is not None and query_push.codes is not None:
                keys, values = self.store.read_layer(slab, layer, num_tokens)
                device, dtype = self.runner.device, self.runner.model.dtype
                encode_codes(layer, keys.to(device, dtype), values.to(device, dtype))

        if query_push is not None:
            query_push.pick_exact = pick_exact
        return layout, encode

    def quantizer(self, slab: Slab, bits: int, num_tokens: int) -> tuple[QuantLayout, LayerEncoder]:
        """Quantized mode: each layer's K/V as low-bit codes, into the aux area."""
        lay = self.store.layout
        layout = QuantLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, bits)
        aux = self.store.aux(slab)
        return layout, lambda layer, keys, values: layout.quantize(aux, layer, keys, values)


@contextmanager
def _nothing() -> Iterator[None]:
    yield
