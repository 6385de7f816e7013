"""The TCP transport's lanes and pacing: a paced link holds its rate, and what a decode step waits on overtakes pushes,
read-aheads and background transfer by at most one chunk."""
from __future__ import annotations

import asyncio
import time

import pytest

from shared.dataplane import Grant, Lane, Segment
from shared.dataplane import frames
from tests.unit.test_dataplane import pair


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
async def test_one_requests_push_delays_anothers_on_demand_read_by_one_chunk_at_most(push_lane):
    """Two requests on one paced link: request 1's 8 MiB prefill push is under way when request 2's decode step
    reads 16 entries on demand. On the PUSH lane (what prefill uses) the read waits about one chunk time plus
    its own transfer; on the on-demand lane itself (what pushes used before) it queues behind the whole rest
    of the push, which this test also shows, so it can tell the two apart."""
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
            assert waited < chunk_s + own_s + 0.02, waited
        else:
            assert waited > 0.1, waited  # behind what was left of the push
        await asyncio.wait_for(push, 10)
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("ahead_lane", [Lane.PUSH, Lane.ON_DEMAND])
async def test_a_read_ahead_delays_an_on_demand_read_by_one_chunk_at_most(ahead_lane):
    """Step 1's read ahead (8 MiB here) is under way when the step reads 16 entries on demand. Asked on the
    PUSH lane, the prefill node answers it there, below on-demand: the read waits about one chunk time plus its
    own transfer. Asked on the on-demand lane (the first version) it queues behind the rest of the guess."""
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
            assert waited < chunk_s + own_s + 0.02, waited
        else:
            assert waited > 0.1, waited
        await asyncio.wait_for(ahead, 10)
    finally:
        await a.close()
        await b.close()
