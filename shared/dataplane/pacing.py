"""Pacing a link to a set rate, so a fast loopback behaves like a slow NIC.

A token bucket whose depth is one chunk, written as a virtual clock: a chunk of n bytes occupies the
link from `max(now, free_at)` for n / rate seconds, and is handed to the socket when that time is over
(so, as on a real NIC, its last byte arrives n / rate after its first could have). Both lanes of a link
share one Pacer, so background traffic uses only what on-demand traffic leaves.
"""
from __future__ import annotations

import asyncio
import os
import time


SLACK_S = 0.002
# NOTE: on a paced link a frame holds the link for its whole paced time, and an urgent frame cannot overtake
# it. A 256 KiB chunk takes 84 µs on a 25 Gbit/s NIC but 58 ms at 36 Mbit/s, longer than a CPU decode step;
# paced links therefore cut transfers into chunks of about this much link time, so that on-demand reads wait
# behind background traffic about as much (relative to a step) as they would on the real NIC.
PACED_CHUNK_S = float(os.environ.get("SMARTGEN_PACED_CHUNK_MS", "1")) / 1e3  # 0 = full chunks on every link
MIN_CHUNK_BYTES = 4096


def chunk_bytes(gbps: float, max_bytes: int) -> int:
    """Payload bytes per frame on a link paced at `gbps` (0 = unpaced: `max_bytes`)."""
    if gbps <= 0 or PACED_CHUNK_S <= 0:
        return max_bytes
    return max(MIN_CHUNK_BYTES, min(max_bytes, int(gbps * 1e9 / 8 * PACED_CHUNK_S)))


class Pacer:
    def __init__(self, gbps: float = 0.0):
        self.bytes_per_s = 0.0
        self.free_at = 0.0  # time.monotonic() at which the link is free again
        self.set_gbps(gbps)

    def set_gbps(self, gbps: float) -> None:
        if gbps < 0:
            raise ValueError("link_gbps must be ≥ 0 (0 = unpaced)")
        self.bytes_per_s = gbps * 1e9 / 8

    @property
    def is_paced(self) -> bool:
        return self.bytes_per_s > 0

    async def wait(self, num_bytes: int) -> None:
        """Sleep until `num_bytes` may go out at the set rate (returns at once when unpaced)."""
        if not self.is_paced:
            return
        now = time.monotonic()
        # NOTE: event-loop sleeps overshoot by up to ~1 ms; keeping up to SLACK_S of that debt as credit
        # keeps the long-run rate exact instead of slowly below the setting.
        self.free_at = max(now - SLACK_S, self.free_at) + num_bytes / self.bytes_per_s
        await asyncio.sleep(self.free_at - now)
