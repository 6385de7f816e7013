"""The gateway's admission queue (services/gateway/admission.py) on its own: who runs, who waits in what order,
and who is told to come back, with what status; with several clients, who gets a freed slot and how many running
slots and places in the queue one client may hold."""
from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission import HALF_THE_CAPACITY, HALF_THE_QUEUE, NO_CAP, Admission, client_of
from services.gateway.config import GatewayConfig
from services.gateway.requests import ApiError
from shared.runtime.config import ConfigError
from shared.runtime.metrics import Registry


def admission(capacity: int, max_waiting: int = 4, queue_timeout_s: float = 5.0,
              per_client: int = HALF_THE_CAPACITY, waiting_per_client: int = NO_CAP) -> tuple[Admission, dict]:
    """NOTE: no cap on one client's waiters unless a test asks (the gateway's default is HALF_THE_QUEUE)."""
    box = {"capacity": capacity}
    return Admission(lambda: box["capacity"], max_waiting, queue_timeout_s, Registry(), per_client,
                     waiting_per_client), box


async def hold(gate: Admission, order: list[str], name: str, release: asyncio.Event, client: str = "") -> float:
    async with gate.slot(client) as slot:
        order.append(name)
        await release.wait()
    return slot.waited_s


async def test_beyond_capacity_requests_wait_and_start_in_arrival_order():
    gate, _ = admission(capacity=1)
    order: list[str] = []
    releases = {name: asyncio.Event() for name in "abc"}
    tasks = {}
    for name in "abc":
        tasks[name] = asyncio.create_task(hold(gate, order, name, releases[name]))
        await asyncio.sleep(0.01)
    assert order == ["a"] and gate.running == 1 and gate.num_waiting == 2
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
    gate, box = admission(capacity=1, per_client=NO_CAP)
    release = asyncio.Event()
    running = asyncio.create_task(hold(gate, [], "a", release))
    leaver = asyncio.create_task(hold(gate, [], "b", asyncio.Event()))
    stayer_order: list[str] = []
    stayer_release = asyncio.Event()
    stayer = asyncio.create_task(hold(gate, stayer_order, "c", stayer_release))
    await asyncio.sleep(0.01)
    leaver.cancel()
    await asyncio.gather(leaver, return_exceptions=True)
    assert gate.num_waiting == 1
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
    async with gate.slot() as slot:
        assert slot.waited_s < 0.01 and gate.running == 1
    assert gate.running == 0


async def test_a_slot_released_early_admits_the_next_at_once_and_only_once():
    """A stream whose generation has ended gives its slot back while its text is still being written (api.py
    `_run`): the next request starts then, not when the slow reader has read; the block's end releases nothing more."""
    gate, _ = admission(capacity=1)
    order: list[str] = []
    release = asyncio.Event()
    async with gate.slot("a") as slot:
        waiting = asyncio.create_task(hold(gate, order, "b", release, "b"))
        await asyncio.sleep(0.05)
        assert order == [] and gate.running == 1
        slot.release()
        await asyncio.sleep(0.05)
        assert order == ["b"] and gate.running == 1  # b runs; a still writes
        slot.release()  # again: nothing
        assert gate.running == 1
    assert gate.running == 1 and gate.running_of("a") == 0  # a's block ended: b's slot untouched
    release.set()
    await waiting
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


def test_a_client_is_its_address_and_a_forwarded_one_only_when_trusted():
    """X-Forwarded-For counts only when the setting trusts it, and then its last entry (the proxy's own peer)."""
    assert client_of("10.0.0.5", "1.2.3.4", trust_forwarded_for=False) == "10.0.0.5"
    assert client_of("10.0.0.5", "6.6.6.6, 1.2.3.4", trust_forwarded_for=True) == "1.2.3.4"
    assert client_of("10.0.0.5", " ", trust_forwarded_for=True) == "10.0.0.5"
    assert client_of(None, None, trust_forwarded_for=False) == "unknown"


class Clients:
    """Requests held open by name (`a1` is client a's first) until released; `order` is the order they started."""

    def __init__(self, gate: Admission):
        self.gate, self.order, self.releases, self.tasks = gate, [], {}, {}

    async def send(self, *names: str) -> None:
        for name in names:
            self.releases[name] = asyncio.Event()
            self.tasks[name] = asyncio.create_task(hold(self.gate, self.order, name, self.releases[name], name[0]))
            await asyncio.sleep(0.01)

    async def finish(self, *names: str) -> None:
        for name in names:
            self.releases[name].set()
            await self.tasks[name]
        await asyncio.sleep(0.01)


async def test_one_client_runs_at_most_half_the_capacity_and_the_others_get_the_rest():
    """A client that sends more than its cap waits with slots free; another client starts at once beside it."""
    gate, _ = admission(capacity=8, max_waiting=16)
    clients = Clients(gate)
    await clients.send(*(f"a{i}" for i in range(6)))
    assert clients.order == ["a0", "a1", "a2", "a3"] and gate.num_waiting == 2 and gate.num_waiting_at_cap() == 2
    await clients.send("b0", "b1")
    assert clients.order[4:] == ["b0", "b1"] and gate.running == 6 and gate.running_of("b") == 2
    await clients.finish("a0")
    assert clients.order[6:] == ["a4"]  # its own slot back, to its longest waiter
    await clients.finish(*(f"a{i}" for i in range(1, 6)), "b0", "b1")
    assert gate.running == 0 and gate.num_waiting == 0 and not gate.running_by_client and not gate.waiting


async def test_a_freed_slot_goes_to_the_client_running_the_fewest_not_the_longest_waiter():
    """Clients take turns: a's many early waiters do not starve b and c, who came later."""
    gate, _ = admission(capacity=2, max_waiting=16, per_client=NO_CAP)
    clients = Clients(gate)
    await clients.send("a0", "a1", "a2", "a3", "a4", "b0", "b1", "c0")
    assert clients.order == ["a0", "a1"]
    await clients.finish("a0")  # running a1: b and c run nothing; b has waited longer
    assert clients.order[2:] == ["b0"]
    await clients.finish("a1")  # running b0: a and c run nothing; a's head (a2) has waited longest
    assert clients.order[3:] == ["a2"]
    await clients.finish("b0")  # running a2: c runs nothing, b runs nothing; b1 came before c0
    assert clients.order[4:] == ["b1"]
    await clients.finish("a2")  # running b1: a and c run nothing; a3 came before c0
    assert clients.order[5:] == ["a3"]
    await clients.finish("b1")  # running a3: c runs nothing
    assert clients.order[6:] == ["c0"]
    await clients.finish("a3", "c0", "a4")
    assert clients.order == ["a0", "a1", "b0", "a2", "b1", "a3", "c0", "a4"]
    assert gate.running == 0 and not gate.waiting and not gate.running_by_client


async def test_a_client_at_its_cap_waits_then_gets_a_503_that_says_so_while_others_still_start():
    """Over its cap a client waits, not refused at once; past queue_timeout_s the 503 names the per-client cap."""
    gate, _ = admission(capacity=4, max_waiting=4, queue_timeout_s=0.3, per_client=1)
    clients = Clients(gate)
    await clients.send("a0", "a1", "b0")
    assert clients.order == ["a0", "b0"] and gate.num_waiting == 1
    with pytest.raises(ApiError) as late:
        await clients.tasks["a1"]
    assert late.value.status == 503 and "max_running_per_client" in late.value.message
    assert gate.num_waiting == 0 and not gate.waiting
    await clients.finish("a0", "b0")
    assert gate.running == 0 and not gate.running_by_client


async def test_a_full_queue_is_a_429_for_a_request_that_would_wait_but_not_for_one_that_starts():
    """max_waiting counts every client's waiters; a request with a free slot under its cap starts all the same."""
    gate, _ = admission(capacity=2, max_waiting=2, per_client=1)
    clients = Clients(gate)
    await clients.send("a0", "a1", "a2")  # a0 runs, two wait at a's cap: the queue is full, a slot is free
    await clients.send("b0")
    assert clients.order == ["a0", "b0"] and gate.num_waiting == 2
    with pytest.raises(ApiError) as full:
        async with gate.slot("c"):
            pass
    assert full.value.status == 429 and full.value.code == "overloaded" and gate.num_waiting == 2
    await clients.finish("b0", "a0", "a1", "a2")
    assert gate.running == 0 and not gate.waiting


async def test_an_admitted_waiter_that_leaves_at_once_passes_its_slot_on():
    """The slot freed by a cancelled request (a client that left) goes to the next waiter; nothing is counted twice."""
    gate, _ = admission(capacity=1, max_waiting=4, per_client=NO_CAP)
    clients = Clients(gate)
    await clients.send("a0", "b0", "c0")
    clients.tasks["b0"].cancel()
    await asyncio.gather(clients.tasks["b0"], return_exceptions=True)
    await clients.finish("a0")
    assert clients.order == ["a0", "c0"] and gate.running == 1 and gate.running_of("c") == 1
    await clients.finish("c0")
    assert gate.running == 0 and not gate.waiting and not gate.running_by_client


def test_the_cap_follows_the_capacity():
    gate, box = admission(capacity=8)
    assert gate.client_cap(8) == 4 and gate.client_cap(1) == 1 and gate.client_cap(3) == 1
    assert gate.client_cap(0) == float("inf")  # no decode worker: nothing waits here
    assert admission(capacity=8, per_client=NO_CAP)[0].client_cap(8) == float("inf")
    assert admission(capacity=8, per_client=6)[0].client_cap(8) == 6


async def test_one_client_holds_at_most_half_the_queue_and_the_others_still_wait():
    """By default a client has at most half of max_waiting waiting; more get a 429 naming max_waiting_per_client,
    while another client still queues behind it, and only a queue full of every client's waiters is `overloaded`."""
    gate, _ = admission(capacity=1, max_waiting=4, per_client=NO_CAP, waiting_per_client=HALF_THE_QUEUE)
    clients = Clients(gate)
    await clients.send("a0", "a1", "a2")  # a0 runs; a1, a2 wait: a's half of the queue
    assert gate.client_waiting_cap == 2 and gate.most_waiting_of_one_client() == 2
    with pytest.raises(ApiError) as refused:
        async with gate.slot("a"):
            pass
    assert refused.value.status == 429 and refused.value.code == "client_queue_full"
    assert "max_waiting_per_client" in refused.value.message and refused.value.retry_after_s == 1
    await clients.send("b0", "b1")  # the queue still has room for another client
    assert gate.num_waiting == 4 and gate.running_of("b") == 0
    with pytest.raises(ApiError) as full:
        async with gate.slot("c"):
            pass
    assert full.value.status == 429 and full.value.code == "overloaded"
    await clients.finish("a0")  # a1 starts: a has a place in the queue again
    await clients.send("a3")
    assert not clients.tasks["a3"].done() and len(gate.waiting["a"]) == 2
    await clients.finish("a1", "a2", "b0", "b1", "a3")  # each slot to the longest waiter (both run none)
    assert clients.order == ["a0", "a1", "a2", "b0", "b1", "a3"]
    assert gate.running == 0 and not gate.waiting and not gate.running_by_client


async def test_without_a_cap_on_waiters_one_client_fills_the_queue_and_turns_the_others_away():
    """max_waiting_per_client 0: what the cap prevents, a client's flood leaves no place for another client."""
    gate, _ = admission(capacity=1, max_waiting=4, per_client=NO_CAP, waiting_per_client=NO_CAP)
    clients = Clients(gate)
    await clients.send("a0", "a1", "a2", "a3", "a4")
    assert gate.most_waiting_of_one_client() == 4
    with pytest.raises(ApiError) as full:
        async with gate.slot("b"):
            pass
    assert full.value.status == 429 and full.value.code == "overloaded"
    await clients.finish("a0", "a1", "a2", "a3", "a4")
    assert gate.running == 0 and not gate.waiting


def test_the_waiting_cap_is_half_the_queue_a_number_or_none():
    assert admission(capacity=1, max_waiting=64, waiting_per_client=HALF_THE_QUEUE)[0].client_waiting_cap == 32
    assert admission(capacity=1, max_waiting=1, waiting_per_client=HALF_THE_QUEUE)[0].client_waiting_cap == 1
    assert admission(capacity=1, max_waiting=64, waiting_per_client=5)[0].client_waiting_cap == 5
    assert admission(capacity=1, max_waiting=64, waiting_per_client=NO_CAP)[0].client_waiting_cap == float("inf")
    assert GatewayConfig().max_waiting_per_client == HALF_THE_QUEUE
    with pytest.raises(ConfigError, match="max_waiting_per_client"):
        GatewayConfig(max_waiting_per_client=-2).validate()
