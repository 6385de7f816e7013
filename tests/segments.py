"""Random scatter-gather lists for data-plane tests (standard library only: also used inside the RDMA guest)."""
from __future__ import annotations

import random

from shared.dataplane.base import Lane, Segment


def random_segments(rng: random.Random, count: int, size: int, max_len: int) -> list[Segment]:
    """Non-overlapping destinations (so the expected result is well defined), sources anywhere (may overlap);
    lengths from 1 byte to `max_len`, including the edge cases 1, 7 and 4096."""
    slots = sorted(rng.sample(range(size // max_len), count))
    segs = []
    for slot in slots:
        n = rng.choice([1, 7, 4096, rng.randrange(1, max_len + 1), max_len])
        segs.append(Segment(rng.randrange(0, size - n), slot * max_len + rng.randrange(0, max_len - n + 1), n))
    return segs


async def push_and_read_exactly(a, b, ra: bytearray, rb: bytearray, rng: random.Random, ticket: int, num_pushed: int,
                                lane: Lane, read_ticket: int) -> int:
    """The data-plane contract on any transport: random bytes in both regions, a random scatter-gather push from
    `a` into `b` under `ticket` on `lane`, then a random scatter-gather read of `b` into `a`; every byte must land
    where its segment says. Returns the bytes pushed."""
    ra[:] = rng.randbytes(len(ra))
    rb[:] = rng.randbytes(len(rb))
    segs = random_segments(rng, num_pushed, len(ra), 300_000)
    await a.push(b.address, ticket, segs, lane)
    for s in segs:
        assert rb[s.dst: s.dst + s.length] == ra[s.src: s.src + s.length]
    reads = random_segments(rng, 40, len(ra), 100_000)
    expected = bytes(rb)
    await a.read(b.address, read_ticket, reads)
    for s in reads:
        assert ra[s.dst: s.dst + s.length] == expected[s.src: s.src + s.length]
    return sum(s.length for s in segs)
