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
# NOTE: the background lane's frames are longer: each frame wakes the receiving process (and, on these VMs, an
# inter-processor interrupt), and path 3 moves KV all through a request's decode phase, so its frame rate is
# paid by the decode steps running beside it. 1 ms frames at 29.5 Mbit/s (~900 a second) made a 2K decode step
# 1.41x as long, 4 ms frames 1.22x, 16 ms 0.98x (`smartgen bench interference --gbps 0.0296`,
# docs/results/frame-rate-2026-12-06). A background read is one such frame (services/decode/kv_loader.py
# BACKGROUND_READ_S), so an on-demand read still waits behind at most one background read, as before.
PACED_BACKGROUND_CHUNK_S = float(os.environ.get("SMARTGEN_PACED_BACKGROUND_CHUNK_MS", "16")) / 1e3
MIN_CHUNK_BYTES = 4096


def chunk_bytes(gbps: float, max_bytes: int, background: bool = False) -> int:
    """Payload bytes per frame on a link paced at `gbps` (0 = unpaced: `max_bytes`); `background`: a frame of the
    background lane (PACED_BACKGROUND_CHUNK_S of link time instead of PACED_CHUNK_S)."""
    chunk_s = PACED_BACKGROUND_CHUNK_S if background else PACED_CHUNK_S
    if gbps <= 0 or chunk_s <= 0:
        return max_bytes
    return max(MIN_CHUNK_BYTES, min(max_bytes, int(gbps * 1e9 / 8 * chunk_s)))


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
