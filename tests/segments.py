"""Random scatter-gather lists for data-plane tests (standard library only: also used inside the RDMA guest)."""
from __future__ import annotations

import random

from shared.dataplane.base import Segment


def random_segments(rng: random.Random, count: int, size: int, max_len: int) -> list[Segment]:
    """Non-overlapping destinations (so the expected result is well defined), sources anywhere (may overlap);
    lengths from 1 byte to `max_len`, including the edge cases 1, 7 and 4096."""
    slots = sorted(rng.sample(range(size // max_len), count))
    segs = []
    for slot in slots:
        n = rng.choice([1, 7, 4096, rng.randrange(1, max_len + 1), max_len])
        segs.append(Segment(rng.randrange(0, size - n), slot * max_len + rng.randrange(0, max_len - n + 1), n))
    return segs
