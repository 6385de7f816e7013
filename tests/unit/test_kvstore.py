"""The slab KV store: allocation, layout round-trip, wire rows, and that nothing leaks."""
from __future__ import annotations

import pytest
import torch

from shared.compute.kvstore import KvStore, OutOfPages, layout_for, slab_rows


@pytest.fixture
def store() -> KvStore:
    return KvStore(layout_for(num_layers=3, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.float32), num_pages=10)


def test_write_read_round_trip(store):
    """K/V written per layer come back exactly, as views of the slab."""
    slab = store.allocate("r", capacity=10)  # 3 pages of 4 tokens
    layers = [(torch.randn(2, 7, 8), torch.randn(2, 7, 8)) for _ in range(3)]
    for i, (k, v) in enumerate(layers):
        store.write_layer(slab, i, k, v)
    assert slab.num_tokens == 7 and slab.capacity == 12
    for i, (k, v) in enumerate(layers):
        k2, v2 = store.read_layer(slab, i)
        assert torch.equal(k, k2) and torch.equal(v, v2)
        assert k2.data_ptr() == store.view(slab)[i, 0].data_ptr()  # a view, not a copy


def test_rows_are_the_bytes_of_the_view(store):
    """slab_rows names exactly the region bytes that hold a layer's K and V rows for a token range."""
    store.allocate("pad", 4)
    slab = store.allocate("r", 8)
    store.write_layer(slab, 1, torch.randn(2, 8, 8), torch.randn(2, 8, 8))
    view = store.view(slab)
    rows = store.rows(slab, 1, 2, 6)
    assert rows == slab_rows(store.layout, store.offset(slab), slab.capacity, 1, 2, 6)
    expected = [view[1, kv, h, 2:6].contiguous().view(torch.uint8).numpy().tobytes() for kv in (0, 1) for h in (0, 1)]
    assert [bytes(store.region[o: o + n]) for o, n in rows] == expected


def test_out_of_pages_changes_nothing(store):
    """A request that does not fit is refused and the arena is left as it was."""
    store.allocate("a", 28)  # 7 pages
    with pytest.raises(OutOfPages):
        store.allocate("b", 16)  # 4 more
    assert store.num_pages_in_use == 7 and store.request_ids == ["a"]


def test_free_merges_extents_and_is_idempotent(store):
    """Freed slabs merge back, so a slab as large as the arena fits again; a second free is harmless."""
    for name in "abc":
        store.allocate(name, 12)
    assert store.free("b") and store.free("a") and store.free("c")
    assert not store.free("a")
    assert store.num_pages_in_use == 0 and store.request_ids == []
    store.allocate("whole", 40)


def test_bad_allocations_are_refused(store):
    """Zero capacity or a duplicate request id are errors."""
    with pytest.raises(ValueError):
        store.allocate("a", 0)
    store.allocate("a", 1)
    with pytest.raises(ValueError):
        store.allocate("a", 1)
