"""The transfer agent (shared/dataplane/agent.py): what it adds to the data-plane contract, which
test_dataplane.py checks for it as for TCP: cancellation reaches the agent, either side's death reaches the
other at once, faults and cuts are passed on, and the region must lie in the shared arena."""
from __future__ import annotations

import asyncio
import time

import pytest

from shared.dataplane import DataPlaneError, Grant, Segment
from shared.dataplane.agent import AgentDataPlane, SharedArena
from tests.unit.test_dataplane import SIZE, pair


async def test_a_cancelled_push_stops_in_the_agent():
    """Cancelling a push in the worker cancels it in the agent, before the call returns: the chunks it had
    queued are not sent (the request's pages may be reused right after)."""
    a, b, _, _ = await pair("agent", link_gbps=0.05)  # 6.25 MB/s: the 4 MiB push would take ~0.7 s
    try:
        grant = Grant(1, [(0, SIZE)])
        b.grant(grant)
        push = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, SIZE)]))
        await asyncio.sleep(0.1)
        push.cancel()
        with pytest.raises(asyncio.CancelledError):
            await push
        started = time.monotonic()
        await a.push(b.address, 1, [Segment(0, 0, 1000)])
        assert time.monotonic() - started < 0.2  # not behind the ~0.6 s of abandoned chunks
        await asyncio.sleep(0.3)
        assert grant.bytes_landed < SIZE / 2
    finally:
        await a.close()
        await b.close()


async def test_an_agent_that_dies_fails_every_call_at_once():
    """Its worker hears it too (on_agent_lost: a worker then stops, to be restarted with a new agent)."""
    a, b, _, _ = await pair("agent", link_gbps=0.05)
    lost = []
    a.on_agent_lost = lost.append
    try:
        b.grant(Grant(1, [(0, SIZE)]))
        push = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, SIZE)]))
        await asyncio.sleep(0.1)
        a._proc.kill()
        with pytest.raises(DataPlaneError, match="agent exited"):
            await asyncio.wait_for(push, 2)
        with pytest.raises(DataPlaneError, match="agent exited"):
            await a.read(b.address, 1, [Segment(0, 0, 10)])
        assert len(lost) == 1 and "agent exited" in str(lost[0])
    finally:
        await a.close()
        await b.close()


async def test_the_agent_exits_when_its_worker_is_gone():
    """A worker killed with SIGKILL closes its end of the channel: the agent sees EOF and exits."""
    a, b, _, _ = await pair("agent")
    try:
        a._writer.transport.abort()  # what the kernel does to a killed worker's socket
        assert await asyncio.wait_for(a._proc.wait(), 5) == 0
    finally:
        await a.close()
        await b.close()


async def test_faults_and_cuts_reach_the_agent():
    """The fault switches a worker sets are passed on (apply_faults); cut_links fails the transfer in flight
    and both ends hear which peer was lost."""
    a, b, _, _ = await pair("agent", link_gbps=0.01)  # a 4 MiB push takes ~3.4 s
    lost_a, lost_b = [], []
    a.on_link_lost, b.on_link_lost = (lambda peer, _: lost_a.append(peer)), (lambda peer, _: lost_b.append(peer))
    try:
        b.grant(Grant(1, [(0, SIZE)]))
        push = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, SIZE)]))
        await asyncio.sleep(0.2)
        a.cut_links()
        with pytest.raises(DataPlaneError, match="cut by fault injection"):
            await asyncio.wait_for(push, 1)
        for _ in range(200):
            if lost_a and lost_b:
                break
            await asyncio.sleep(0.01)
        assert lost_a == [b.address] and lost_b == [a.address]
        a.set_link_gbps(0)
        a.faults.delay_s = 0.3
        a.apply_faults()
        started = time.monotonic()
        await a.push(b.address, 1, [Segment(0, 0, 1000)])
        assert time.monotonic() - started >= 0.3
    finally:
        await a.close()
        await b.close()


def test_the_region_must_lie_in_the_shared_arena():
    arena = SharedArena(1 << 20)
    plane = AgentDataPlane(arena)
    with pytest.raises(ValueError, match="shared arena"):
        plane.register_region(memoryview(bytearray(1 << 10)))
    plane.register_region(arena.view[4096:8192])
    assert plane.region_offset == 4096
