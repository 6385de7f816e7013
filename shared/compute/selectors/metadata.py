"""Where a request's selector metadata lives in bytes: one block per layer ≥ DENSE_LAYERS, in the request's
aux area (shared/compute/kvstore.py), identical on the prefill node (which writes and pushes it) and the decode
node (which restores selector state from it).

    aux = [layer 2 block][layer 3 block]…      each block = the layer's `metadata_specs` tensors, packed,
                                               then (modes that push by query) the query bitmap

The query bitmap of a layer says which of its entries the prefill's query-aware push sent (smartgen:
docs/architecture.md, "The three transfer paths"): (num_kv_heads, ⌈N/8⌉) uint8, bit t of a head's row set
when token t of that head arrived (numpy's packbits order, LSB first). It travels inside the layer's block, so
it lands with, and is counted like, the metadata.
"""
from __future__ import annotations

import numpy as np
import torch

from shared.compute.packed import PackedTensors
from shared.compute.selectors.base import DENSE_LAYERS, Selector


class MetadataLayout:
    def __init__(self, selector: Selector, num_layers: int, num_tokens: int, query_bitmap: bool = False):
        self.selector, self.num_layers, self.num_tokens = selector, num_layers, num_tokens
        self.query_bitmap = query_bitmap
        specs = selector.metadata_specs(num_tokens)
        self.num_metadata = len(specs)
        if query_bitmap:
            specs = [*specs, ((selector.geometry.num_kv_heads, -(-num_tokens // 8)), torch.uint8)]
        self.block = PackedTensors(specs)
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
        if len(tensors) != self.num_metadata:
            raise ValueError(f"{type(self.selector).__name__} declares {self.num_metadata} metadata tensors, got {len(tensors)}")
        self.block.write(self._buf(aux, layer), tensors)

    def read(self, aux: torch.Tensor, layer: int) -> list[torch.Tensor]:
        """Views of `layer`'s metadata inside aux (restore copies them)."""
        return self.block.views(self._buf(aux, layer))[: self.num_metadata]

    def write_query_bitmap(self, aux: torch.Tensor, layer: int, picked: np.ndarray) -> None:
        """Store which entries of `layer` the query-aware push sends: `picked` (num_kv_heads, N) bool."""
        bits = torch.from_numpy(np.packbits(picked, axis=1, bitorder="little"))
        self.block.write(self._buf(aux, layer), [bits], first=self.num_metadata)

    def read_query_bitmap(self, aux: torch.Tensor, layer: int) -> np.ndarray:
        """(num_kv_heads, N) bool: the entries of `layer` the query-aware push sent."""
        bits = self.block.views(self._buf(aux, layer))[-1].cpu().numpy()
        return np.unpackbits(bits, axis=1, count=self.num_tokens, bitorder="little").astype(bool)
