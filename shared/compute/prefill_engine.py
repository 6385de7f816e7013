"""Prefill compute: run a prompt layer by layer into the KV store. Synchronous torch; no asyncio."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from schemas import Sampling
from shared.compute.kvstore import KvStore, Slab
from shared.compute.modeling import ModelRunner
from shared.compute.quantization import QuantLayout
from shared.compute.sampling import sample
from shared.compute.selectors import DENSE_LAYERS, Geometry, Selector, make_selector
from shared.compute.selectors.metadata import MetadataLayout

# encode(layer, keys, values): derive what travels instead of, or ahead of, the layer's KV (into the aux area)
LayerEncoder = Callable[[int, torch.Tensor, torch.Tensor], None]


class PrefillEngine:
    def __init__(self, runner: ModelRunner, store: KvStore, prep_dir: Path | None = None):
        self.runner, self.store, self.prep_dir = runner, store, prep_dir
        self.geometry = Geometry(runner.num_layers, runner.config.num_attention_heads, runner.num_kv_heads,
                                 runner.head_dim, store.layout.page_tokens)
        self._selectors: dict[str, Selector] = {}

    def selector(self, name: str) -> Selector:
        """The named selector (raises PreparationMissing or ValueError with the fix), built once."""
        if name not in self._selectors:
            self._selectors[name] = make_selector(name, self.geometry, self.prep_dir)
        return self._selectors[name]

    def run(self, slab: Slab, token_ids: Sequence[int], sampling: Sampling, on_layer_stored: Callable[[int], None],
            encode: LayerEncoder | None = None) -> int:
        """Prefill `token_ids` into `slab`; `encode` runs on each layer's K/V as stored (rounded to the store's
        dtype, so metadata and codes describe exactly the KV decode will attend to), then `on_layer_stored(layer)`
        fires as each layer has landed. Returns the first completion token."""

        def store_layer(layer: int, keys, values) -> None:
            self.store.write_layer(slab, layer, keys, values)
            if encode is not None:
                stored_k, stored_v = self.store.read_layer(slab, layer, keys.shape[1])
                encode(layer, stored_k.to(keys.device, keys.dtype), stored_v.to(values.device, values.dtype))
            on_layer_stored(layer)

        logits, _ = self.runner.prefill(token_ids, on_layer=store_layer)
        return sample(logits, sampling, index=0)

    def metadata_encoder(self, slab: Slab, selector: str, num_tokens: int) -> tuple[MetadataLayout, LayerEncoder]:
        """Selective modes: each layer ≥ 2's selector metadata for every prompt token, into the aux area."""
        sel = self.selector(selector)
        layout = MetadataLayout(sel, self.runner.num_layers, num_tokens)
        aux = self.store.aux(slab)

        def encode(layer: int, keys: torch.Tensor, _values: torch.Tensor) -> None:
            if layer >= DENSE_LAYERS:
                state = sel.new_state(layer)
                sel.extend(layer, state, keys)
                layout.write(aux, layer, sel.export(state))

        return layout, encode

    def quantizer(self, slab: Slab, bits: int, num_tokens: int) -> tuple[QuantLayout, LayerEncoder]:
        """Quantized mode: each layer's K/V as low-bit codes, into the aux area."""
        lay = self.store.layout
        layout = QuantLayout(lay.num_layers, lay.num_kv_heads, lay.head_dim, num_tokens, bits)
        aux = self.store.aux(slab)
        return layout, lambda layer, keys, values: layout.quantize(aux, layer, keys, values)
