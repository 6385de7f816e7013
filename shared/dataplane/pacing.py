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
    """Background frames wait for every frame before them; any other frame only for the non-background ones: a
    NIC with strict priority, whose urgent packet waits for at most one background packet (not a whole frame). A
    frame that goes ahead pushes the background clock back by its own time, so over time the background gets
    exactly what the others leave (a background frame already waiting still leaves when it was due: a burst
    of at most one frame above the rate)."""

    def __init__(self, gbps: float = 0.0):
        self.bytes_per_s = 0.0
        self.free_at = 0.0  # time.monotonic() at which the link is free again, of every frame reserved so far
        self.urgent_free_at = 0.0  # … of every frame reserved so far but the background ones
        self.set_gbps(gbps)

    def set_gbps(self, gbps: float) -> None:
        if gbps < 0:
            raise ValueError("link_gbps must be ≥ 0 (0 = unpaced)")
        self.bytes_per_s = gbps * 1e9 / 8

    @property
    def is_paced(self) -> bool:
        return self.bytes_per_s > 0

    async def wait(self, num_bytes: int, background: bool = False) -> None:
        """Sleep until `num_bytes` may go out at the set rate (returns at once when unpaced); `background`: after
        everything reserved before it, else only after what is not background (see the class docstring)."""
        if not self.is_paced:
            return
        now = time.monotonic()
        took = num_bytes / self.bytes_per_s
        # NOTE: event-loop sleeps overshoot by up to ~1 ms; keeping up to SLACK_S of that debt as credit
        # keeps the long-run rate exact instead of slowly below the setting.
        if background:
            self.free_at = max(now - SLACK_S, self.free_at) + took
            due = self.free_at
        else:
            due = self.urgent_free_at = max(now - SLACK_S, self.urgent_free_at) + took
            self.free_at = max(self.free_at + took, due)
        await asyncio.sleep(due - now)
