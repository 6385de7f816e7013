"""Decode compute: build a request's cache (its landed slab, or a local prefill) and step it, densely or
with selective attention (a selector and a budget per request). Synchronous torch; no asyncio."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers.cache_utils import DynamicCache

from schemas import Sampling
from services.decode import selective
from services.decode.selectors import Budget, Geometry, Selector, make_selector
from shared.kvstore import KvStore, Slab
from services.decode.slab_cache import SlabCache
from shared.modeling import ModelRunner
from shared.sampling import sample


class DecodeEngine:
    def __init__(self, runner: ModelRunner, store: KvStore, prep_dir: Path | None = None):
        self.runner, self.store, self.prep_dir = runner, store, prep_dir
        self.caches: dict[str, DynamicCache] = {}
        self.selections: dict[str, selective.Selection] = {}
        self._selectors: dict[str, Selector] = {}  # built once per name (offline preparation is loaded here)
        self.geometry = Geometry(runner.num_layers, runner.config.num_attention_heads, runner.num_kv_heads,
                                 runner.head_dim, store.layout.page_tokens)
        selective.install(runner.model)

    def selector(self, name: str) -> Selector:
        """The named selector for this model (raises PreparationMissing or ValueError with the fix)."""
        if name not in self._selectors:
            self._selectors[name] = make_selector(name, self.geometry, self.prep_dir)
        return self._selectors[name]

    def use_selection(self, request_id: str, selector: str, budget: float, measure_mass: bool = False) -> None:
        """Decode this request with selective attention from now on."""
        self.selections[request_id] = selective.Selection(self.selector(selector), Budget(budget), measure_mass)

    def load_from_store(self, request_id: str, slab: Slab, num_tokens: int) -> None:
        """The prompt's KV has landed in `slab`: decode from it in place (new tokens are appended there)."""
        slab.num_tokens = num_tokens
        # On CPU the cache is the slab itself (views); on an accelerator, one copy to the device.
        rows = self.store.view(slab).to(self.runner.device, self.runner.dtype)
        self.caches[request_id] = SlabCache(self.runner.config, rows, num_tokens)

    def prefill_local(self, request_id: str, token_ids: Sequence[int], sampling: Sampling) -> int:
        """Colocated mode: run the prompt here. Returns the first completion token."""
        logits, cache = self.runner.prefill(token_ids)
        self.caches[request_id] = cache
        return sample(logits, sampling, index=0)

    def step(self, request_id: str, token: int, sampling: Sampling, index: int) -> int:
        """Feed `token` (completion token index-1); returns completion token `index`."""
        return sample(self.step_logits(request_id, token), sampling, index)

    def step_logits(self, request_id: str, token: int):
        """One decode step; the logits (vocab,) of the next token."""
        selective.activate(self.selections.get(request_id))
        try:
            return self.runner.step(self.caches[request_id], token)
        finally:
            selective.activate(None)

    def end(self, request_id: str) -> selective.Selection | None:
        self.caches.pop(request_id, None)
        return self.selections.pop(request_id, None)
