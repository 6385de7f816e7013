"""Which of one request's (layer, KV head, prompt token) entries are on this decode node, and where each lives on
both nodes (byte addresses for reads). Plain NumPy, no threads: services/decode/remote.py's RemoteKv marks
entries present from the event loop once their bytes have landed and asks what is remote from the torch thread.
NOTE: presence only turns True after the bytes are in the slab, so a stale False costs a duplicate read, never a
wrong value.
"""
from __future__ import annotations

import numpy as np
import torch

from schemas import KvLayout, KvSource
from shared.dataplane import Gather, Segment


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
        row = self.present[layer]
        fresh = int((entries & ~row).sum())
        row |= entries
        self.missing_per_layer[layer] -= fresh
        self.num_missing -= fresh

    def mark(self, layer: int, head: int, tokens: np.ndarray) -> None:
        row = self.present[layer, head]
        fresh = int((~row[tokens]).sum())
        row[tokens] = True
        self.missing_per_layer[layer] -= fresh
        self.num_missing -= fresh

    def local_blocks(self) -> np.ndarray:
        """(num_layers, num_pages) bool: blocks wholly on this node."""
        n_pad = self.num_pages * self.page_tokens - self.num_tokens
        full = np.pad(self.present.all(axis=1), ((0, 0), (0, n_pad)), constant_values=True)
        return full.reshape(full.shape[0], self.num_pages, self.page_tokens).all(axis=2)

    def gather(self, layer: int, heads: list[tuple[int, np.ndarray]]) -> Gather:
        """One layer's entries as one gather: K rows then V rows, each (kv·H + head)·capacity + token, in units of
        one token of one head (`token_bytes`)."""
        head = np.concatenate([np.full(tokens.size, h) for h, tokens in heads])
        token = np.concatenate([tokens for _, tokens in heads])
        rows = np.concatenate([head, head + self.num_kv_heads])  # K|V × head, as in src_rows / dst_rows
        token = np.concatenate([token, token])
        return Gather(int(self.src_rows[layer, 0, 0]), int(self.dst_rows[layer, 0, 0]), self.token_bytes,
                      rows * self.source.capacity + token, rows * self.dst_capacity + token)

    def segments(self, layer: int, head: int, tokens: np.ndarray) -> list[Segment]:
        """Runs of consecutive tokens → one K and one V segment each (slab rows are token-contiguous)."""
        breaks = np.flatnonzero(np.diff(tokens) != 1) + 1
        starts, stops = tokens[np.r_[0, breaks]], tokens[np.r_[breaks - 1, tokens.size - 1]] + 1
        tb = self.token_bytes
        return [Segment(int(self.src_rows[layer, kv, head] + a * tb), int(self.dst_rows[layer, kv, head] + a * tb),
                        int((b - a) * tb))
                for kv in (0, 1) for a, b in zip(starts.tolist(), stops.tolist())]


def mean_run(heads: list[tuple[int, np.ndarray]]) -> float:
    """Mean length of the runs of consecutive tokens in a read (tokens sorted per head)."""
    runs = sum(1 + int(np.count_nonzero(np.diff(tokens) != 1)) for _, tokens in heads)
    return sum(tokens.size for _, tokens in heads) / runs


def read_chunks(heads: list[tuple[int, np.ndarray]], max_tokens: int) -> list[list[tuple[int, np.ndarray]]]:
    """Split (head, tokens) pairs into reads of at most `max_tokens` entries each, in order."""
    chunks: list[list[tuple[int, np.ndarray]]] = [[]]
    room = max_tokens
    for h, tokens in heads:
        while tokens.size:
            if not room:
                chunks.append([])
                room = max_tokens
            chunks[-1].append((h, tokens[:room]))
            tokens, room = tokens[room:], room - min(room, tokens.size)
    return [c for c in chunks if c]
