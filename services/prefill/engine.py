"""Prefill compute: run a prompt layer by layer into the page store. Synchronous torch; no asyncio."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from schemas import Sampling
from shared.kvstore import KvStore, Slab
from shared.modeling import ModelRunner
from shared.sampling import sample


class PrefillEngine:
    def __init__(self, runner: ModelRunner, store: KvStore):
        self.runner, self.store = runner, store

    def run(self, slab: Slab, token_ids: Sequence[int], sampling: Sampling,
            on_layer_stored: Callable[[int], None]) -> int:
        """Prefill `token_ids` into `slab`; `on_layer_stored(layer)` fires as each layer lands there.
        Returns the first completion token."""

        def store_layer(layer: int, keys, values) -> None:
            self.store.write_layer(slab, layer, keys, values)
            on_layer_stored(layer)

        logits, _ = self.runner.prefill(token_ids, on_layer=store_layer)
        return sample(logits, sampling, index=0)
