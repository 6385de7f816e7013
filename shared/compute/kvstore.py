"""Host-memory KV cache: one contiguous slab per request inside one preallocated arena.

The arena is allocated once and never moves: it is the region the data plane registers. A request's slab:
    (num_layers, 2, num_kv_heads, capacity, head_dim)   # dim 1: 0 = K, 1 = V; tokens contiguous per head
so a layer's K or V for one head is one run of bytes (one segment on the wire), and attention reads a
request's cache as views of its slab, without copying. Slabs are allocated in pages of `page_tokens`
tokens (across all layers); a page of one layer is also the block that the selective transfer modes
push, queue and mark present. A slab may end in an *aux area* of raw bytes, right after its rows: the
selector metadata (shared/compute/selectors/metadata.py) or the quantized codes (shared/compute/quantization.py) that
travel ahead of, or instead of, the KV itself.
NOTE: allocate/free come from the event loop, reads and writes from the torch thread: bookkeeping is locked.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from schemas import KvLayout
from shared.runtime.arena import SharedArena


class OutOfPages(RuntimeError):
    """The store has no room for a request; the caller should refuse it (admission control)."""


@dataclass(slots=True)
class Slab:
    request_id: str
    first_page: int  # where the slab starts, in pages from the arena start
    num_pages: int
    capacity: int  # tokens the slab can hold (a whole number of pages)
    aux_bytes: int = 0  # bytes of the aux area after the rows (0 = none)
    num_tokens: int = 0  # tokens written so far


def layout_for(num_layers: int, num_kv_heads: int, head_dim: int, page_tokens: int, dtype: torch.dtype) -> KvLayout:
    item = torch.empty((), dtype=dtype).element_size()
    return KvLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, page_tokens=page_tokens,
                    dtype=str(dtype).removeprefix("torch."), token_bytes=2 * num_layers * num_kv_heads * head_dim * item)


def slab_rows(layout: KvLayout, offset: int, capacity: int, layer: int, start: int, stop: int) -> list[tuple[int, int]]:
    """Byte ranges (offset, length) of tokens [start, stop) of one layer in a slab at byte `offset` holding
    `capacity` tokens: one range per (K|V, head), in slab order."""
    item = layout.token_bytes // (2 * layout.num_layers * layout.num_kv_heads * layout.head_dim)
    row_bytes = capacity * layout.head_dim * item
    rows = []
    for kv in (0, 1):
        for head in range(layout.num_kv_heads):
            row = offset + ((layer * 2 + kv) * layout.num_kv_heads + head) * row_bytes
            rows.append((row + start * layout.head_dim * item, (stop - start) * layout.head_dim * item))
    return rows


class KvStore:
    def __init__(self, layout: KvLayout, num_pages: int, shared: bool = False):
        """`shared`: the arena lies in shared memory (`shared_arena`), which a transfer agent process maps too."""
        self.layout = layout
        self.page_bytes = layout.token_bytes * layout.page_tokens
        dtype = getattr(torch, layout.dtype)
        item = torch.empty((), dtype=dtype).element_size()
        self.shared_arena: SharedArena | None = None
        if shared:
            self.shared_arena = SharedArena(num_pages * self.page_bytes)  # zeroed by the kernel
            self.arena = torch.frombuffer(self.shared_arena.view, dtype=dtype)
        else:
            self.arena = torch.zeros(num_pages * self.page_bytes // item, dtype=dtype)
        self.region = memoryview(self.arena.view(torch.uint8).numpy())  # what the data plane registers
        self._num_pages = num_pages
        self._free: list[tuple[int, int]] = [(0, num_pages)]  # sorted (first page, count) extents
        self._slabs: dict[str, Slab] = {}
        self._lock = threading.Lock()

    @classmethod
    def with_capacity_mb(cls, layout: KvLayout, capacity_mb: int, shared: bool = False) -> "KvStore":
        return cls(layout, max(1, capacity_mb * 2**20 // (layout.token_bytes * layout.page_tokens)), shared)

    # --- bookkeeping -------------------------------------------------------------------------
    @property
    def num_pages_total(self) -> int:
        return self._num_pages

    @property
    def num_pages_free(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def num_pages_in_use(self) -> int:
        return self._num_pages - self.num_pages_free

    @property
    def request_ids(self) -> list[str]:
        return list(self._slabs)

    def pages_needed(self, capacity: int, aux_bytes: int = 0) -> int:
        return math.ceil(capacity / self.layout.page_tokens) + math.ceil(aux_bytes / self.page_bytes)

    def allocate(self, request_id: str, capacity: int, aux_bytes: int = 0) -> Slab:
        """A slab for `capacity` tokens and `aux_bytes` of aux area (first fit). Raises OutOfPages, changing
        nothing, if none fits."""
        if capacity <= 0 or aux_bytes < 0:
            raise ValueError("capacity must be positive and aux_bytes not negative")
        need = self.pages_needed(capacity, aux_bytes)
        token_capacity = math.ceil(capacity / self.layout.page_tokens) * self.layout.page_tokens
        with self._lock:
            if request_id in self._slabs:
                raise ValueError(f"request {request_id} already holds a slab")
            for i, (first, count) in enumerate(self._free):
                if count >= need:
                    self._free[i:i + 1] = [(first + need, count - need)] if count > need else []
                    slab = self._slabs[request_id] = Slab(request_id, first, need, token_capacity, aux_bytes)
                    return slab
            raise OutOfPages(f"request needs {need} contiguous KV pages; {self.num_pages_free} of "
                             f"{self._num_pages} are free (largest run {max((n for _, n in self._free), default=0)})")

    def slab(self, request_id: str) -> Slab:
        return self._slabs[request_id]

    def free(self, request_id: str) -> bool:
        """Return a request's slab to the arena. Idempotent: False if it held none."""
        with self._lock:
            slab = self._slabs.pop(request_id, None)
            if slab is None:
                return False
            extents = sorted([*self._free, (slab.first_page, slab.num_pages)])
            merged: list[tuple[int, int]] = []
            for first, count in extents:
                if merged and merged[-1][0] + merged[-1][1] == first:
                    merged[-1] = (merged[-1][0], merged[-1][1] + count)
                else:
                    merged.append((first, count))
            self._free = merged
            return True

    # --- data ----------------------------------------------------------------------------------
    def offset(self, slab: Slab) -> int:
        """Byte offset of the slab in the region."""
        return slab.first_page * self.page_bytes

    def view(self, slab: Slab) -> torch.Tensor:
        """The slab as a tensor (num_layers, 2, num_kv_heads, capacity, head_dim), sharing memory."""
        lay = self.layout
        per_token = lay.token_bytes // self.arena.element_size()
        start = slab.first_page * lay.page_tokens * per_token
        flat = self.arena[start: start + slab.capacity * per_token]
        return flat.view(lay.num_layers, 2, lay.num_kv_heads, slab.capacity, lay.head_dim)

    def aux_offset(self, slab: Slab) -> int:
        """Byte offset of the slab's aux area in the region."""
        return self.offset(slab) + slab.capacity * self.layout.token_bytes

    def aux(self, slab: Slab) -> torch.Tensor:
        """The slab's aux area as a uint8 tensor, sharing memory."""
        start = self.aux_offset(slab)
        return self.arena.view(torch.uint8)[start: start + slab.aux_bytes]

    def write_layer(self, slab: Slab, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer's prompt KV. keys/values: (num_kv_heads, num_tokens, head_dim), any device."""
        n = keys.shape[1]
        if n > slab.capacity:
            raise ValueError(f"{n} tokens do not fit a slab of {slab.capacity}")
        view = self.view(slab)
        view[layer, 0, :, :n] = keys
        view[layer, 1, :, :n] = values
        slab.num_tokens = max(slab.num_tokens, n)

    def read_layer(self, slab: Slab, layer: int, num_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of one layer's K and V, each (num_kv_heads, num_tokens, head_dim)."""
        n = slab.num_tokens if num_tokens is None else num_tokens
        view = self.view(slab)
        return view[layer, 0, :, :n], view[layer, 1, :, :n]

    def rows(self, slab: Slab, layer: int, start: int, stop: int) -> list[tuple[int, int]]:
        return slab_rows(self.layout, self.offset(slab), slab.capacity, layer, start, stop)
