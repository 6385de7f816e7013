"""Chunk sizes on paced links: frames hold an emulated slow link about as briefly as a fast NIC's would."""
from __future__ import annotations

import pytest

from shared.dataplane.frames import CHUNK_BYTES
from shared.dataplane.pacing import MIN_CHUNK_BYTES, PACED_CHUNK_S, chunk_bytes

pytestmark = pytest.mark.timing  # wall-clock bounds: `make test` runs these alone (pyproject.toml, markers)


def test_paced_chunks_take_about_a_millisecond_of_link_time():
    """Unpaced and fast links keep full chunks; slow paced links cut them to PACED_CHUNK_S of link time, never
    below MIN_CHUNK_BYTES."""
    assert chunk_bytes(0, CHUNK_BYTES) == CHUNK_BYTES
    assert chunk_bytes(25, CHUNK_BYTES) == CHUNK_BYTES
    at_36_mbit = chunk_bytes(0.036, CHUNK_BYTES)
    assert at_36_mbit * 8 / 0.036e9 <= PACED_CHUNK_S * 1.01 and at_36_mbit > MIN_CHUNK_BYTES
    assert chunk_bytes(0.001, CHUNK_BYTES) == MIN_CHUNK_BYTES


async def test_a_frame_goes_before_background_frames_reserved_earlier_and_the_rate_holds():
    """At 8 Mbit/s (1 MB/s): three 50 KB background frames reserve 150 ms; an urgent 10 KB frame asked for
    after them leaves after its own 10 ms, not after 160 ms; the next background frame then waits for all of
    it (the background's clock moved back by the urgent frame's time): 210 ms of bytes leave in ~210 ms."""
    import asyncio
    import time

    from shared.dataplane.pacing import Pacer

    pacer = Pacer(0.008)
    started = time.monotonic()
    background = [asyncio.create_task(pacer.wait(50_000, background=True)) for _ in range(3)]
    await asyncio.sleep(0)
    await pacer.wait(10_000)
    assert time.monotonic() - started < 0.05
    await asyncio.gather(*background)
    await pacer.wait(50_000, background=True)
    took = time.monotonic() - started
    assert 0.2 <= took < 0.26, took
