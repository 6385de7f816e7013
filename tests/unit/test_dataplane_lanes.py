"""The TCP transport's lanes and pacing: a paced link holds its rate; what a decode step waits on overtakes
background transfer by at most one chunk, and shares the link with a push or a read-ahead (lane_share.py): it
waits behind its own size of theirs at most, and they are not starved by it."""
from __future__ import annotations

import asyncio
import time

import pytest

from shared.dataplane import Grant, Lane, Segment
from shared.dataplane import frames
from tests.unit.test_dataplane import pair

pytestmark = pytest.mark.timing  # wall-clock bounds: `make test` runs these alone (pyproject.toml, markers)


async def test_pacing_holds_the_set_rate():
    """A paced link moves data at link_gbps: never faster (±5%), and not much slower."""
    a, b, _, _ = await pair("tcp", size=16 << 20)
    try:
        b.grant(Grant(1, [(0, 16 << 20)]))
        # NOTE: unpaced first, so the destination's pages are touched (first-touch faults are slow here)
        await a.push(b.address, 1, [Segment(0, 0, 16 << 20)])
        a.set_link_gbps(0.4)  # 50 MB/s
        started = time.monotonic()
        await a.push(b.address, 1, [Segment(0, 0, 16 << 20)])
        rate_gbps = (16 << 20) * 8 / (time.monotonic() - started) / 1e9
        # NOTE: never above the rate (+5% for timer slack); below it only by what a busy 2-core VM steals
        assert 0.4 * 0.85 < rate_gbps < 0.4 * 1.05, rate_gbps
    finally:
        await a.close()
        await b.close()


async def test_on_demand_overtakes_a_saturating_background_lane():
    """With background pushes filling a paced link, an on-demand read waits at most about one chunk time
    plus its own transfer time."""
    gbps = 0.2  # 25 MB/s: one 256 KiB chunk ≈ 10.5 ms
    a, b, _, _ = await pair("tcp", size=16 << 20, link_gbps=gbps)
    try:
        a.grant(Grant(1, [(0, 16 << 20)]))
        b.grant(Grant(1, [(0, 16 << 20)]))
        background = asyncio.create_task(a.push(b.address, 1, [Segment(0, 0, 12 << 20)], Lane.BACKGROUND))
        await asyncio.sleep(0.1)
        chunk_s = frames.CHUNK_BYTES * 8 / (gbps * 1e9)
        own_s = 64 * 1024 * 8 / (gbps * 1e9)
        started = time.monotonic()
        await b.read(a.address, 1, [Segment(i * 8192, i * 8192, 4096) for i in range(16)])  # a's reply is ON_DEMAND
        waited = time.monotonic() - started
        assert not background.done(), "the background push should still be running"
        assert waited < chunk_s + own_s + 0.02
        a.pause_background()
        await asyncio.sleep(0.05)
        sent = a.lane_stats[Lane.BACKGROUND].num_bytes
        await asyncio.sleep(0.1)
        assert a.lane_stats[Lane.BACKGROUND].num_bytes <= sent + frames.CHUNK_BYTES  # paused: at most one in flight
        a.resume_background()
        await asyncio.wait_for(background, 10)
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("push_lane", [Lane.PUSH, Lane.ON_DEMAND])
async def test_one_requests_push_delays_anothers_on_demand_read_by_its_share_at_most(push_lane):
    """Two requests on one paced link: request 1's 8 MiB prefill push is under way when request 2's decode step
    reads 16 entries on demand. On the PUSH lane (what prefill uses) the read waits about one chunk time plus
    its own transfer twice (the push's share, lane_share.py); on the on-demand lane itself (what pushes used
    before) it queues behind the whole rest of the push, which this test also shows, so it can tell the two apart."""
    gbps = 0.2  # 25 MB/s: one 256 KiB chunk ≈ 10.5 ms, the 8 MiB push ≈ 0.34 s
    a, b, _, _ = await pair("tcp", size=16 << 20, link_gbps=gbps)
    try:
        a.grant(Grant(1, [(0, 16 << 20)]))  # request 2's KV, readable on the prefill node (a)
        b.grant(Grant(2, [(0, 16 << 20)]))  # request 1's slab on the decode node (b)
        push = asyncio.create_task(a.push(b.address, 2, [Segment(0, 0, 8 << 20)], push_lane))
        await asyncio.sleep(0.05)
        chunk_s = frames.CHUNK_BYTES * 8 / (gbps * 1e9)
        own_s = 64 * 1024 * 8 / (gbps * 1e9)
        started = time.monotonic()
        await b.read(a.address, 1, [Segment(i * 8192, i * 8192, 4096) for i in range(16)])  # a's reply: ON_DEMAND
        waited = time.monotonic() - started
        if push_lane is Lane.PUSH:
            assert not push.done(), "the push should still be running"
            assert waited < chunk_s + 2 * own_s + 0.02, waited
        else:
            assert waited > 0.1, waited  # behind what was left of the push
        await asyncio.wait_for(push, 10)
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("ahead_lane", [Lane.PUSH, Lane.ON_DEMAND])
async def test_a_read_ahead_delays_an_on_demand_read_by_its_share_at_most(ahead_lane):
    """Step 1's read ahead (8 MiB here) is under way when the step reads 16 entries on demand. Asked on the
    PUSH lane, the prefill node answers it there, sharing the link with on-demand: the read waits about one chunk
    time plus its own transfer twice. Asked on the on-demand lane (the first version) it queues behind the rest
    of the guess."""
    gbps = 0.2  # 25 MB/s: one 256 KiB chunk ≈ 10.5 ms, the 8 MiB read ≈ 0.34 s
    a, b, _, _ = await pair("tcp", size=16 << 20, link_gbps=gbps)
    try:
        a.grant(Grant(1, [(0, 16 << 20)]))  # the request's KV, readable on the prefill node (a)
        ahead = asyncio.create_task(b.read(a.address, 1, [Segment(0, 0, 8 << 20)], ahead_lane))
        await asyncio.sleep(0.05)
        chunk_s = frames.CHUNK_BYTES * 8 / (gbps * 1e9)
        own_s = 64 * 1024 * 8 / (gbps * 1e9)
        started = time.monotonic()
        await b.read(a.address, 1, [Segment((8 << 20) + i * 8192, (8 << 20) + i * 8192, 4096) for i in range(16)])
        waited = time.monotonic() - started
        if ahead_lane is Lane.PUSH:
            assert not ahead.done(), "the read ahead should still be running"
            assert waited < chunk_s + 2 * own_s + 0.02, waited
        else:
            assert waited > 0.1, waited
        await asyncio.wait_for(ahead, 10)
    finally:
        await a.close()
        await b.close()


def test_the_lane_share_gives_a_waiting_push_its_share_of_the_bytes():
    """While both lanes have frames, ON_DEMAND and PUSH split the bytes sent by `push_share` whatever the frames'
    sizes; the first pick is the read's; a lane alone takes every pick and banks nothing for later; 0 is strict."""
    from shared.dataplane.lane_share import LaneShare

    def split(share: LaneShare, on_demand: int, push: int, num_picks: int = 400) -> dict[Lane, int]:
        sent = {Lane.ON_DEMAND: 0, Lane.PUSH: 0}
        for _ in range(num_picks):
            lane = share.pick(on_demand, push)
            sent[lane] += on_demand if lane is Lane.ON_DEMAND else push
        return sent

    half = LaneShare(0.5)
    assert half.pick(4096, 4096) is Lane.ON_DEMAND and half.pick(4096, 4096) is Lane.PUSH
    sent = split(LaneShare(0.5), 1024, 4096)  # small read replies against full push chunks
    assert sent[Lane.PUSH] / sum(sent.values()) == pytest.approx(0.5, abs=0.02)
    sent = split(LaneShare(0.25), 4096, 4096)
    assert sent[Lane.PUSH] / sum(sent.values()) == pytest.approx(0.25, abs=0.02)
    assert split(LaneShare(0.0), 4096, 4096)[Lane.PUSH] == 0  # strict priority, as before
    alone = LaneShare(0.5)
    assert all(alone.pick(4096, None) is Lane.ON_DEMAND for _ in range(50))
    assert alone.pick(None, 4096) is Lane.PUSH and alone.pick(None, None) is None
    assert alone.pick(4096, 4096) is Lane.ON_DEMAND  # no credit from the 50 reads sent alone
    with pytest.raises(ValueError):
        LaneShare(1.5)


async def test_a_push_moves_at_its_share_while_another_requests_reads_fill_the_link():
    """Request 2 decodes and its on-demand reads keep the link busy without a pause (four readers in a loop) while
    request 1's 2 MiB prefill push is under way: the push still gets about half the link (done in ~2× its alone
    time) and the reads the other half. With strict priority (before) the push waited for the reads to stop."""
    gbps = 0.08  # 10 MB/s: the push alone ≈ 0.21 s
    a, b, _, _ = await pair("tcp", size=16 << 20, link_gbps=gbps)
    stop = asyncio.Event()
    read_bytes = 0

    async def reader(k: int) -> None:  # a decode step's reads, back to back
        nonlocal read_bytes
        while not stop.is_set():
            await b.read(a.address, 1, [Segment((8 << 20) + k * (256 << 10), (8 << 20) + k * (256 << 10), 256 << 10)])
            read_bytes += 256 << 10

    try:
        a.grant(Grant(1, [(0, 16 << 20)]))  # request 2's KV, readable on the prefill node (a)
        b.grant(Grant(2, [(0, 8 << 20)]))  # request 1's slab on the decode node (b)
        readers = [asyncio.create_task(reader(k)) for k in range(4)]
        await asyncio.sleep(0.1)
        alone_s = (2 << 20) * 8 / (gbps * 1e9)
        started, read_before = time.monotonic(), read_bytes
        await asyncio.wait_for(a.push(b.address, 2, [Segment(0, 0, 2 << 20)], Lane.PUSH), 6 * alone_s)
        took, read_during = time.monotonic() - started, read_bytes - read_before
        assert not any(r.done() for r in readers), "the reads should still be running"
        assert took < 3.2 * alone_s, (took, alone_s)
        assert read_during > 0.6 * (2 << 20), read_during  # the reads kept about half (counted in whole reads)
    finally:
        stop.set()
        await asyncio.gather(*readers, return_exceptions=True)
        await a.close()
        await b.close()
