"""The prefill's prefix cache: KV pages of earlier prompts, reused so a prompt that starts the same way computes only
the rest (vLLM's automatic prefix caching, at the granularity of the KV store's pages).

A page is `page_tokens` prompt tokens, all layers:
    (num_layers, 2, num_kv_heads, page_tokens, head_dim)   # dim 1: 0 = K, 1 = V; the model's compute dtype
Its key is a hash chain: key(page i) = sha256(key(page i-1) ‖ token ids of page i), so equal keys mean equal
token ids from the prompt's start through that page, and the page's KV (which depends on every token before it
too) is the same. Only full pages are kept.

The pool is bounded (`capacity_bytes`) and allocated once: at the first insert, one tensor of as many page slots as
fit (untouched memory costs nothing until a page is written into it); an evicted page's slot takes the next page.
So the pool's memory grows to its capacity and stays there (fresh ~0.7 MB tensors per page, freed on eviction,
let the allocator's heap grow for the whole of a 10-minute load test). A request holds the pages of its hit
(`acquire`) until it is done with them (`release`); LRU eviction frees only pages no request holds. NOTE: a chain is touched last page first, so its first
pages are the most recent and go last: evicting a page leaves the pages before it usable.
Thread-safe (the torch thread looks up and inserts; the admin server reads the gauges).
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from schemas import page_keys

# (keys, values) per layer, each (num_kv_heads, num_tokens, head_dim): what the prefill computed
LayerKv = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class _Page:
    slot: int  # its place in the pool
    kv: torch.Tensor  # (num_layers, 2, num_kv_heads, page_tokens, head_dim): a view of the pool's slot
    num_refs: int = 0  # requests holding it (acquire … release)


@dataclass(slots=True)
class Hit:
    """The cached pages at the start of one prompt, held until `PrefixCache.release`."""

    keys: list[bytes] = field(default_factory=list)
    pages: list[torch.Tensor] = field(default_factory=list)  # each (num_layers, 2, num_kv_heads, page_tokens, head_dim)
    page_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.page_tokens

    def layer_kv(self, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (keys, values) of the hit's first `num_tokens` tokens, each (num_kv_heads, num_tokens, head_dim)."""
        if not 0 < num_tokens <= self.num_tokens:
            raise ValueError(f"{num_tokens} tokens asked of a hit of {self.num_tokens}")
        kv = torch.cat(self.pages, dim=3)[:, :, :, :num_tokens]  # (L, 2, H, T, D)
        return [(layer[0], layer[1]) for layer in kv]


class PrefixCache:
    def __init__(self, capacity_bytes: int, page_tokens: int):
        if capacity_bytes < 0 or page_tokens <= 0:
            raise ValueError("capacity_bytes must be ≥ 0 and page_tokens positive")
        self.capacity_bytes, self.page_tokens = capacity_bytes, page_tokens
        self._pages: OrderedDict[bytes, _Page] = OrderedDict()  # least recently used first
        self._slots: torch.Tensor | None = None  # (num_slots, *page shape): every page's storage, from the first insert
        self._free: list[int] = []  # slots no page uses
        self._lock = threading.Lock()
        self.num_bytes = 0  # held by cached pages
        self.num_queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.num_hit_tokens = 0  # of those, found cached (vLLM's prefix_cache_hits)

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def num_pages_in_use(self) -> int:
        with self._lock:
            return sum(1 for page in self._pages.values() if page.num_refs)

    def stats(self) -> dict[str, int]:
        """For a worker's /stats."""
        return {"pages": self.num_pages, "pages_held": self.num_pages_in_use, "bytes": self.num_bytes,
                "capacity_bytes": self.capacity_bytes, "queried_tokens": self.num_queried_tokens,
                "hit_tokens": self.num_hit_tokens}

    def acquire(self, token_ids: Sequence[int]) -> Hit:
        """The longest run of cached pages at the start of `token_ids`, held (it cannot be evicted) until
        `release`. Counts the prompt's tokens as queried, and as hits those a prefill takes from the cache: the
        hit's, but never the prompt's last token (it always runs: its logits give the first completion token)."""
        hit = Hit(page_tokens=self.page_tokens)
        with self._lock:
            for key in page_keys(token_ids, self.page_tokens):
                page = self._pages.get(key)
                if page is None:
                    break
                page.num_refs += 1
                hit.keys.append(key)
                hit.pages.append(page.kv)
            self._touch(hit.keys)
            self.num_queried_tokens += len(token_ids)
            self.num_hit_tokens += min(hit.num_tokens, len(token_ids) - 1)
        return hit

    def release(self, hit: Hit) -> None:
        """Let `hit`'s pages be evicted again. Idempotent."""
        with self._lock:
            for key in hit.keys:
                if (page := self._pages.get(key)) is not None:
                    page.num_refs -= 1
            hit.keys, hit.pages = [], []

    def insert(self, token_ids: Sequence[int], layers: LayerKv) -> int:
        """Keep the full pages of `token_ids` not cached yet, copied from `layers` (the prompt's KV, per layer,
        (num_kv_heads, ≥ len(token_ids), head_dim), any device). Evicts unheld pages of other chains, least recently
        used first, to make room (never this chain's own, which would leave its later pages unreachable); stops at
        the first page that finds none. Returns the pages added."""
        keys = page_keys(token_ids, self.page_tokens)
        chain = set(keys)
        added = 0
        for index, key in enumerate(keys):
            start, stop = index * self.page_tokens, (index + 1) * self.page_tokens
            with self._lock:
                if key in self._pages:
                    continue
                slots = self._pool(layers)
                if not len(slots) or not self._make_room(slots[0].nbytes, chain):  # (no slot: capacity < a page)
                    break
                slot = self._free.pop()
                kv = slots[slot]  # (L, 2, H, page_tokens, D)
                for layer, (k, v) in enumerate(layers):
                    kv[layer, 0].copy_(k[:, start:stop])
                    kv[layer, 1].copy_(v[:, start:stop])
                self._pages[key] = _Page(slot, kv)
                self.num_bytes += kv.nbytes
                added += 1
        with self._lock:
            self._touch([key for key in keys if key in self._pages])
        return added

    def clear(self) -> None:
        """Drop every page no request holds."""
        with self._lock:
            for key in [key for key, page in self._pages.items() if not page.num_refs]:
                self._evict(key)

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # NOTE: the chain's first page ends up the most recently used (module docstring)
            self._pages.move_to_end(key)

    def _make_room(self, nbytes: int, keep: set[bytes]) -> bool:
        """Evict unheld pages not in `keep`, least recently used first, until `nbytes` more fit. False (having
        evicted what it could) if they cannot."""
        if nbytes > self.capacity_bytes:
            return False
        for key in [key for key, page in self._pages.items() if not page.num_refs and key not in keep]:
            if self.num_bytes + nbytes <= self.capacity_bytes:
                break
            self._evict(key)
        return self.num_bytes + nbytes <= self.capacity_bytes

    def _evict(self, key: bytes) -> None:
        page = self._pages.pop(key)
        self.num_bytes -= page.kv.nbytes
        self._free.append(page.slot)

    def _pool(self, layers: LayerKv) -> torch.Tensor:
        """The pool's slots, allocated at the first insert from its pages' shape: as many as `capacity_bytes` holds."""
        k = layers[0][0]
        shape = (len(layers), 2, k.shape[0], self.page_tokens, k.shape[2])
        if self._slots is None:
            page_bytes = math.prod(shape) * k.element_size()
            num_slots = self.capacity_bytes // page_bytes
            self._slots = torch.empty((num_slots, *shape), dtype=k.dtype)  # host memory, as pages always were
            self._free = list(range(num_slots - 1, -1, -1))  # slot 0 first
        elif self._slots.shape[1:] != shape or self._slots.dtype != k.dtype:
            raise ValueError(f"a page of shape {shape} ({k.dtype}) in a pool of {tuple(self._slots.shape[1:])} "
                             f"({self._slots.dtype})")
        return self._slots
