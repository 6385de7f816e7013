"""The gateway's admission queue (services/gateway/admission.py) on its own: who runs, who waits in what order,
and who is told to come back, with what status."""
from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission import Admission
from services.gateway.requests import ApiError
from shared.runtime.metrics import Registry


def admission(capacity: int, max_waiting: int = 4, queue_timeout_s: float = 5.0) -> tuple[Admission, dict]:
    box = {"capacity": capacity}
    return Admission(lambda: box["capacity"], max_waiting, queue_timeout_s, Registry()), box


async def hold(gate: Admission, order: list[str], name: str, release: asyncio.Event) -> float:
    async with gate.slot() as waited:
        order.append(name)
        await release.wait()
    return waited


async def test_beyond_capacity_requests_wait_and_start_in_arrival_order():
    gate, _ = admission(capacity=1)
    order: list[str] = []
    releases = {name: asyncio.Event() for name in "abc"}
    tasks = {}
    for name in "abc":
        tasks[name] = asyncio.create_task(hold(gate, order, name, releases[name]))
        await asyncio.sleep(0.01)
    assert order == ["a"] and gate.running == 1 and len(gate.waiting) == 2
    for name in "abc":
        releases[name].set()
        await asyncio.sleep(0.02)
    waited = {name: await task for name, task in tasks.items()}
    assert order == ["a", "b", "c"] and gate.running == 0 and not gate.waiting
    assert waited["a"] < 0.01 < waited["b"] < waited["c"]
    assert gate.queue_seconds.count == 3


async def test_a_full_queue_answers_429_at_once_and_a_long_wait_503():
    gate, _ = admission(capacity=1, max_waiting=1, queue_timeout_s=0.3)
    release = asyncio.Event()
    running = asyncio.create_task(hold(gate, [], "a", release))
    waiter = asyncio.create_task(hold(gate, [], "b", asyncio.Event()))
    await asyncio.sleep(0.01)
    with pytest.raises(ApiError) as full:
        async with gate.slot():
            pass
    assert full.value.status == 429 and full.value.retry_after_s == 1
    with pytest.raises(ApiError) as late:
        await waiter
    assert late.value.status == 503 and late.value.code == "queue_timeout" and late.value.retry_after_s >= 1
    assert not gate.waiting and gate.running == 1
    release.set()
    await running
    assert gate.running == 0


async def test_a_client_that_leaves_while_waiting_leaves_the_queue_and_a_new_worker_admits_waiters():
    gate, box = admission(capacity=1)
    release = asyncio.Event()
    running = asyncio.create_task(hold(gate, [], "a", release))
    leaver = asyncio.create_task(hold(gate, [], "b", asyncio.Event()))
    stayer_order: list[str] = []
    stayer_release = asyncio.Event()
    stayer = asyncio.create_task(hold(gate, stayer_order, "c", stayer_release))
    await asyncio.sleep(0.01)
    leaver.cancel()
    await asyncio.gather(leaver, return_exceptions=True)
    assert len(gate.waiting) == 1
    box["capacity"] = 2  # a decode worker joined: the waiter starts without anyone finishing
    await asyncio.sleep(0.7)
    assert stayer_order == ["c"] and gate.running == 2
    release.set()
    stayer_release.set()
    await asyncio.gather(running, stayer)
    assert gate.running == 0 and not gate.waiting


async def test_without_decode_workers_nothing_waits_here():
    """Capacity 0 (none registered): the request goes on, to get the 503 naming the missing role."""
    gate, _ = admission(capacity=0, max_waiting=0)
    async with gate.slot() as waited:
        assert waited < 0.01 and gate.running == 1
    assert gate.running == 0


def test_capacity_is_what_both_sides_take():
    """Σ decode max_requests, but no more than Σ prefill max_requests (a disaggregated request holds a slot on
    each side); max_running overrides; without a prefill worker, decode alone."""
    from types import SimpleNamespace

    from services.gateway.service import GatewayService

    def capacity(decode: list[int], prefill: list[int], max_running: int = 0) -> int:
        workers = {"decode": [SimpleNamespace(max_requests=n) for n in decode],
                   "prefill": [SimpleNamespace(max_requests=n) for n in prefill]}
        gateway = SimpleNamespace(config=SimpleNamespace(max_running=max_running),
                                  registry=SimpleNamespace(alive=lambda role: workers[role]))
        return GatewayService.capacity(gateway)

    assert capacity([8, 8], [8]) == 8 and capacity([8], [8, 8]) == 8 and capacity([4, 4], [16]) == 8
    assert capacity([8, 8], []) == 16 and capacity([8, 8], [8], max_running=3) == 3
