"""Reads as codes (smartgen with kv_bits: KvSource.codes_bits): where one request's read records are on both nodes,
and their landing. Plain NumPy, no torch: it runs on the event loop (services/decode/remote.py).

The prefill node holds every prompt entry's record, layer by layer, record head·N + token within its layer
(shared/compute/entry_codes.py, "Read codes"). A read moves records (one gather of `record_bytes` units, or one
segment per run of a head's consecutive tokens) into the same places of the decode slab's own codes region, the
one the proactive push's records landed in: a layer's part of it is free once its pushed records were
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
from shared.dataplane import Gather, Segment


class ReadCodes:
    def __init__(self, layout: KvLayout, source: KvSource, num_tokens: int, dst_base: int, region: memoryview,
                 dst_rows: np.ndarray, token_bytes: int):
        """`dst_base`: the byte, in this process's `region`, where the decode slab's codes region starts;
        `dst_rows` (num_layers, K|V, num_kv_heads): the byte where each row of the slab starts; `token_bytes`:
        one token of one head's K (or V)."""
        self.bits, self.head_dim, self.num_tokens = source.codes_bits, layout.head_dim, num_tokens
        self.record_bytes = entry_record_bytes(layout.head_dim, source.codes_bits)
        self.layer_bytes = layout.num_kv_heads * num_tokens * self.record_bytes
        self.src_base, self.dst_base, self.dtype = source.codes_offset, dst_base, layout.dtype
        self.region = region
        # the slab's values as stored, one (token, head) vector of K or V a row: a slab row starts at a multiple of it
        assert not dst_rows.size or (dst_rows % token_bytes == 0).all()
        values = np.frombuffer(region, dtype=STORED_AS[layout.dtype],
                               count=len(region) // token_bytes * layout.head_dim)
        self.vectors = values.reshape(-1, layout.head_dim)
        self.k_rows, self.v_rows = dst_rows[:, 0] // token_bytes, dst_rows[:, 1] // token_bytes  # (L, H) in vectors

    @staticmethod
    def _records(heads: list[tuple[int, np.ndarray]], num_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        head = np.concatenate([np.full(tokens.size, h) for h, tokens in heads])
        token = np.concatenate([tokens for _, tokens in heads])
        return head, token, head * num_tokens + token

    def gather(self, layer: int, heads: list[tuple[int, np.ndarray]]) -> Gather:
        """These entries of `layer` (per KV head, sorted tokens) as one gather of records: head·N + token, both sides."""
        *_, index = self._records(heads, self.num_tokens)
        at = layer * self.layer_bytes
        return Gather(self.src_base + at, self.dst_base + at, self.record_bytes, index, index)

    def segments(self, layer: int, head: int, tokens: np.ndarray) -> list[Segment]:
        """Runs of consecutive tokens of one head → one segment of records each."""
        return self.gather(layer, [(head, tokens)]).segments()

    def land(self, layer: int, heads: list[tuple[int, np.ndarray]]) -> None:
        """The records of these entries have landed: their K and V into the slab's rows (NumPy, in place)."""
        head, token, index = self._records(heads, self.num_tokens)
        layer_records = np.frombuffer(self.region, dtype=np.uint8, count=self.layer_bytes,
                                      offset=self.dst_base + layer * self.layer_bytes).reshape(-1, self.record_bytes)
        keys, values = records_to_values(layer_records[index], self.head_dim, self.bits)
        self.vectors[self.k_rows[layer, head] + token] = as_stored(keys, self.dtype)
        self.vectors[self.v_rows[layer, head] + token] = as_stored(values, self.dtype)
