"""Where a request's selector metadata lives in bytes: one block per layer ≥ DENSE_LAYERS, in the request's
aux area (shared/compute/kvstore.py), identical on the prefill node (which writes and pushes it) and the decode
node (which restores selector state from it).

    aux = [layer 2 block][layer 3 block]…      each block = the layer's `metadata_specs` tensors, packed
"""
from __future__ import annotations

import torch

from shared.compute.packed import PackedTensors
from shared.compute.selectors.base import DENSE_LAYERS, Selector


class MetadataLayout:
    def __init__(self, selector: Selector, num_layers: int, num_tokens: int):
        self.selector, self.num_layers, self.num_tokens = selector, num_layers, num_tokens
        self.block = PackedTensors(selector.metadata_specs(num_tokens))
        self.layer_bytes = self.block.nbytes
        self.nbytes = self.layer_bytes * max(0, num_layers - DENSE_LAYERS)

    def layer_range(self, layer: int) -> tuple[int, int]:
        """(offset, length) in bytes of `layer`'s block within the aux area."""
        if not DENSE_LAYERS <= layer < self.num_layers:
            raise ValueError(f"layer {layer} keeps no metadata (dense layers are 0..{DENSE_LAYERS - 1})")
        return (layer - DENSE_LAYERS) * self.layer_bytes, self.layer_bytes

    def _buf(self, aux: torch.Tensor, layer: int) -> torch.Tensor:
        at, n = self.layer_range(layer)
        return aux[at: at + n]

    def write(self, aux: torch.Tensor, layer: int, tensors: list[torch.Tensor]) -> None:
        """aux: the request's aux area as uint8. Store `layer`'s exported metadata in it."""
        self.block.write(self._buf(aux, layer), tensors)

    def read(self, aux: torch.Tensor, layer: int) -> list[torch.Tensor]:
        """Views of `layer`'s metadata inside aux (restore copies them)."""
        return self.block.views(self._buf(aux, layer))
