"""Which of one request's (layer, KV head, prompt token) entries are on this decode node, and where each lives on
both nodes (byte addresses for reads). Plain NumPy: services/decode/remote.py's RemoteKv marks entries present
once their bytes have landed (from the event loop, or the torch thread for its direct reads: `lock`) and asks
what is remote from the torch thread.
NOTE: presence only turns True after the bytes are in the slab, so a stale False costs a duplicate read, never a
wrong value.

What one read moves is an `Entries`: any (layer, head, token) entries, across layers, as one gather (the slab is
one array (L, K|V, H, capacity, d) on both nodes, so every row has one index from one base). Reads build, land and
mark them with a few array operations, however many layers and pages they span: the event loop's cost per read,
not per page (path 3 used to cost ~77 µs of Python per page and head).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from schemas import KvLayout, KvSource
from shared.dataplane import Gather


@dataclass(frozen=True)
class Entries:
    """Some (layer, KV head, prompt token) entries of one request: three (n,) int64 arrays, no entry twice."""

    layer: np.ndarray
    head: np.ndarray
    token: np.ndarray

    @classmethod
    def of_layer(cls, layer: int, heads: list[tuple[int, np.ndarray]]) -> "Entries":
        """One layer's entries given per KV head (head, its token indices)."""
        if not heads:
            return cls.concat([])
        head = np.concatenate([np.full(tokens.size, h) for h, tokens in heads])
        return cls(np.full(head.size, layer), head, np.concatenate([tokens for _, tokens in heads]))

    @classmethod
    def concat(cls, parts: Sequence["Entries"]) -> "Entries":
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return cls(empty, empty, empty)
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("layer", "head", "token")))

    @property
    def size(self) -> int:
        return self.token.size

    def __getitem__(self, which: slice | np.ndarray) -> "Entries":
        return Entries(self.layer[which], self.head[which], self.token[which])

    def layers(self) -> list[int]:
        return np.unique(self.layer).tolist()

    def mean_run(self) -> float:
        """Mean length of the runs of consecutive tokens of one (layer, head), in this order."""
        if not self.size:
            return 0.0
        breaks = (np.diff(self.token) != 1) | (np.diff(self.layer) != 0) | (np.diff(self.head) != 0)
        return self.size / (1 + int(np.count_nonzero(breaks)))


class Presence:
    def __init__(self, layout: KvLayout, source: KvSource, dst_offset: int, dst_capacity: int, num_tokens: int,
                 pushed: np.ndarray, pushed_entries: np.ndarray | None):
        """`pushed` (num_layers, num_pages) bool: blocks pushed during prefill; `pushed_entries` (num_layers,
        num_kv_heads, num_tokens) bool: entries pushed one by one (smartgen's query-aware push); both landed."""
        lay = layout
        self.source, self.dst_capacity, self.num_tokens = source, dst_capacity, num_tokens
        self.num_kv_heads, self.page_tokens = lay.num_kv_heads, lay.page_tokens
        self.num_pages = pushed.shape[1]
        item = lay.token_bytes // (2 * lay.num_layers * lay.num_kv_heads * lay.head_dim)
        self.token_bytes = lay.head_dim * item  # one token of one head's K (or V)
        rows = np.arange(lay.num_layers * 2 * lay.num_kv_heads).reshape(lay.num_layers, 2, lay.num_kv_heads)
        self.src_rows = source.offset + rows * source.capacity * self.token_bytes  # (L, K|V, H) bytes
        self.dst_rows = dst_offset + rows * dst_capacity * self.token_bytes
        padded = np.repeat(pushed, self.page_tokens, axis=1)[:, : num_tokens]  # (L, N)
        self.present = np.repeat(padded[:, None], self.num_kv_heads, axis=1)  # (L, H, N)
        if pushed_entries is not None:
            self.present |= pushed_entries
        self.missing_per_layer = (~self.present).sum(axis=(1, 2))
        self.num_missing = int(self.missing_per_layer.sum())
        self.lock = threading.Lock()  # marking is a read-modify-write of the counts, from either thread

    def remote_part(self, layer: int, idx: torch.Tensor | None) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """Which of the entries `idx` (H_kv, k) selects at `layer` (None: all its tokens) are not here: a bool mask
        of idx's shape (of (H_kv, N) for None), and per KV head with any, (head, its remote token indices)."""
        present = self.present[layer]
        if not self.missing_per_layer[layer]:
            return np.zeros(present.shape if idx is None else tuple(idx.shape), dtype=bool), []
        if idx is None:
            remote = ~present
        else:
            idx_np = idx.cpu().numpy()
            remote = np.zeros(idx_np.shape, dtype=bool)
            in_prompt = idx_np < self.num_tokens  # decoded tokens are local
            rows = np.broadcast_to(np.arange(idx_np.shape[0])[:, None], idx_np.shape)
            remote[in_prompt] = ~present[rows[in_prompt], idx_np[in_prompt]]
        heads = []
        for h in range(self.num_kv_heads):
            tokens = np.flatnonzero(remote[h]) if idx is None else idx_np[h][remote[h]]
            if tokens.size:
                heads.append((h, tokens))
        return remote, heads

    def mark_entries(self, layer: int, entries: np.ndarray) -> None:
        """`entries` (num_kv_heads, num_tokens) bool of `layer` are here."""
        with self.lock:
            row = self.present[layer]
            fresh = int((entries & ~row).sum())
            row |= entries
            self.missing_per_layer[layer] -= fresh
            self.num_missing -= fresh

    def mark(self, entries: Entries) -> None:
        """These entries are here (their bytes have landed)."""
        at = (entries.layer, entries.head, entries.token)
        with self.lock:
            fresh = np.bincount(entries.layer[~self.present[at]], minlength=self.missing_per_layer.size)
            self.present[at] = True
            self.missing_per_layer -= fresh
            self.num_missing -= int(fresh.sum())

    def missing(self, entries: Entries) -> Entries:
        """Those of `entries` still not here."""
        return entries[~self.present[entries.layer, entries.head, entries.token]]

    def missing_in_blocks(self, blocks: Sequence[int]) -> Entries:
        """The entries of these (layer, page) blocks (layer · num_pages + page) not here: block by block, head by
        head, tokens in order (a block's tokens of one head are one run)."""
        blocks = np.fromiter(dict.fromkeys(blocks), dtype=np.int64)  # each once, in order
        layer, page = np.divmod(blocks, self.num_pages)
        shape = (blocks.size, self.num_kv_heads, self.page_tokens)
        token = np.broadcast_to(page[:, None, None] * self.page_tokens + np.arange(self.page_tokens), shape)
        layer = np.broadcast_to(layer[:, None, None], shape)
        head = np.broadcast_to(np.arange(self.num_kv_heads)[None, :, None], shape)
        in_prompt = token < self.num_tokens  # the last page may be partial
        return self.missing(Entries(layer[in_prompt], head[in_prompt], token[in_prompt]))

    def local_blocks(self) -> np.ndarray:
        """(num_layers, num_pages) bool: blocks wholly on this node."""
        n_pad = self.num_pages * self.page_tokens - self.num_tokens
        full = np.pad(self.present.all(axis=1), ((0, 0), (0, n_pad)), constant_values=True)
        return full.reshape(full.shape[0], self.num_pages, self.page_tokens).all(axis=2)

    def gather(self, entries: Entries) -> Gather:
        """Reading these entries' K and V rows: one gather in units of one token of one head (`token_bytes`), row
        (layer · 2 + K|V) · H + head of the slab, index row · capacity + token on each side; K rows, then V rows."""
        rows = (entries.layer * 2)[None] + np.arange(2)[:, None]  # (K|V, n)
        rows = (rows * self.num_kv_heads + entries.head).ravel()
        token = np.tile(entries.token, 2)
        return Gather(int(self.src_rows[0, 0, 0]), int(self.dst_rows[0, 0, 0]), self.token_bytes,
                      rows * self.source.capacity + token, rows * self.dst_capacity + token)
