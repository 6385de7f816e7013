"""A transformers cache whose layers are views of a request's slab in the KV store.

The prompt's K/V are already in the slab (pushed there by the prefill node); each decode step writes its
new token's K/V in place at the next position and hands attention views of the first n tokens. Nothing is
copied or concatenated, so a step's cache cost does not grow with the context.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class SlabLayer(DynamicLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, num_tokens: int):
        """keys/values: (num_kv_heads, capacity, head_dim) views into the slab; the first num_tokens are filled."""
        super().__init__()
        self.k_rows, self.v_rows = keys, values
        self.num_tokens = num_tokens
        self.is_initialized = True
        self.device = keys.device
        self._expose()

    def _expose(self) -> None:
        self.keys = self.k_rows[None, :, : self.num_tokens]  # (1, H_kv, n, d), a view
        self.values = self.v_rows[None, :, : self.num_tokens]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n, q = self.num_tokens, key_states.shape[-2]
        if n + q > self.k_rows.shape[1]:
            raise RuntimeError(f"the slab holds {self.k_rows.shape[1]} tokens; cannot append past it")
        self.k_rows[:, n: n + q] = key_states[0]
        self.v_rows[:, n: n + q] = value_states[0]
        self.num_tokens += q
        self._expose()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.num_tokens


class SlabCache(DynamicCache):
    def __init__(self, config, slab: torch.Tensor, num_tokens: int):
        """slab: (num_layers, 2, num_kv_heads, capacity, head_dim), the request's slab view."""
        super().__init__(config=config)
        self.layers = [SlabLayer(slab[layer, 0], slab[layer, 1], num_tokens) for layer in range(slab.shape[0])]


class BatchLayer(DynamicLayer):
    """One layer of a batched decode step: each row appends its new token to its own slab layer, and
    attention gets the rows' whole caches as lists (they differ in length; see selective.py)."""

    def __init__(self, rows: list[SlabLayer]):
        super().__init__()
        self.rows = rows
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states/value_states (B, H_kv, 1, d) → lists of B (1, H_kv, n_b, d) views."""
        keys, values = [], []
        for b, row in enumerate(self.rows):
            k, v = row.update(key_states[b: b + 1], value_states[b: b + 1])
            keys.append(k)
            values.append(v)
        return keys, values

    def get_seq_length(self) -> int:
        return max(row.num_tokens for row in self.rows)


class BatchCache(DynamicCache):
    """The caches of the requests one decode step runs together, row b being caches[b]."""

    def __init__(self, config, caches: list[SlabCache]):
        super().__init__(config=config)
        self.layers = [BatchLayer([cache.layers[layer] for cache in caches]) for layer in range(len(caches[0].layers))]
