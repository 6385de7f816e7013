"""Gather reads (many small entries in one request): exact for every transport, refused outside the grant or the
region, and a corrupted one fails without touching the region."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shared.dataplane import ChecksumMismatch, DataPlaneError, Gather, Grant, TicketRefused
from shared.dataplane import frames
from tests.unit.test_dataplane import SIZE, pair, planes  # noqa: F401 (planes: the fixture these tests take)


def random_gather(rng: np.random.Generator, count: int, unit: int, size: int = SIZE) -> Gather:
    """`count` entries of `unit` bytes: sources anywhere (repeats allowed), distinct destinations, both unsorted,
    with some runs consecutive on both sides (so the segment fallback merges them)."""
    slots = size // unit - 64
    dst = rng.choice(slots, count, replace=False)
    src = rng.integers(0, slots, count)
    src[1::3] = src[0:-1:3][: src[1::3].size] + 1  # a third of the entries continue the run before them
    dst[1::3] = dst[0:-1:3][: dst[1::3].size] + 1
    _, first = np.unique(dst, return_index=True)
    keep = np.sort(first)
    return Gather(64, 32, unit, src[keep], dst[keep])


@pytest.mark.parametrize("count, unit", [(1, 128), (700, 128), (5000, 128), (3000, 24)])
async def test_gather_read_is_exact(planes, count, unit):
    """A gather read lands every entry where its index says (one frame, or several: 5,000 × 128 B is 2.4 chunks),
    and not one byte elsewhere; the segment fallback (RDMA's) gives the same bytes."""
    a, b, ra, rb = planes
    rng = np.random.default_rng(count)
    ra[:] = rng.bytes(SIZE)
    rb[:] = rng.bytes(SIZE)
    b.grant(Grant(1, [(0, SIZE)]))
    gather = random_gather(rng, count, unit)
    expected = np.frombuffer(bytes(ra), np.uint8).copy()
    src = np.frombuffer(bytes(rb), np.uint8)
    for i, j in zip(gather.src_index.tolist(), gather.dst_index.tolist()):
        expected[32 + j * unit: 32 + (j + 1) * unit] = src[64 + i * unit: 64 + (i + 1) * unit]
    before = bytes(ra)
    await a.read_gather(b.address, 1, gather)
    assert ra == expected.tobytes()
    ra[:] = before
    await a.read(b.address, 1, gather.segments())
    assert ra == expected.tobytes()
    assert len(gather.segments()) < count or count == 1
    await asyncio.wait_for(b.grants[1].wait_idle(), 2)


async def test_gather_outside_the_grant_or_the_region_is_refused_and_writes_nothing(planes):
    """One entry past the grant: TicketRefused, nothing lands, the link still works; a destination outside the
    local region fails before anything is sent."""
    a, b, ra, rb = planes
    rb[:] = b"z" * SIZE
    b.grant(Grant(1, [(0, 4096), (8192, 12288)]))
    inside = np.array([0, 1, 64, 65, 95])  # 128 B entries: [0, 4096) and [8192, 12288)
    with pytest.raises(TicketRefused):
        await a.read_gather(b.address, 1, Gather(0, 0, 128, np.r_[inside, 32], np.arange(6)))  # 32 → [4096, 4224)
    with pytest.raises(TicketRefused):
        await a.read_gather(b.address, 2, Gather(0, 0, 128, inside, np.arange(5)))
    assert bytes(ra).count(b"z") == 0
    with pytest.raises(DataPlaneError, match="outside the registered region"):
        await a.read_gather(b.address, 1, Gather(0, SIZE - 128, 128, inside[:2], np.arange(2)))
    await a.read_gather(b.address, 1, Gather(0, 0, 128, inside, np.arange(5)))
    assert ra[: 5 * 128] == b"z" * 640


@pytest.mark.parametrize("corrupting", ["server", "client"])
async def test_a_corrupted_gather_fails_and_leaves_the_region_untouched(corrupting):
    """A gather reply (or its descriptor) that fails its crc32c is a ChecksumMismatch, and no byte of it reaches the
    region (entries land only after the check); the link goes on serving."""
    a, b, ra, rb = await pair("tcp")
    try:
        rb[:] = b"z" * SIZE
        b.grant(Grant(1, [(0, SIZE)]))
        (b if corrupting == "server" else a).faults.corrupt_frames = 1
        gather = Gather(0, 0, 128, np.arange(0, 200, 2), np.arange(100))
        with pytest.raises(ChecksumMismatch):
            await a.read_gather(b.address, 1, gather)
        assert bytes(ra).count(b"z") == 0
        await a.read_gather(b.address, 1, gather)
        assert ra[: 100 * 128] == b"z" * 12800
    finally:
        await a.close()
        await b.close()


def test_malformed_gather_descriptors_are_frame_errors():
    """A descriptor whose length disagrees with its count, or whose entries exceed one chunk, is refused as a bad
    frame (the link closes) before the server touches its region."""
    good = frames.pack_gather(0, 128, np.arange(10))
    assert frames.unpack_gather(good)[2].tolist() == list(range(10))
    for bad in (good[:-1], good + b"\0", frames.pack_gather(0, 0, np.arange(3)),
                frames.pack_gather(0, frames.CHUNK_BYTES, np.arange(2)), b"\0" * 5):
        with pytest.raises(frames.FrameError):
            frames.unpack_gather(bad)
