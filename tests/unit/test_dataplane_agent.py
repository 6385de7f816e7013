"""The transfer agent (shared/dataplane/agent.py): what it adds to the data-plane contract, which
test_dataplane.py checks for it as for TCP (cancellation, faults and cuts included): either side's death reaches
the other at once, and the region must lie in the shared arena."""
from __future__ import annotations

import asyncio

import pytest

from shared.dataplane import DataPlaneError, Grant, Segment
from shared.dataplane.agent import AgentDataPlane
from shared.runtime.arena import SharedArena
from tests.unit.test_dataplane import SIZE, pair


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


def test_the_region_must_lie_in_the_shared_arena():
    arena = SharedArena(1 << 20)
    plane = AgentDataPlane(arena)
    with pytest.raises(ValueError, match="shared arena"):
        plane.register_region(memoryview(bytearray(1 << 10)))
    plane.register_region(arena.view[4096:8192])
    assert plane.region_offset == 4096
