"""Host-memory KV cache in fixed-size pages: the buffer the data plane registers and moves.

Layout (one tensor, allocated once, reused for every request):
    pages: (num_pages, 2, num_kv_heads, page_tokens, head_dim)   # dim 1: 0 = K, 1 = V
A request owns a page table of shape (num_layers, num_blocks): block b of layer l holds tokens
[b * page_tokens, (b + 1) * page_tokens) of that layer. Page p's bytes sit at p * page_bytes in `region`.
NOTE: the store never grows or reallocates: `region` stays valid (and registered) for the process's life.
"""
from __future__ import annotations

import heapq
import math
import threading
from dataclasses import dataclass

import torch

from schemas import KvLayout


class OutOfPages(RuntimeError):
    """The store has no room for a request; the caller should refuse it (admission control)."""


@dataclass(slots=True)
class PageTable:
    request_id: str
    num_tokens: int
    page_ids: torch.Tensor  # (num_layers, num_blocks) int64

    @property
    def num_blocks(self) -> int:
        return self.page_ids.shape[1]


def layout_for(num_layers: int, num_kv_heads: int, head_dim: int, page_tokens: int, dtype: torch.dtype) -> KvLayout:
    item = torch.empty((), dtype=dtype).element_size()
    return KvLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, page_tokens=page_tokens,
                    dtype=str(dtype).removeprefix("torch."), page_bytes=2 * num_kv_heads * page_tokens * head_dim * item)


class KvStore:
    def __init__(self, layout: KvLayout, num_pages: int):
        self.layout = layout
        dtype = getattr(torch, layout.dtype)
        self.pages = torch.zeros(num_pages, 2, layout.num_kv_heads, layout.page_tokens, layout.head_dim, dtype=dtype)
        self.region = memoryview(self.pages.view(-1).view(torch.uint8).numpy())  # what the data plane registers
        self._free = list(range(num_pages))  # a heap: lowest ids first, so a request's pages tend to be contiguous
        self._tables: dict[str, PageTable] = {}
        self._lock = threading.Lock()  # allocate/free come from the event loop, reads from the torch thread

    @classmethod
    def with_capacity_mb(cls, layout: KvLayout, capacity_mb: int) -> "KvStore":
        return cls(layout, max(1, capacity_mb * 2**20 // layout.page_bytes))

    # --- bookkeeping -------------------------------------------------------------------
    @property
    def num_pages_total(self) -> int:
        return self.pages.shape[0]

    @property
    def num_pages_free(self) -> int:
        return len(self._free)

    @property
    def num_pages_in_use(self) -> int:
        return self.num_pages_total - len(self._free)

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    def pages_needed(self, num_tokens: int) -> int:
        return self.layout.num_layers * math.ceil(num_tokens / self.layout.page_tokens)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> PageTable:
        if num_tokens <= 0:
            raise ValueError("num_tokens must be positive")
        needed = self.pages_needed(num_tokens)
        with self._lock:
            if request_id in self._tables:
                raise ValueError(f"request {request_id} already holds pages")
            if needed > len(self._free):
                raise OutOfPages(f"request needs {needed} KV pages, {len(self._free)} of {self.num_pages_total} are free")
            ids = sorted(heapq.heappop(self._free) for _ in range(needed))
            table = PageTable(request_id, num_tokens, torch.tensor(ids, dtype=torch.int64).view(self.layout.num_layers, -1))
            self._tables[request_id] = table
            return table

    def table(self, request_id: str) -> PageTable:
        return self._tables[request_id]

    def free(self, request_id: str) -> bool:
        """Return a request's pages to the pool. Idempotent: False if it held none."""
        with self._lock:
            table = self._tables.pop(request_id, None)
            if table is None:
                return False
            for page in table.page_ids.flatten().tolist():
                heapq.heappush(self._free, page)
            return True

    # --- data ----------------------------------------------------------------------------
    def write_layer(self, table: PageTable, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer. keys/values: (num_kv_heads, num_tokens, head_dim), any device."""
        ids = table.page_ids[layer]
        self.pages[ids, 0] = self._to_blocks(keys, table.num_blocks)
        self.pages[ids, 1] = self._to_blocks(values, table.num_blocks)

    def read_layer(self, table: PageTable, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V, each (num_kv_heads, num_tokens, head_dim), gathered into new tensors."""
        kv = self.pages[table.page_ids[layer]]  # (num_blocks, 2, H, T, D)
        kv = kv.permute(1, 2, 0, 3, 4).reshape(2, self.layout.num_kv_heads, -1, self.layout.head_dim)
        return kv[0, :, : table.num_tokens], kv[1, :, : table.num_tokens]

    def _to_blocks(self, x: torch.Tensor, num_blocks: int) -> torch.Tensor:
        heads, n, dim = x.shape
        padded = x.new_zeros(heads, num_blocks * self.layout.page_tokens, dim)
        padded[:, :n] = x
        # (H, num_blocks * T, D) → (num_blocks, H, T, D)
        return padded.view(heads, num_blocks, self.layout.page_tokens, dim).transpose(0, 1).cpu()
