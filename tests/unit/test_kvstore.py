"""The paged KV store: allocation, layout round-trip, and that nothing leaks."""
from __future__ import annotations

import pytest
import torch

from shared.kvstore import KvStore, OutOfPages, layout_for


@pytest.fixture
def store() -> KvStore:
    return KvStore(layout_for(num_layers=3, num_kv_heads=2, head_dim=8, page_tokens=4, dtype=torch.float32), num_pages=40)


def test_write_read_round_trip_with_partial_last_page(store):
    """K/V written per layer come back exactly, for a token count that is not a page multiple."""
    table = store.allocate("r", num_tokens=10)  # 3 blocks of 4 tokens, the last one half full
    assert table.page_ids.shape == (3, 3)
    layers = [(torch.randn(2, 10, 8), torch.randn(2, 10, 8)) for _ in range(3)]
    for i, (k, v) in enumerate(layers):
        store.write_layer(table, i, k, v)
    for i, (k, v) in enumerate(layers):
        k2, v2 = store.read_layer(table, i)
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_region_is_the_page_buffer(store):
    """The registered region aliases the pages: a byte written into it shows up in the tensor."""
    table = store.allocate("r", 4)
    page = int(table.page_ids[0, 0])
    offset = page * store.layout.page_bytes
    store.region[offset: offset + 4] = torch.tensor([1.5], dtype=torch.float32).view(torch.uint8).numpy().tobytes()
    assert store.pages[page, 0, 0, 0, 0].item() == 1.5
    assert store.layout.page_bytes == 2 * 2 * 4 * 8 * 4


def test_pages_are_contiguous_when_the_pool_is_fresh(store):
    """Lowest ids first: a request's pages form one run, so a layer push is a single segment."""
    ids = store.allocate("r", 12).page_ids.flatten().tolist()
    assert ids == list(range(ids[0], ids[0] + len(ids)))


def test_out_of_pages_changes_nothing(store):
    """A request that does not fit is refused and the pool is left as it was."""
    store.allocate("a", 40)  # 30 pages
    with pytest.raises(OutOfPages):
        store.allocate("b", 20)  # 15 more
    assert store.num_pages_in_use == 30 and store.request_ids == ["a"]


def test_free_returns_every_page_and_is_idempotent(store):
    """After free, the store is empty again; a second free is harmless."""
    store.allocate("a", 7)
    store.allocate("b", 9)
    assert store.free("a") and store.free("b")
    assert not store.free("a")
    assert store.num_pages_in_use == 0 and store.request_ids == []


def test_bad_allocations_are_refused(store):
    """Zero tokens or a duplicate request id are errors."""
    with pytest.raises(ValueError):
        store.allocate("a", 0)
    store.allocate("a", 1)
    with pytest.raises(ValueError):
        store.allocate("a", 1)
