"""The torch thread's own reads-only link (shared/dataplane/direct_reader.py) against a real TCP data plane: exact
gathers from a thread that is not the event loop's, a refusal that fails the read without breaking the link,
a link the peer never sends its own transfers on, one pacer for all links to a peer, and `close` waking a blocked
reader."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from shared.dataplane import DataPlaneError, Gather, Grant, Lane, Segment, TicketRefused
from shared.dataplane.direct_reader import DirectReader
from shared.dataplane.tcp import READS_ONLY
from tests.unit.test_dataplane import SIZE, pair
from tests.unit.test_dataplane_gather import random_gather


async def _reader(a, b, ra, **kwargs) -> DirectReader:
    sock = await a.dial_reads_only(b.address)
    return DirectReader(sock, memoryview(ra), b.address, **kwargs)


def _expected(ra, rb, gather: Gather) -> bytes:
    expected = np.frombuffer(bytes(ra), np.uint8).copy()
    src, unit = np.frombuffer(bytes(rb), np.uint8), gather.unit
    for i, j in zip(gather.src_index.tolist(), gather.dst_index.tolist()):
        at, to = gather.src_base + i * unit, gather.dst_base + j * unit
        expected[to: to + unit] = src[at: at + unit]
    return expected.tobytes()


async def test_gathers_from_another_thread_land_exactly_and_in_any_order_of_waiting():
    """Three gathers started at once (one of several frames) from a worker thread, waited for last-first: every
    entry lands where its index says, nothing else changes; the peer counts the link as reads-only."""
    a, b, ra, rb = await pair("tcp")
    try:
        rng = np.random.default_rng(3)
        ra[:] = rng.bytes(SIZE)
        rb[:] = rng.bytes(SIZE)
        b.grant(Grant(7, [(0, SIZE)]))
        reader = await _reader(a, b, ra)
        gathers = [random_gather(rng, count, 128) for count in (5000, 40, 700)]
        # distinct destinations across the three: shift each into its own quarter of the region
        gathers = [Gather(g.src_base, g.dst_base, g.unit, g.src_index, g.dst_index % 6000 + k * 7000)
                   for k, g in enumerate(gathers)]
        expected = bytes(ra)
        for g in gathers:
            expected = _expected(bytearray(expected), rb, g)

        def run() -> None:
            reads = [reader.start(7, g) for g in gathers]
            for read in reversed(reads):
                reader.wait(read)

        await asyncio.to_thread(run)
        assert bytes(ra) == expected
        assert reader.num_bytes == sum(g.num_bytes for g in gathers)
        assert not reader.is_broken
        assert any(link.peer == a.address + READS_ONLY for link in b.open_links)
        assert b.links.get(a.address) is None or b.links[a.address].peer == a.address  # never the push link
        reader.close()
    finally:
        await a.close()
        await b.close()


async def test_a_refused_read_fails_alone_and_the_link_goes_on():
    """Entries outside the grant: TicketRefused, not a byte lands; the next read on the same link works."""
    a, b, ra, rb = await pair("tcp")
    try:
        rb[:] = b"z" * SIZE
        b.grant(Grant(1, [(0, 4096)]))
        reader = await _reader(a, b, ra)
        outside = Gather(0, 0, 128, np.array([0, 1, 40]), np.arange(3))  # entry 40 → [5120, 5248): outside
        with pytest.raises(TicketRefused):
            await asyncio.to_thread(lambda: reader.wait(reader.start(1, outside)))
        assert bytes(ra[:3 * 128]) == bytes(3 * 128)
        await asyncio.to_thread(lambda: reader.wait(reader.start(1, Gather(0, 0, 128, np.array([0, 1]), np.arange(2)))))
        assert bytes(ra[:256]) == b"z" * 256
        assert not reader.is_broken
        reader.close()
    finally:
        await a.close()
        await b.close()


async def test_the_peer_never_pushes_on_a_reads_only_link():
    """The reader dials first, before any other link exists between the two: the peer's own push to us still
    opens (or takes) a link of its own, never the reader's, whose socket stays silent."""
    a, b, ra, rb = await pair("tcp")
    try:
        reader = await _reader(a, b, ra)
        a.grant(Grant(5, [(0, SIZE)]))
        rb[:16] = b"0123456789abcdef"
        await b.push(a.address, 5, [Segment(0, 100, 16)])
        assert bytes(ra[100:116]) == b"0123456789abcdef"
        assert b.links[a.address].peer == a.address
        reader.sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            reader.sock.recv(1)  # nothing was sent to it
        reader.close()
    finally:
        await a.close()
        await b.close()


async def test_one_pacer_paces_every_link_to_a_peer():
    """At 80 Mbit/s, 1 MB read over the reader and 1 MB read over the loop's link at once take ~0.2 s together,
    as on one NIC, not ~0.1 s as two separately paced links would; the sender measures 80 Mbit/s, not 40."""
    a, b, ra, rb = await pair("tcp", link_gbps=0.08)
    try:
        b.grant(Grant(1, [(0, SIZE)]))
        reader = await _reader(a, b, ra)
        unit, count = 1000, 1000  # 1 MB
        direct = Gather(0, 0, unit, np.arange(count), np.arange(count))
        started = time.perf_counter()
        await asyncio.gather(asyncio.to_thread(lambda: reader.wait(reader.start(1, direct))),
                             a.read(b.address, 1, [Segment(2 << 20, 2 << 20, count * unit)], Lane.ON_DEMAND))
        took = time.perf_counter() - started
        assert took >= 0.18, took
        assert b.pacer_for(a.address) is b.pacer_for(a.address + READS_ONLY)
        # … and the sender's measured rate is the link's, not half of it (both links' frames waited on one pacer)
        assert 0.06 <= b.send_rate_gbps() <= 0.1, b.send_rate_gbps()
        reader.close()
    finally:
        await a.close()
        await b.close()


async def test_close_wakes_a_reader_blocked_on_a_frozen_peer_and_breaks_it():
    """The peer accepts the read but never answers (its sending is frozen): `close` from the loop's thread wakes
    the blocked thread at once with DataPlaneError, and the reader refuses further reads."""
    a, b, ra, rb = await pair("tcp", link_gbps=1e-6)  # ~8 bytes/s: the reply would take hours
    try:
        b.grant(Grant(1, [(0, SIZE)]))
        reader = await _reader(a, b, ra)
        read = reader.start(1, Gather(0, 0, 4096, np.arange(4), np.arange(4)))
        waiting = asyncio.ensure_future(asyncio.to_thread(reader.wait, read))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        started = time.perf_counter()
        reader.close()
        with pytest.raises(DataPlaneError):
            await asyncio.wait_for(waiting, 5)
        assert time.perf_counter() - started < 2
        assert reader.is_broken and reader.sock.fileno() == -1
        with pytest.raises(DataPlaneError):
            reader.start(1, Gather(0, 0, 4096, np.arange(1), np.arange(1)))
    finally:
        await a.close()
        await b.close()


async def test_a_tls_plane_has_no_direct_reads():
    """Under TLS the reader cannot speak to the socket itself: dialing one says so (the loop's reads go on)."""
    a, b, ra, rb = await pair("tcp")
    try:
        a.tls = object()  # any TLS setting
        with pytest.raises(DataPlaneError, match="TLS"):
            await a.dial_reads_only(b.address)
    finally:
        a.tls = None
        await a.close()
        await b.close()


async def test_a_direct_read_does_not_wait_behind_whole_background_frames():
    """At 40 Mbit/s (5 MB/s) the loop's link carries a background read as whole 256 KiB frames (~52 ms each,
    `whole_frames`, as a request whose on-demand reads go direct asks for them), back to back; a 40 KB direct
    read asked meanwhile lands in about its own 8 ms, not behind the background frame reserved before it."""
    a, b, ra, rb = await pair("tcp", link_gbps=0.04)
    try:
        b.grant(Grant(1, [(0, SIZE)]))
        reader = await _reader(a, b, ra)
        unit = 1000
        background = asyncio.create_task(a.read_gather(b.address, 1, Gather(0, 2 << 20, unit, np.arange(1000),
                                                                          np.arange(1000)), Lane.BACKGROUND,
                                                       whole_frames=True))
        await asyncio.sleep(0.02)  # its first frames are reserved
        started = time.perf_counter()
        await asyncio.to_thread(lambda: reader.wait(reader.start(1, Gather(0, 0, unit, np.arange(40), np.arange(40)))))
        took = time.perf_counter() - started
        assert took < 0.035, took
        assert not background.done()
        await asyncio.wait_for(background, 5)
        reader.close()
    finally:
        await a.close()
        await b.close()


async def test_a_corrupted_reply_fails_its_read_and_is_counted(monkeypatch):
    """A reply whose crc32c does not match fails its read with ChecksumMismatch and counts in the reader's
    `num_checksum_failures`, which the decode worker adds to smartgen_dataplane_checksum_failures (these replies never
    pass through the data plane's links, whose own count leaves them out)."""
    from shared.dataplane import ChecksumMismatch
    from shared.dataplane import frames

    a, b, ra, rb = await pair("tcp")
    try:
        b.grant(Grant(7, [(0, SIZE)]))
        reader = await _reader(a, b, ra)
        monkeypatch.setattr(frames, "land_gather_reply", lambda *args: False)  # every reply arrives "corrupted"
        gather = random_gather(np.random.default_rng(5), 40, 128)

        def run() -> None:
            reader.wait(reader.start(7, gather))

        with pytest.raises(ChecksumMismatch):
            await asyncio.to_thread(run)
        assert reader.num_checksum_failures == 1
        assert a.stats()["checksum_failures"] == 0  # not the links' count
        reader.close()
    finally:
        await a.close()
        await b.close()
