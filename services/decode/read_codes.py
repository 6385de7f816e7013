"""Reads as codes (smartgen with kv_bits: KvSource.codes_bits): where one request's read records are on both nodes,
and their landing. Plain NumPy, no torch: it runs on the event loop (services/decode/remote.py).

The prefill node holds every prompt entry's record, layer by layer, record head·N + token within its layer
(shared/compute/entry_codes.py, "Read codes"). A read moves any entries' records (one gather of `record_bytes`
units across layers, or one segment per run of consecutive records) into the same places of the decode slab's own
codes region, the one the proactive push's records landed in: a layer's part of it is free once its pushed records were
dequantized (RemoteKv keeps that order). Once landed, `land` dequantizes them into the slab's rows, in the
slab's dtype, before the entries are marked present (presence turns True only once the values are in the rows).

Bytes per entry (head_dim 64): 136 with 8-bit values, 104 with 4-bit (keys are 8-bit either way), against 256
for an exact bf16 K and V (512 in fp32). The decode side needs no more memory: the push's codes region is
already there (layers × KV heads × N records); the prefill holds a second one, as large, under its lease.
"""
from __future__ import annotations

import numpy as np

from schemas import KvLayout, KvSource, entry_record_bytes
from shared.compute.entry_codes import STORED_AS, as_stored, records_to_values
from shared.dataplane import Gather
from services.decode.presence import Entries


class ReadCodes:
    def __init__(self, layout: KvLayout, source: KvSource, num_tokens: int, dst_base: int, region: memoryview,
                 dst_rows: np.ndarray, token_bytes: int):
        """`dst_base`: the byte, in this process's `region`, where the decode slab's codes region starts;
        `dst_rows` (num_layers, K|V, num_kv_heads): the byte where each row of the slab starts; `token_bytes`:
        one token of one head's K (or V)."""
        self.bits, self.head_dim, self.num_tokens = source.codes_bits, layout.head_dim, num_tokens
        self.record_bytes = entry_record_bytes(layout.head_dim, source.codes_bits)
        self.num_kv_heads = layout.num_kv_heads
        self.src_base, self.dst_base, self.dtype = source.codes_offset, dst_base, layout.dtype
        # the slab's codes region here, one record a row: (layer · H + head) · N + token
        self.records = np.frombuffer(region, dtype=np.uint8, offset=dst_base,
                                     count=layout.num_layers * self.num_kv_heads * num_tokens * self.record_bytes,
                                     ).reshape(-1, self.record_bytes)
        # the slab's values as stored, one (token, head) vector of K or V a row: a slab row starts at a multiple of it
        assert not dst_rows.size or (dst_rows % token_bytes == 0).all()
        values = np.frombuffer(region, dtype=STORED_AS[layout.dtype],
                               count=len(region) // token_bytes * layout.head_dim)
        self.vectors = values.reshape(-1, layout.head_dim)
        self.k_rows, self.v_rows = dst_rows[:, 0] // token_bytes, dst_rows[:, 1] // token_bytes  # (L, H) in vectors

    def _index(self, entries: Entries) -> np.ndarray:
        """Each entry's record: (layer · H + head) · N + token, the same on both nodes."""
        return (entries.layer * self.num_kv_heads + entries.head) * self.num_tokens + entries.token

    def gather(self, entries: Entries) -> Gather:
        """Reading these entries' records: one gather of `record_bytes` units, index (layer · H + head) · N + token
        on both sides (layer by layer, record head · N + token within a layer)."""
        index = self._index(entries)
        return Gather(self.src_base, self.dst_base, self.record_bytes, index, index)

    def land(self, entries: Entries) -> None:
        """The records of these entries have landed: their K and V into the slab's rows (NumPy, in place)."""
        index = self._index(entries)
        keys, values = records_to_values(self.records[index], self.head_dim, self.bits)
        self.vectors[self.k_rows[entries.layer, entries.head] + entries.token] = as_stored(keys, self.dtype)
        self.vectors[self.v_rows[entries.layer, entries.head] + entries.token] = as_stored(values, self.dtype)
