"""KV-aware routing: the gateway's memory of which decode worker holds which pages (services/gateway/routing.py),
and the registry's pick weighing a hit against load (shared/runtime/registry.py)."""
from __future__ import annotations

import pytest

from schemas import WorkerInfo
from services.gateway.routing import PrefixRoutes
from shared.runtime.registry import WorkerRegistry

PAGE = 4


def test_routes_find_each_workers_longest_cached_prefix():
    """Two workers holding different continuations of one prefix: each is credited with its own run of whole pages,
    a prompt that diverges in page 0 hits nowhere, and nothing is known before a first record."""
    routes = PrefixRoutes(slack=2)
    assert routes.cached_tokens(list(range(20))) == {}
    routes.record("a", list(range(13)), PAGE)  # 3 full pages
    routes.record("b", list(range(8)) + [99] * 8, PAGE)  # shares 2 pages with a
    assert routes.cached_tokens(list(range(20))) == {"a": 12, "b": 8}
    assert routes.cached_tokens(list(range(8)) + [99] * 5) == {"a": 8, "b": 12}
    assert routes.cached_tokens([7] + list(range(1, 20))) == {}


def test_routes_are_bounded_least_recent_first():
    """Past max_pages keys, the least recently recorded go first."""
    routes = PrefixRoutes(slack=0, max_pages=2)
    routes.record("a", list(range(8)), PAGE)
    routes.record("b", [9] * 8, PAGE)
    assert routes.cached_tokens(list(range(8))) == {} and routes.cached_tokens([9] * 8) == {"b": 8}
    with pytest.raises(ValueError):
        PrefixRoutes(slack=-1)


def registry(loads: dict[str, int]) -> WorkerRegistry:
    reg = WorkerRegistry(ttl_s=60)
    for worker_id, active in loads.items():
        reg.update(WorkerInfo("decode", worker_id, 1, "h", "", "v", active_requests=active))
    return reg


def test_pick_prefers_the_longest_hit_within_the_slack():
    """The worker with the longest hit wins while it runs at most `slack` more requests than the least loaded; past
    that, or with no hit, the least loaded does; equal hits go to the less loaded."""
    assert registry({"a": 0, "b": 3}).pick("decode", cached={"b": 32}, slack=4).worker_id == "b"
    assert registry({"a": 0, "b": 5}).pick("decode", cached={"b": 32}, slack=4).worker_id == "a"
    assert registry({"a": 2, "b": 1}).pick("decode", cached={}, slack=4).worker_id == "b"
    assert registry({"a": 2, "b": 1}).pick("decode", cached={"a": 16, "b": 32}, slack=4).worker_id == "b"
    assert registry({"a": 2, "b": 1}).pick("decode", cached={"a": 16, "b": 16}, slack=4).worker_id == "b"
    assert registry({"a": 2, "b": 1}).pick("decode", cached={"a": 32, "b": 16}, slack=4).worker_id == "a"
