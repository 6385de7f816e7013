"""Decode compute: build a request's cache (its landed slab, dequantized codes, or a local prefill) and step
it, densely or with selective attention (a selector and a budget per request, its metadata restored from
what the prefill node pushed or built from local keys). Synchronous torch; no asyncio.

Every mode decodes in place on a slab of the KV store, colocated too: a local prefill writes its KV into a
slab exactly as a prefill worker does (rounded to the store's kv dtype), so tokens agree across modes.

With a prefix cache (shared/compute/prefix_cache.py), a finished request's prompt's full pages (the KV the prefill
pushed) are copied there at its end (`end(..., keep=...)`), and a new request that starts the same way copies them
into its slab at `open` (`reuse_prefix`) instead of having them pushed."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from schemas import DEFAULT_FLOOR, BudgetFloor, Sampling, entry_region_bytes
from schemas.modes import Aux
from shared.compute import selective
from shared.compute.entry_codes import EntryCodes, pushed_mask
from shared.compute.slab_cache import SlabCache
from shared.compute.kvstore import KvStore, Slab
from shared.compute.modeling import ModelRunner
from shared.compute.prefix_cache import PrefixCache
from shared.compute.quantization import QuantLayout
from shared.compute.remote_entries import RemoteEntries
from shared.compute.sampling import FirstToken, first_token, sample
from shared.compute.selection import Selection
from shared.compute.selectors import DENSE_LAYERS, Budget, Geometry, Selector, make_selector
from shared.compute.selectors.metadata import MetadataLayout

MAX_METADATA_LAYOUTS = 64  # (selector, prompt length, bitmap) layouts kept; a few requests' are live at once


class DecodeEngine:
    def __init__(self, runner: ModelRunner, store: KvStore, prep_dir: Path | None = None,
                 floor: BudgetFloor = DEFAULT_FLOOR, prefix_cache: PrefixCache | None = None):
        self.runner, self.store, self.prep_dir, self.floor = runner, store, prep_dir, floor
        self.prefix_cache = prefix_cache  # KV pages of finished requests (None: off)
        self.caches: dict[str, SlabCache] = {}
        self._own_slabs: set[str] = set()  # slabs prefill_local allocated itself (freed by end)
        self.selections: dict[str, Selection] = {}
        self._selectors: dict[str, Selector] = {}  # built once per name (offline preparation is loaded here)
        self._metadata_layouts: dict[tuple[str, int, bool], MetadataLayout] = {}  # see `metadata_layout`
        self.geometry = Geometry(runner.num_layers, runner.config.num_attention_heads, runner.num_kv_heads,
                                 runner.head_dim, store.layout.page_tokens, getattr(torch, store.layout.dtype))
        selective.install(runner.model)

    def selector(self, name: str) -> Selector:
        """The named selector for this model (raises PreparationMissing or ValueError with the fix)."""
        if name not in self._selectors:
            self._selectors[name] = make_selector(name, self.geometry, self.prep_dir)
        return self._selectors[name]

    def has_selector(self, name: str) -> bool:
        """`name` is built (its preparation loaded): `selector(name)` is a lookup, safe off the torch thread."""
        return not name or name in self._selectors

    def metadata_layout(self, selector: str, num_tokens: int, query_bitmap: bool = False) -> MetadataLayout:
        """Where the metadata of a request of `num_tokens` prompt tokens lies in its aux area. Built once per
        (selector, prompt length, bitmap), not at each of the several steps of sizing and loading a request."""
        key = (selector, num_tokens, query_bitmap)
        if key not in self._metadata_layouts:
            if len(self._metadata_layouts) >= MAX_METADATA_LAYOUTS:
                self._metadata_layouts.clear()
            self._metadata_layouts[key] = MetadataLayout(self.selector(selector), self.runner.num_layers, num_tokens,
                                                         query_bitmap)
        return self._metadata_layouts[key]

    def aux_bytes(self, aux: Aux, num_tokens: int, selector: str = "", kv_bits: int = 0, query_bitmap: bool = False) -> int:
        """The bytes of the aux area a request of `num_tokens` prompt tokens needs: its selector's metadata (and
        the query-aware push's bitmap), or its KV as `kv_bits`-bit codes (ValueError or PreparationMissing, with
        the fix, when it cannot have one)."""
        lay = self.store.layout
        if aux is Aux.CODES:
            return QuantLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, kv_bits).nbytes
        if aux is Aux.METADATA:  # and, with kv_bits (smartgen's low-bit push), room for the pushed entries' codes
            metadata = self.metadata_layout(selector, num_tokens, query_bitmap)
            return metadata.nbytes + entry_region_bytes(lay, num_tokens, kv_bits)
        return 0

    def picked_by_query(self, slab: Slab, selector: str, num_tokens: int) -> np.ndarray:
        """(num_layers, num_kv_heads, num_tokens) bool: the entries the prompt's last query picked per layer (the
        query-aware push, which pushed them), from the bitmaps in `slab`'s aux area (layers 0–1: none; they
        arrive whole)."""
        bitmap = self.query_bitmaps(slab, selector, num_tokens)
        picked = np.zeros((self.runner.num_layers, self.runner.num_kv_heads, num_tokens), dtype=bool)
        for layer in range(DENSE_LAYERS, self.runner.num_layers):
            picked[layer] = bitmap(layer)
        return picked

    def query_bitmaps(self, slab: Slab, selector: str, num_tokens: int) -> Callable[[int], np.ndarray]:
        """layer ≥ DENSE_LAYERS → its (num_kv_heads, num_tokens) bool bitmap of `picked_by_query`, read once that
        layer's metadata has landed. NOTE: numpy over a view of the aux area, no torch compute: the decode service
        reads it on its event loop as each layer lands."""
        layout, aux = self.metadata_layout(selector, num_tokens, True), self.store.aux(slab)
        return lambda layer: layout.read_query_bitmap(aux, layer)

    def load_pushed_codes(self, slab: Slab, selector: str, num_tokens: int, bits: int, pushed: np.ndarray,
                          by_query: np.ndarray | None) -> None:
        """smartgen's low-bit push has landed: dequantize every pushed entry's codes into `slab`'s rows.
        `pushed` (num_layers, num_pages) bool: the plan's blocks; `by_query` (num_layers, num_kv_heads, N) bool."""
        load_layer = self.pushed_codes_loader(slab, selector, num_tokens, bits, pushed)
        for layer in range(self.runner.num_layers):
            load_layer(layer, by_query[layer] if by_query is not None else None)

    def entry_codes(self, selector: str, num_tokens: int, bits: int) -> EntryCodes:
        """smartgen's low-bit codes region of a request's aux area, after its metadata: where the pushed records
        land, and, once a layer's are dequantized, the records its reads bring (services/decode/remote.py)."""
        lay = self.store.layout
        metadata = self.metadata_layout(selector, num_tokens, True)
        return EntryCodes(lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, bits, offset=metadata.nbytes)

    def pushed_codes_loader(self, slab: Slab, selector: str, num_tokens: int, bits: int,
                            pushed: np.ndarray) -> Callable[[int, np.ndarray | None], None]:
        """(layer, its (num_kv_heads, N) bool entries pushed by query, or None) → dequantize that layer's pushed
        codes into `slab`'s rows, once they have landed (torch thread)."""
        lay = self.store.layout
        codes = self.entry_codes(selector, num_tokens, bits)
        aux, rows = self.store.aux(slab), self.store.view(slab)

        def load_layer(layer: int, by_query: np.ndarray | None) -> None:
            mask = pushed_mask(pushed[layer], lay.page_tokens, num_tokens, lay.num_kv_heads, by_query)
            codes.decode(aux, layer, mask, rows[layer, 0, :, :num_tokens], rows[layer, 1, :, :num_tokens])
        return load_layer

    @property
    def decodes_in_the_slab(self) -> bool:
        """The cache is the slab itself (CPU), not a copy of it: bytes landing later are seen by attention."""
        return self.store.arena.device == self.runner.device

    def detach_remote(self, request_id: str) -> None:
        """Every entry of the request is local now: its attention reads nothing remote any more. Called between
        steps (an assignment the torch thread sees at its next step)."""
        selection = self.selections.get(request_id)
        if selection is not None:
            selection.remote = None

    def use_selection(self, request_id: str, selector: str, budget: float, measure_mass: bool = False,
                      slab: Slab | None = None, remote: RemoteEntries | None = None, count_blocks: int = 0,
                      query_bitmap: bool = False, lazy: bool = False) -> None:
        """Decode this request with selective attention from now on. The selector's state for the cached
        tokens comes from the metadata the prefill node pushed into `slab`'s aux area when `slab` is given
        (`query_bitmap`: laid out with the query-aware push's bitmaps), else from the keys in the cache.
        `count_blocks` > 0 counts selections per relative block. `lazy` (with `slab`): a layer's state is restored
        when its attention first needs it, after its metadata has landed (`remote.ready`: no global push barrier)."""
        sel = Selection(self.selector(selector), Budget(budget, self.floor), measure_mass, remote=remote)
        cache = self.caches[request_id]
        num_tokens = cache.get_seq_length()
        if slab is not None:
            layout, aux = self.metadata_layout(selector, num_tokens, query_bitmap), self.store.aux(slab)
            sel.restore = lambda layer: sel.selector.restore(
                layer, [t.to(self.runner.device) for t in layout.read(aux, layer)], num_tokens)
        for layer in range(DENSE_LAYERS, self.runner.num_layers):
            if sel.restore is None:
                state = sel.states[layer] = sel.selector.new_state(layer)
                sel.selector.extend(layer, state, cache.layers[layer].keys[0])
            elif not lazy:
                sel.states[layer] = sel.restore(layer)
        if count_blocks:
            sel.count_blocks(self.runner.num_layers, num_tokens, count_blocks)
        self.selections[request_id] = sel

    def load_from_store(self, request_id: str, slab: Slab, num_tokens: int) -> None:
        """The prompt's KV has landed in `slab`: decode from it in place (new tokens are appended there)."""
        slab.num_tokens = num_tokens
        # On CPU the cache is the slab itself (views); on an accelerator, one copy to the device.
        rows = self.store.view(slab).to(self.runner.device)  # NOTE: kept in the kv dtype; attention casts up
        self.caches[request_id] = SlabCache(self.runner.config, rows, num_tokens)

    def load_quantized(self, request_id: str, slab: Slab, num_tokens: int, bits: int) -> None:
        """The prompt's KV landed as low-bit codes in `slab`'s aux area: dequantize them into its rows, then
        decode from the slab as in full mode."""
        for layer in range(self.store.layout.num_layers):
            self.dequantize_layer(slab, num_tokens, bits, layer)
        self.load_from_store(request_id, slab, num_tokens)

    def dequantize_layer(self, slab: Slab, num_tokens: int, bits: int, layer: int) -> None:
        """One layer's low-bit codes in `slab`'s aux area into its rows (quantized mode, as each layer lands)."""
        lay = self.store.layout
        quant = QuantLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, bits)
        rows = self.store.view(slab)
        quant.dequantize(self.store.aux(slab), layer, rows[layer, 0, :, :num_tokens], rows[layer, 1, :, :num_tokens])

    def prefill_local(self, request_id: str, token_ids: Sequence[int], sampling: Sampling, slab: Slab | None = None,
                      max_new_tokens: int = 64) -> int:
        """`prefill_local_scored`'s first token."""
        return self.prefill_local_scored(request_id, token_ids, sampling, slab, max_new_tokens).token

    def prefill_local_scored(self, request_id: str, token_ids: Sequence[int], sampling: Sampling,
                             slab: Slab | None = None, max_new_tokens: int = 64) -> FirstToken:
        """Colocated mode: run the prompt here, into `slab` (a service allocates it: admission is its call), or
        into one allocated here for the prompt and `max_new_tokens` (in-process tools; `end` frees it). Returns
        the first completion token (and the log-probabilities `sampling` asks for)."""
        if slab is None:
            slab = self.store.allocate(request_id, len(token_ids) + max_new_tokens)
            self._own_slabs.add(request_id)
        first = first_token(self.runner, token_ids, sampling,
                            lambda layer, k, v: self.store.write_layer(slab, layer, k, v))
        self.load_from_store(request_id, slab, len(token_ids))
        return first

    def recompute(self, request_id: str, slab: Slab, token_ids: Sequence[int], completion: Sequence[int],
                  sampling: Sampling, selector: str = "", budget: float = 0.0, count_blocks: int = 0) -> int:
        """failure_policy `recompute`: drop whatever cache the request had and build it in `slab` as colocated
        mode does (the prompt's prefill), then replay the completion so far but its last token (which the next step
        feeds) in one forward over the slab, then the selector if any. Returns the first completion token as sampled
        here. NOTE: one forward, not a step per token: a long replay would hold the torch thread, and every request
        batched on it, for as many steps. The replayed tokens attend over the slab's KV as steps do, densely: with a
        selector, tokens after the replay can differ from a run that never stopped (which attended selectively)."""
        self.end(request_id)
        first = self.prefill_local(request_id, token_ids, sampling, slab)
        if len(completion) > 1:
            self.runner.extend(self.caches[request_id], completion[:-1])
        if selector:
            self.use_selection(request_id, selector, budget, False, None, None, count_blocks)
        return first

    def step(self, request_id: str, token: int, sampling: Sampling, index: int) -> int:
        """Feed `token` (completion token index-1); returns completion token `index`."""
        return sample(self.step_logits(request_id, token), sampling, index)

    def step_logits(self, request_id: str, token: int) -> torch.Tensor:
        """One decode step of one request; the logits (vocab,) of its next token."""
        result = self.step_batch([(request_id, token)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def step_batch(self, steps: Sequence[tuple[str, int]]) -> list[torch.Tensor | Exception]:
        """One decode step of several requests together (continuous batching): feed each (request_id, token).
        Per request, in order: the logits (vocab,) of its next token, or the exception that failed it (a remote
        read that failed or timed out; the others are unaffected, and its cache must be rebuilt or dropped)."""
        selections = [self.selections.get(request_id) for request_id, _ in steps]
        remotes = [sel.remote for sel in selections if sel is not None and sel.remote is not None]
        for remote in remotes:
            remote.begin_step()
        try:
            with selective.stepping(selections) as step:
                logits = self.runner.step([self.caches[request_id] for request_id, _ in steps], [t for _, t in steps])
        finally:
            for remote in remotes:
                remote.end_step()
            for sel in selections:
                if sel is not None:
                    sel.num_steps += 1
        return [step.errors.get(b, logits[b]) for b in range(len(steps))]

    def reuse_prefix(self, slab: Slab, token_ids: Sequence[int]) -> int:
        """Copy the longest run of prefix-cached pages at the start of `token_ids` (a prompt) into `slab`'s rows;
        returns how many tokens that covers, never the prompt's last (the prefill pushes at least one row). The
        pages are held while they are copied, so eviction cannot free them under the copy."""
        if self.prefix_cache is None:
            return 0
        hit = self.prefix_cache.acquire(token_ids)
        try:
            num_tokens = min(hit.num_tokens, len(token_ids) - 1)
            if num_tokens > 0:
                for layer, (keys, values) in enumerate(hit.layer_kv(num_tokens)):
                    self.store.write_layer(slab, layer, keys, values)
            return max(0, num_tokens)
        finally:
            self.prefix_cache.release(hit)

    def end(self, request_id: str, keep: Sequence[int] = ()) -> Selection | None:
        """Drop the request's cache (and the slab prefill_local allocated for it); its selection, if any. `keep`:
        the ids of the first tokens in its cache (its prompt): first copy their full pages into the prefix cache."""
        cache = self.caches.pop(request_id, None)
        if keep and cache is not None and self.prefix_cache is not None and len(keep) <= cache.get_seq_length():
            self.prefix_cache.insert(keep, [(layer.keys[0], layer.values[0]) for layer in cache.layers])
        if request_id in self._own_slabs:
            self._own_slabs.discard(request_id)
            self.store.free(request_id)
        return self.selections.pop(request_id, None)
