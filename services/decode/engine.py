"""Decode compute: build a request's cache (from landed pages, or by a local prefill) and step it.
Synchronous torch; no asyncio. Dense attention in this build; selective attention plugs in here."""
from __future__ import annotations

from collections.abc import Sequence

from transformers.cache_utils import DynamicCache

from schemas import Sampling
from shared.kvstore import KvStore, PageTable
from shared.modeling import ModelRunner
from shared.sampling import sample


class DecodeEngine:
    def __init__(self, runner: ModelRunner, store: KvStore):
        self.runner, self.store = runner, store
        self.caches: dict[str, DynamicCache] = {}

    def load_from_store(self, request_id: str, table: PageTable) -> None:
        """The KV has landed in `table`'s pages: gather it into the request's cache."""
        layers = [self.store.read_layer(table, layer) for layer in range(self.store.layout.num_layers)]
        self.caches[request_id] = self.runner.cache_from(layers)

    def prefill_local(self, request_id: str, token_ids: Sequence[int], sampling: Sampling) -> int:
        """Colocated mode: run the prompt here. Returns the first completion token."""
        logits, cache = self.runner.prefill(token_ids)
        self.caches[request_id] = cache
        return sample(logits, sampling, index=0)

    def step(self, request_id: str, token: int, sampling: Sampling, index: int) -> int:
        """Feed `token` (completion token index-1); returns completion token `index`."""
        return sample(self.runner.step(self.caches[request_id], token), sampling, index)

    def end(self, request_id: str) -> None:
        self.caches.pop(request_id, None)
