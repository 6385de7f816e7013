"""A request's pushes land in the order they were sent, even when two TCP links join the same two planes (both
ends dialled at once): the decode side counts a layer as landed by the bytes before it (PrefillDone.
layer_push_bytes), so a later layer's bytes must never overtake an earlier layer's."""
from __future__ import annotations

import asyncio

from shared.dataplane import Grant, Lane, Segment, make_dataplane

SIZE = 4 << 20


async def test_a_second_link_between_two_planes_does_not_reorder_a_tickets_pushes():
    a, b = make_dataplane("tcp", link_gbps=0.02), make_dataplane("tcp", link_gbps=0.02)  # 512 KiB: ~0.2 s
    for plane in (a, b):
        plane.register_region(memoryview(bytearray(SIZE)))
        await plane.start()
    try:
        landed: list[int] = []
        b.grant(Grant(1, [(0, SIZE)], on_landed=landed.append))
        layer_0 = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, 512 << 10)], Lane.PUSH))
        await asyncio.sleep(0.02)  # layer 0 is on its way over a's link
        first = a.links[b.address]
        b.links.clear()  # b dials a too, as when both ends dial at once: a accepts a second link from b
        await b._link(a.address)
        for _ in range(100):
            if len(a.open_links) == 2:
                break
            await asyncio.sleep(0.01)
        assert len(a.open_links) == 2
        assert a.links[b.address] is first  # new transfers stay on the first link while it is up
        layer_1 = asyncio.create_task(a.push(b.address, 1, [Segment(0, 600 << 10, 3000)], Lane.PUSH))
        await asyncio.wait_for(asyncio.gather(layer_0, layer_1), 10)
        # (landed per frame) layer 1's 3,000 bytes came last: they did not overtake layer 0's 512 KiB
        assert landed.index(3000) == len(landed) - 1 and sum(landed[:-1]) == 512 << 10
    finally:
        await a.close()
        await b.close()
