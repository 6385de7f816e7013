"""The RDMA transport on a real verbs device (Soft-RoCE in the test guest: `make test-rdma`).
Skipped where no RDMA device exists, which is every machine of this project but the guest."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from shared.dataplane.base import DataPlaneError, Gather, Grant, Lane, Segment
from shared.dataplane.rdma import rdma_devices
from tests.segments import push_and_read_exactly

pytestmark = pytest.mark.skipif(not rdma_devices(), reason="no RDMA device (run `make test-rdma` for the Soft-RoCE guest)")
SIZE = 8 << 20


async def make_pair(**kwargs):
    from shared.dataplane.rdma import RdmaDataPlane

    planes: dict[str, RdmaDataPlane] = {}

    async def rendezvous(peer: str, offer: dict) -> dict:  # what NATS does between services
        return await planes[peer].accept(offer)

    regions = []
    for name in ("a", "b"):
        plane = RdmaDataPlane(f"rdma:{name}", rendezvous, **kwargs)
        region = bytearray(SIZE)
        regions.append(region)
        plane.register_region(memoryview(region))
        await plane.start()
        planes[plane.address] = plane
    return planes["rdma:a"], planes["rdma:b"], regions[0], regions[1]


@pytest.fixture
async def rdma_pair():
    a, b, ra, rb = await make_pair()
    yield a, b, ra, rb
    await a.close()
    await b.close()


@pytest.mark.parametrize("seed", range(3))
async def test_push_and_read_move_exact_bytes(rdma_pair, seed):
    """Random data and random scatter-gather lists arrive exactly, by RDMA WRITE and RDMA READ."""
    a, b, ra, rb = rdma_pair
    landed = []
    b.grant(Grant(0xABCDEF0123, [(0, SIZE)], landed.append))
    pushed = await push_and_read_exactly(a, b, ra, rb, random.Random(seed), 0xABCDEF0123, 20,
                                         Lane.BACKGROUND if seed % 2 else Lane.ON_DEMAND, read_ticket=1)
    await asyncio.sleep(0.05)  # the receiver's notifications arrive on its own CQ
    assert sum(landed) == pushed


async def test_scattered_gather_uses_several_sges(rdma_pair):
    """A read of a remote-contiguous run into scattered local pieces (one WR, many SGEs) lands right."""
    a, b, ra, rb = rdma_pair
    rb[0:64 * 1024] = random.Random(5).randbytes(64 * 1024)
    segs = [Segment(i * 4096, (i * 3 + 1) * 8192, 4096) for i in range(16)]  # contiguous remotely
    await a.read(b.address, 1, segs)
    for s in segs:
        assert ra[s.dst: s.dst + s.length] == rb[s.src: s.src + s.length]


async def test_scattered_token_reads_fit_the_send_queue(rdma_pair):
    """Token-level selections read many small scattered entries: 4,096 entries of 128 bytes, none contiguous with
    the next on the remote side, are one work request each. They are posted a queue's worth at a time (posting
    past the send queue's depth failed the link) and all land exactly."""
    a, b, ra, rb = rdma_pair
    rb[:1 << 20] = random.Random(7).randbytes(1 << 20)
    segs = [Segment(i * 256, (1 << 20) + i * 128, 128) for i in range(4096)]  # every other 128 B remotely
    await a.read(b.address, 1, segs)
    for s in segs:
        assert ra[s.dst: s.dst + s.length] == rb[s.src: s.src + s.length]


async def test_read_outside_the_peer_region_fails_at_once(rdma_pair):
    """A range outside the peer's registered region is refused before posting; the link stays usable."""
    a, b, _, _ = rdma_pair
    with pytest.raises(DataPlaneError, match="outside"):
        await a.read(b.address, 1, [Segment(SIZE - 10, 0, 100)])
    with pytest.raises(DataPlaneError, match="outside the registered region"):
        await a.read(b.address, 1, [Segment(0, SIZE, 1)])
    await a.read(b.address, 1, [Segment(0, 0, 4096)])


async def test_bad_rkey_access_is_a_remote_access_error(rdma_pair):
    """The NIC itself refuses an access the MR does not allow: a clear error, and the next use reconnects."""
    a, b, _, _ = rdma_pair
    await a.read(b.address, 1, [Segment(0, 0, 16)])
    link = a.links[b.address]
    link.remote = {**link.remote, "rkey": link.remote["rkey"] ^ 0x5A5A}
    with pytest.raises(DataPlaneError, match="remote"):
        await asyncio.wait_for(a.read(b.address, 1, [Segment(0, 0, 4096)]), 30)
    await a.read(b.address, 1, [Segment(0, 0, 4096)])  # a fresh queue pair


async def test_unknown_ticket_is_counted_and_not_landed(rdma_pair):
    """A push under a ticket the receiver never granted is refused (counted, logged), never counted as landed."""
    a, b, _, _ = rdma_pair
    landed = []
    b.grant(Grant(7, [(0, SIZE)], landed.append))
    await a.push(b.address, 8, [Segment(0, 0, 4096)])
    await asyncio.sleep(0.1)
    assert b.num_refused == 1 and landed == []


async def test_peer_gone_fails_the_transfer(rdma_pair):
    """If the peer's queue pair disappears, a transfer fails with a DataPlaneError within the op timeout
    instead of hanging, and the next transfer reconnects."""
    a, b, _, _ = rdma_pair
    a.op_timeout_s = 2.0
    await a.read(b.address, 1, [Segment(0, 0, 16)])
    for link in list(b.links.values()):
        b.fail_link(link, DataPlaneError("closed for the test"))
    started = asyncio.get_running_loop().time()
    with pytest.raises(DataPlaneError):
        await asyncio.wait_for(a.read(b.address, 1, [Segment(0, 0, 1 << 20)]), 60)
    assert asyncio.get_running_loop().time() - started < 5
    assert b.address not in a.links
    await a.read(b.address, 1, [Segment(0, 0, 4096)])


async def test_on_demand_goes_before_queued_background(rdma_pair):
    """With background chunks queued, an on-demand read is posted ahead of them."""
    a, b, _, _ = rdma_pair
    b.grant(Grant(1, [(0, SIZE)]))
    a.grant(Grant(1, [(0, SIZE)]))
    background = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, SIZE)], Lane.BACKGROUND))
    await asyncio.sleep(0)
    await a.read(b.address, 1, [Segment(0, 0, 4096)])
    assert not background.done(), "the read should finish before 8 MiB of background writes"
    await asyncio.wait_for(background, 120)


async def test_cut_links_fails_what_is_in_flight_and_the_next_transfer_reconnects(rdma_pair):
    """cut_links (how decode stops reads from a prefill whose heartbeats stopped) fails the link's transfers at
    once, tells on_link_lost, and a later transfer to the same peer runs the rendezvous again and works."""
    a, b, ra, rb = rdma_pair
    b.grant(Grant(1, [(0, SIZE)]))
    await a.push(b.address, 1, [Segment(0, 0, 4096)])
    lost = []
    a.on_link_lost = lambda peer, error: lost.append(peer)
    a.set_link_gbps(0.01)  # slow enough that the push below is still in flight when the link is cut
    pending = asyncio.ensure_future(a.push(b.address, 1, [Segment(0, 0, 4 << 20)]))
    await asyncio.sleep(0.05)
    assert a.cut_links("cut by the test", peer=b.address) == 1
    with pytest.raises(DataPlaneError, match="cut by the test"):
        await asyncio.wait_for(pending, 2)
    assert lost == [b.address] and b.address not in a.links
    a.set_link_gbps(0)
    ra[:4096] = random.Random(5).randbytes(4096)
    await a.push(b.address, 1, [Segment(0, 0, 4096)])
    assert rb[:4096] == ra[:4096]


def random_gather(rng: np.random.Generator, count: int, unit: int) -> Gather:
    """As in tests/unit/test_dataplane.py: `count` entries of `unit` bytes, sources anywhere (repeats allowed),
    distinct destinations, both unsorted, a third of them continuing the run before them on both sides."""
    slots = SIZE // unit - 64
    dst = rng.choice(slots, count, replace=False)
    src = rng.integers(0, slots, count)
    src[1::3] = src[0:-1:3][: src[1::3].size] + 1
    dst[1::3] = dst[0:-1:3][: dst[1::3].size] + 1
    _, first = np.unique(dst, return_index=True)
    keep = np.sort(first)
    return Gather(64, 32, unit, src[keep], dst[keep])


@pytest.mark.parametrize("count, unit", [(1, 128), (700, 128), (5000, 128), (3000, 24)])
async def test_gather_read_is_exact(rdma_pair, count, unit):
    """The on-demand reads of token-level selectors (`read_gather`, one Gather of thousands of single-token
    entries) over RDMA: every entry lands where its index says and not one byte elsewhere (5,000 × 128 B is
    thousands of READ work requests, posted a queue's worth at a time); both planes stay usable."""
    a, b, ra, rb = rdma_pair
    rng = np.random.default_rng(count)
    ra[:] = rng.bytes(SIZE)
    rb[:] = rng.bytes(SIZE)
    b.grant(Grant(1, [(0, SIZE)]))
    gather = random_gather(rng, count, unit)
    expected = np.frombuffer(ra, np.uint8).copy()
    src = np.frombuffer(rb, np.uint8)
    for i, j in zip(gather.src_index.tolist(), gather.dst_index.tolist()):
        expected[32 + j * unit: 32 + (j + 1) * unit] = src[64 + i * unit: 64 + (i + 1) * unit]
    await a.read_gather(b.address, 1, gather, Lane.ON_DEMAND)
    assert ra == expected.tobytes()
    await a.read(b.address, 1, [Segment(0, 0, 4096)])


async def test_gather_outside_either_region_fails_before_anything_lands(rdma_pair):
    """A gather whose destination leaves the local region, or whose source leaves the peer's, fails at once
    with nothing written; an empty gather is a no-op; the link stays usable."""
    a, b, ra, rb = rdma_pair
    rb[:4096] = b"z" * 4096
    inside = np.array([0, 1, 7, 8, 31])
    with pytest.raises(DataPlaneError, match="outside the registered region"):
        await a.read_gather(b.address, 1, Gather(0, SIZE - 128, 128, inside[:2], np.arange(2)))
    with pytest.raises(DataPlaneError, match="outside"):
        await a.read_gather(b.address, 1, Gather(SIZE - 256, 0, 128, inside, np.arange(5)))
    await a.read_gather(b.address, 1, Gather(0, 0, 128, inside[:0], np.arange(0)))
    assert bytes(ra[:4096]).count(b"z") == 0
    await a.read_gather(b.address, 1, Gather(0, 0, 128, inside, np.arange(5)))
    assert ra[: 5 * 128] == b"z" * 640
