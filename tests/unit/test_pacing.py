"""Chunk sizes on paced links: frames hold an emulated slow link about as briefly as a fast NIC's would."""
from __future__ import annotations

from shared.dataplane.frames import CHUNK_BYTES
from shared.dataplane.pacing import MIN_CHUNK_BYTES, PACED_CHUNK_S, chunk_bytes


def test_paced_chunks_take_about_a_millisecond_of_link_time():
    """Unpaced and fast links keep full chunks; slow paced links cut them to PACED_CHUNK_S of link time, never
    below MIN_CHUNK_BYTES."""
    assert chunk_bytes(0, CHUNK_BYTES) == CHUNK_BYTES
    assert chunk_bytes(25, CHUNK_BYTES) == CHUNK_BYTES
    at_36_mbit = chunk_bytes(0.036, CHUNK_BYTES)
    assert at_36_mbit * 8 / 0.036e9 <= PACED_CHUNK_S * 1.01 and at_36_mbit > MIN_CHUNK_BYTES
    assert chunk_bytes(0.001, CHUNK_BYTES) == MIN_CHUNK_BYTES
