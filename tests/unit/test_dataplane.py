"""The data-plane contract, for the TCP reference (real sockets) and the in-process fake alike."""
from __future__ import annotations

import asyncio
import pytest

from shared.dataplane import DataPlaneError, Grant, Segment, TicketRefused, make_dataplane, pair_segments
from shared.dataplane import frames

SIZE = 1 << 20


async def pair(kind: str):
    a, b = make_dataplane(kind), make_dataplane(kind)
    region_a, region_b = bytearray(SIZE), bytearray(SIZE)
    a.register_region(memoryview(region_a))
    b.register_region(memoryview(region_b))
    await a.start()
    await b.start()
    return a, b, region_a, region_b


@pytest.fixture(params=["tcp", "inproc"])
async def planes(request):
    a, b, ra, rb = await pair(request.param)
    yield a, b, ra, rb
    await a.close()
    await b.close()


async def test_push_lands_bytes_and_counts_them(planes):
    """A push copies each src range into the peer's dst range; the grant counts what landed."""
    a, b, ra, rb = planes
    ra[0:300_000] = bytes(range(256)) * 1171 + bytes(300_000 - 256 * 1171)
    landed = []
    b.grant(Grant(7, [(500_000, 900_000)], landed.append))
    await a.push(b.address, 7, [Segment(0, 500_000, 200_000), Segment(200_000, 800_000, 100_000)])
    assert rb[500_000:700_000] == ra[0:200_000] and rb[800_000:900_000] == ra[200_000:300_000]
    assert landed == [300_000] and b.grants[7].bytes_landed == 300_000


async def test_read_fetches_scattered_ranges(planes):
    """A read gathers the peer's ranges into local ones."""
    a, b, ra, rb = planes
    rb[1000:1100] = b"x" * 100
    rb[9000:9050] = b"y" * 50
    b.grant(Grant(9, [(0, 10_000)]))
    await a.read(b.address, 9, [Segment(1000, 0, 100), Segment(9000, 100, 50)])
    assert ra[0:150] == b"x" * 100 + b"y" * 50


@pytest.mark.parametrize("ticket, dst", [(8, 0), (7, 950_000)])
async def test_wrong_ticket_or_range_is_refused_and_writes_nothing(planes, ticket, dst):
    """Unknown ticket, or a range outside the grant: TicketRefused, the region is untouched, the link still works."""
    a, b, ra, rb = planes
    ra[0:1000] = b"z" * 1000
    b.grant(Grant(7, [(0, 900_000)]))
    with pytest.raises(TicketRefused):
        await a.push(b.address, ticket, [Segment(0, dst, 1000)])
    assert rb.count(b"z") == 0
    await a.push(b.address, 7, [Segment(0, 0, 1000)])  # the connection stays in step after a refusal
    assert rb[0:1000] == b"z" * 1000


async def test_revoked_ticket_is_refused(planes):
    """After revoke, the ticket opens nothing."""
    a, b, _, _ = planes
    b.grant(Grant(3, [(0, 100)]))
    assert b.revoke(3) is not None and b.revoke(3) is None
    with pytest.raises(TicketRefused):
        await a.push(b.address, 3, [Segment(0, 0, 100)])


async def test_tcp_peer_gone_fails_pending_transfer():
    """If the peer closes, a push fails with DataPlaneError rather than hanging."""
    a, b, _, _ = await pair("tcp")
    b.grant(Grant(1, [(0, SIZE)]))
    await a.push(b.address, 1, [Segment(0, 0, 10)])
    await b.close()
    with pytest.raises(DataPlaneError):
        await asyncio.wait_for(a.push(b.address, 1, [Segment(0, 0, SIZE)]), 5)
    await a.close()


async def test_tcp_garbage_frame_closes_only_that_connection():
    """A client sending junk is dropped; the server keeps serving others."""
    a, b, _, rb = await pair("tcp")
    host, port = b.address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\x00" * frames.HEADER.size)
    assert await asyncio.wait_for(reader.read(10), 5) == b""  # closed by the server
    writer.close()
    b.grant(Grant(1, [(0, 10)]))
    await a.push(b.address, 1, [Segment(0, 0, 10)])
    await a.close()
    await b.close()


def test_pair_segments_merges_runs_contiguous_on_both_sides():
    """Pages adjacent on both sides become one segment; a break on either side starts a new one."""
    segs = pair_segments([0, 1, 2, 5, 6], [10, 11, 20, 21, 22], 100)
    assert segs == [Segment(0, 1000, 200), Segment(200, 2000, 100), Segment(500, 2100, 200)]


def test_grant_covers_only_its_ranges():
    """covers() is true inside a granted range and false across its edge."""
    g = Grant(1, [(100, 200), (300, 400), (200, 250)])
    assert g.covers(100, 150) and g.covers(300, 100)
    assert not g.covers(90, 20) and not g.covers(240, 70) and not g.covers(350, 51)
