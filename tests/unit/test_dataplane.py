"""The data-plane contract, for the TCP reference (real sockets) and the in-process fake alike, plus the
TCP transport's lanes, pacing, checksums and failure behaviour."""
from __future__ import annotations

import asyncio
import random
import time

import pytest

from shared.dataplane import (ChecksumMismatch, DataPlaneError, Grant, Lane, Segment, TicketRefused,
                              make_dataplane)
from shared.dataplane import frames
from shared.dataplane.agent import AgentDataPlane
from shared.runtime.arena import SharedArena
from shared.dataplane.base import split_into_chunks
from tests.segments import push_and_read_exactly

pytestmark = pytest.mark.timing  # wall-clock bounds: `make test` runs these alone (pyproject.toml, markers)

SIZE = 4 << 20


async def pair(kind: str, size: int = SIZE, **kwargs):
    """Two started planes of one kind and their regions ("agent": TCP run by transfer agents over shared memory)."""
    if kind == "agent":
        arenas = SharedArena(size), SharedArena(size)
        a, b = (AgentDataPlane(arena, **kwargs) for arena in arenas)
        region_a, region_b = (arena.view for arena in arenas)
    else:
        a, b = make_dataplane(kind, **kwargs), make_dataplane(kind, **kwargs)
        region_a, region_b = bytearray(size), bytearray(size)
    a.register_region(memoryview(region_a))
    b.register_region(memoryview(region_b))
    await a.start()
    await b.start()
    return a, b, region_a, region_b


@pytest.fixture(params=["tcp", "inproc", "agent"])
async def planes(request):
    a, b, ra, rb = await pair(request.param)
    yield a, b, ra, rb
    await a.close()
    await b.close()


@pytest.mark.parametrize("seed", range(4))
async def test_random_scatter_gather_push_and_read_are_exact(planes, seed):
    """Random data, random scatter-gather lists (1 byte to >1 chunk, overlapping sources): every byte lands."""
    a, b, ra, rb = planes
    b.grant(Grant(1, [(0, SIZE)]))
    await push_and_read_exactly(a, b, ra, rb, random.Random(seed), 1, 12,
                                Lane.BACKGROUND if seed % 2 else Lane.ON_DEMAND, read_ticket=1)


async def test_background_reads_keep_flowing_and_leave_the_grant_idle(planes):
    """Reads answered on the background lane (speculative transfer) all complete, many chunks of them, and
    the owner's grant is idle afterwards (a reply that never left would block freeing the pages)."""
    a, b, ra, rb = planes
    rb[:] = random.Random(2).randbytes(SIZE)
    grant = Grant(1, [(0, SIZE)])
    b.grant(grant)
    for i in range(12):  # > the TCP background window, several times
        await a.read(b.address, 1, [Segment(i * 256 << 10, i * 256 << 10, 256 << 10)], Lane.BACKGROUND)
    assert ra[: 12 * 256 << 10] == rb[: 12 * 256 << 10]
    await asyncio.wait_for(grant.wait_idle(), 2)


async def test_push_lands_bytes_and_counts_them(planes):
    """The grant counts what landed and calls on_landed with each completed piece."""
    a, b, ra, rb = planes
    ra[0:300_000] = random.Random(1).randbytes(300_000)
    landed = []
    b.grant(Grant(7, [(500_000, 900_000)], landed.append))
    await a.push(b.address, 7, [Segment(0, 500_000, 200_000), Segment(200_000, 800_000, 100_000)])
    assert rb[500_000:700_000] == ra[0:200_000] and rb[800_000:900_000] == ra[200_000:300_000]
    assert sum(landed) == 300_000 and b.grants[7].bytes_landed == 300_000


@pytest.mark.parametrize("ticket, dst", [(8, 0), (7, 950_000)])
async def test_wrong_ticket_or_range_is_refused_and_writes_nothing(planes, ticket, dst):
    """Unknown ticket, or a range outside the grant: TicketRefused, the region is untouched, the link still works."""
    a, b, ra, rb = planes
    ra[0:1000] = b"z" * 1000
    b.grant(Grant(7, [(0, 900_000)]))
    with pytest.raises(TicketRefused):
        await a.push(b.address, ticket, [Segment(0, dst, 1000)])
    with pytest.raises(TicketRefused):
        await a.read(b.address, ticket, [Segment(dst, 0, 1000)])
    assert bytes(rb).count(b"z") == 0
    await a.push(b.address, 7, [Segment(0, 0, 1000)])  # the connection stays in step after a refusal
    assert rb[0:1000] == b"z" * 1000


async def test_revoked_ticket_is_refused(planes):
    """After revoke, the ticket opens nothing."""
    a, b, _, _ = planes
    b.grant(Grant(3, [(0, 100)]))
    assert b.revoke(3) is not None and b.revoke(3) is None
    with pytest.raises(TicketRefused):
        await a.push(b.address, 3, [Segment(0, 0, 100)])


async def test_local_ranges_outside_the_region_fail_at_once(planes):
    """A push from, or a read into, bytes outside the local region is refused before anything is sent."""
    a, b, _, _ = planes
    b.grant(Grant(1, [(0, SIZE)]))
    with pytest.raises(DataPlaneError, match="outside the registered region"):
        await a.push(b.address, 1, [Segment(SIZE - 10, 0, 20)])
    with pytest.raises(DataPlaneError, match="outside the registered region"):
        await a.read(b.address, 1, [Segment(0, SIZE, 1)])
    with pytest.raises(ValueError):
        b.grant(Grant(2, [(SIZE - 5, SIZE + 5)]))


async def test_grant_is_idle_after_transfers(planes):
    """No transfer leaves a grant marked busy (so pages can be reused after revoke)."""
    a, b, _, _ = planes
    b.grant(Grant(1, [(0, SIZE)]))
    await asyncio.gather(a.push(b.address, 1, [Segment(0, 0, SIZE // 2)]), a.read(b.address, 1, [Segment(0, 0, SIZE)]))
    grant = b.revoke(1)
    await asyncio.wait_for(grant.wait_idle(), 1)
    assert grant.num_busy == 0


async def test_revoke_answers_queued_replies_at_once():
    """A read reply queued behind a slow push (a background reply waits behind every push on its link) does not
    hold the owner's pages after `revoke`: it is answered REFUSED at once, and the grant is idle right away,
    not when the push ahead of it has left (found by chaos run 7: pages held past the release timeout)."""
    a, b, _, _ = await pair("tcp", link_gbps=0.02)  # 4 MiB take ~1.7 s
    try:
        a.grant(Grant(2, [(0, SIZE)]))
        grant = Grant(1, [(0, SIZE)])
        b.grant(grant)
        push = asyncio.create_task(b.push(a.address, 2, [Segment(0, 0, SIZE)], Lane.PUSH))
        await asyncio.sleep(0.1)  # the push's chunks are queued on b's link to a
        read = asyncio.create_task(a.read(b.address, 1, [Segment(0, 0, 4096)], Lane.BACKGROUND))
        while not grant.num_busy:  # the reply is queued on b, behind the push
            await asyncio.sleep(0.005)
        started = time.monotonic()
        await b.retire(1, timeout_s=5)
        assert time.monotonic() - started < 0.5
        with pytest.raises(TicketRefused):
            await read
        assert not push.done()  # the push went on; only the revoked ticket's reply was dropped
        push.cancel()
    finally:
        await a.close()
        await b.close()


async def test_retire_cuts_a_link_whose_frame_hangs_on_the_pages():
    """A reply in progress that does not finish (here the serving side stalls every frame for 30 s) does not hold
    the pages for ever: past the timeout its link is cut, the reader is told, and the pages are free."""
    a, b, _, _ = await pair("tcp")
    try:
        grant = Grant(1, [(0, SIZE)])
        b.grant(grant)
        await a.read(b.address, 1, [Segment(0, 0, 4096)])  # the link is up
        b.faults.delay_s = 30
        read = asyncio.create_task(a.read(b.address, 1, [Segment(0, 0, 4096)]))
        while not grant.num_busy:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # the writer has taken the reply and is stalled on it
        started = time.monotonic()
        await b.retire(1, timeout_s=0.2)
        assert time.monotonic() - started < 1 and grant.num_busy == 0
        with pytest.raises(DataPlaneError, match="lost"):  # the reader sees its peer hang up
            await asyncio.wait_for(read, 2)
        b.faults.delay_s = 0
        b.grant(Grant(3, [(0, SIZE)]))
        await a.read(b.address, 3, [Segment(0, 0, 4096)])  # later transfers dial again
    finally:
        await a.close()
        await b.close()


async def test_corrupted_chunk_is_an_error_on_the_waiting_side():
    """A chunk whose bytes do not match its crc32c fails the push (and a read) with ChecksumMismatch, and is
    not counted as landed."""
    a, b, ra, rb = await pair("tcp")
    try:
        ra[:] = random.Random(2).randbytes(SIZE)
        b.grant(Grant(1, [(0, SIZE)]))
        a.faults.corrupt_frames = 1
        with pytest.raises(ChecksumMismatch):
            await a.push(b.address, 1, [Segment(0, 0, 1 << 20)])
        assert b.grants[1].bytes_landed == (1 << 20) - frames.CHUNK_BYTES  # the 3 good chunks only
        assert b.stats()["checksum_failures"] == 1  # counted where it was detected (smartgen_dataplane_checksum_failures)
        b.faults.corrupt_frames = 1  # now the serving side corrupts a read reply
        with pytest.raises(ChecksumMismatch):
            await a.read(b.address, 1, [Segment(0, 0, 1000)])
        assert a.stats()["checksum_failures"] == 1
        await a.push(b.address, 1, [Segment(0, 0, 1000)])  # the link is still good
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("kind", ["tcp", "agent"])
async def test_fault_switches_cut_refuse_and_delay(kind):
    """The test-only fault hooks: cut_links fails the transfer in flight at once and tells both ends'
    on_link_lost which peer was lost (the next transfer dials again); refuse_tickets refuses a valid ticket;
    delay_s holds every data frame. A transfer agent gets the switches with `apply_faults`, as a worker sends them."""
    a, b, _, _ = await pair(kind, link_gbps=0.01)  # 1.25 MB/s: a 4 MiB push takes ~3.4 s
    lost_a, lost_b = [], []
    a.on_link_lost, b.on_link_lost = (lambda peer, _: lost_a.append(peer)), (lambda peer, _: lost_b.append(peer))
    try:
        b.grant(Grant(1, [(0, SIZE)]))
        push = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, SIZE)]))
        await asyncio.sleep(0.6)  # (a transfer agent reports its links, which cut_links counts, every 0.5 s)
        started = time.monotonic()
        assert a.cut_links() == 1
        with pytest.raises(DataPlaneError, match="cut by fault injection"):
            await push
        assert time.monotonic() - started < 1.0  # not the ~3 s the push had left
        for _ in range(200):  # the peer notices when its read of the socket fails
            if lost_b:
                break
            await asyncio.sleep(0.01)
        assert lost_a == [b.address] and lost_b == [a.address]
        a.set_link_gbps(0)
        await a.push(b.address, 1, [Segment(0, 0, 1000)])  # a fresh link
        b.faults.refuse_tickets = True
        b.apply_faults()
        with pytest.raises(TicketRefused):
            await a.push(b.address, 1, [Segment(0, 0, 1000)])
        b.faults.refuse_tickets = False
        b.apply_faults()
        a.faults.delay_s = 0.2
        a.apply_faults()
        started = time.monotonic()
        await a.push(b.address, 1, [Segment(0, 0, 1000)])
        assert time.monotonic() - started >= 0.2
    finally:
        await a.close()
        await b.close()


async def test_peer_that_disappears_mid_transfer_fails_the_waiter_at_once():
    """Closing the receiving process during a slow (paced) push fails it immediately, not at a timeout."""
    a, b, _, _ = await pair("tcp", link_gbps=0.05)  # 6.25 MB/s: a 4 MiB push takes ~0.7 s
    b.grant(Grant(1, [(0, SIZE)]))
    push = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, SIZE)]))
    await asyncio.sleep(0.15)
    started = time.monotonic()
    await b.close()
    with pytest.raises(DataPlaneError):
        await asyncio.wait_for(push, 5)
    assert time.monotonic() - started < 0.5
    assert not a.stats()["links"]  # the broken link is gone; nothing waits on it
    await a.close()


async def test_garbage_frame_closes_only_that_connection():
    """A client sending junk is dropped; the server keeps serving others."""
    a, b, _, _ = await pair("tcp")
    host, port = b.address.split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\x00" * frames.HEADER.size)
    challenge = await asyncio.wait_for(reader.read(), 5)  # the handshake's challenge, then closed by the server
    assert frames.Header.unpack(challenge[:frames.HEADER.size]).op == frames.OP_CHALLENGE
    writer.close()
    b.grant(Grant(1, [(0, 10)]))
    await a.push(b.address, 1, [Segment(0, 0, 10)])
    await a.close()
    await b.close()


@pytest.mark.parametrize("kind", ["tcp", "agent"])
async def test_cancelled_push_leaves_the_link_at_once(kind):
    """A push whose caller is cancelled (the request was aborted) sends none of its queued chunks: the next
    push does not wait behind them, and the peer receives only what was in flight. With a transfer agent the
    cancellation reaches the agent before the cancelled call returns (the pages may be reused right after)."""
    a, b, _, _ = await pair(kind, link_gbps=0.05)  # 6.25 MB/s: the 4 MiB push would take ~0.7 s
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


async def test_cut_links_to_one_peer_leaves_the_others():
    """cut_links(peer=…): transfers to that peer fail at once; links to other peers carry on."""
    a, b, _, _ = await pair("tcp", link_gbps=0.02)
    c = make_dataplane("tcp", link_gbps=0.02)
    c.register_region(memoryview(bytearray(SIZE)))
    await c.start()
    try:
        b.grant(Grant(1, [(0, SIZE)]))
        c.grant(Grant(1, [(0, SIZE)]))
        to_b = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, 1 << 20)]))
        to_c = asyncio.create_task(a.push(c.address, 1, [Segment(0, 0, 64 << 10)]))
        await asyncio.sleep(0.05)
        assert a.cut_links("cut: peer gone", peer=b.address) == 1
        with pytest.raises(DataPlaneError, match="peer gone"):
            await asyncio.wait_for(to_b, 1)
        await asyncio.wait_for(to_c, 5)
    finally:
        await a.close()
        await b.close()
        await c.close()


def test_split_into_chunks_respects_the_chunk_size():
    """Chunks carry at most CHUNK_BYTES and together cover exactly the original ranges, in order."""
    segs = [Segment(0, 100, 10), Segment(1000, 5000, 600_000), Segment(10, 0, 3)]
    chunks = split_into_chunks(segs, 256 << 10)
    assert all(sum(s.length for s in c) <= 256 << 10 for c in chunks)
    flat = [s for c in chunks for s in c]
    assert sum(s.length for s in flat) == 600_013
    assert flat[0] == Segment(0, 100, 10) and flat[-1] == Segment(10, 0, 3)


def test_grant_covers_only_its_ranges():
    """covers() is true inside a granted range and false across its edge."""
    g = Grant(1, [(100, 200), (300, 400), (200, 250)])
    assert g.covers(100, 150) and g.covers(300, 100)
    assert not g.covers(90, 20) and not g.covers(240, 70) and not g.covers(350, 51)


def test_rdma_work_requests_group_remote_runs():
    """RDMA work requests: pieces contiguous on the remote side share one WR (several SGEs); a gap starts a new one."""
    from shared.dataplane.rdma import MAX_SGE, work_requests

    segs = [Segment(100, 0, 10), Segment(500, 10, 20), Segment(0, 40, 5)]
    assert work_requests(segs, "dst") == [segs[:2], segs[2:]]
    assert work_requests(segs, "src") == [[s] for s in segs]
    many = [Segment(i * 8192, i * 4096, 4096) for i in range(MAX_SGE + 3)]
    assert [len(g) for g in work_requests(many, "dst")] == [MAX_SGE, 3]


def test_rdma_without_a_device_says_how_to_fix_it():
    """Asking for RDMA where there is none (these machines) is a clear error naming the alternatives."""
    from shared.dataplane.rdma import RdmaDataPlane, RdmaUnavailable, rdma_devices

    if rdma_devices():
        pytest.skip("this machine has an RDMA device")
    with pytest.raises(RdmaUnavailable, match="tcp"):
        RdmaDataPlane("rdma:x", rendezvous=None)


def test_rdma_never_posts_more_work_requests_than_its_send_queue_holds():
    """RDMA: scattered token reads make one work request per run. A link holds a chunk back while the posted WRs
    plus its own would pass the send queue's depth (posting beyond it fails the link), as it does for bytes; the
    first chunk always goes."""
    from collections import deque

    from shared.dataplane import rdma

    link = object.__new__(rdma._Link)
    link.plane = type("Plane", (), {"is_background_paused": False})()
    link.queues = {lane: deque() for lane in Lane}
    link.posted_bytes, link.posted_wrs = 0, 0
    link.has_work = asyncio.Event()
    link.queues[Lane.ON_DEMAND].append(rdma._Chunk(wrs=[None] * rdma.MAX_CHUNK_WRS, num_bytes=rdma.MAX_CHUNK_WRS * 128))
    assert link._next_lane() == Lane.ON_DEMAND
    link.posted_bytes, link.posted_wrs = 4096, rdma.SEND_QUEUE_DEPTH - rdma.MAX_CHUNK_WRS + 1  # few bytes, many WRs
    assert link._next_lane() is None
    link.completed(128)
    assert link.posted_wrs == rdma.SEND_QUEUE_DEPTH - rdma.MAX_CHUNK_WRS and link._next_lane() == Lane.ON_DEMAND
