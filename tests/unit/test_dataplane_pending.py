"""Connections that open the data plane's port and never finish the handshake are bounded: each is closed
`handshake_timeout_s` after it connected (however its bytes trickle), at most `max_pending_handshakes` wait at once
(a new one beyond that is closed at once), every one is counted in peers_refused, and a member links as usual
meanwhile (a real TCP listener, raw sockets as the hostile clients)."""
from __future__ import annotations

import asyncio
import os
import time

from shared.dataplane import Grant, Segment, make_dataplane
from shared.dataplane.tcp import TcpDataPlane

SIZE = 1 << 16
TIMEOUT_S = 0.8


async def closed_after(reader: asyncio.StreamReader, within_s: float) -> float | None:
    """Seconds until the listener closed the connection (reading whatever it sent first), None if it did not."""
    started = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(1024), max(0.01, within_s - (time.monotonic() - started))):
            pass
    except asyncio.TimeoutError:
        return None
    except ConnectionError:
        pass
    return time.monotonic() - started


async def test_silent_connections_are_capped_closed_after_the_timeout_and_counted():
    listener = TcpDataPlane(cluster_secret="s3cret", handshake_timeout_s=TIMEOUT_S, max_pending_handshakes=2)
    region = bytearray(SIZE)
    listener.register_region(memoryview(region))
    await listener.start()
    member = make_dataplane("tcp", cluster_secret="s3cret")
    member.register_region(memoryview(bytearray(os.urandom(SIZE))))
    await member.start()
    host, port = listener.address.rsplit(":", 1)
    silent = []
    try:
        for _ in range(2):  # these two take the pending slots and never send a hello
            silent.append(await asyncio.open_connection(host, int(port)))
            await asyncio.sleep(0.05)
        # one more byte every 0.1 s would not help: the deadline counts from the connect
        silent[0][1].write(b"\x00")
        extra_reader, extra_writer = await asyncio.open_connection(host, int(port))
        assert await closed_after(extra_reader, 0.5) is not None  # shed at once, not after the timeout
        assert listener.stats()["peers_refused"] == 1
        closes = await asyncio.gather(*(closed_after(reader, TIMEOUT_S + 2) for reader, _ in silent))
        assert all(c is not None for c in closes), closes
        assert listener.stats()["peers_refused"] == 3 and not listener._unnamed and not listener.links
        listener.grant(Grant(1, [(0, 4096)]))  # the slots are free again: a member links and moves bytes
        await member.push(listener.address, 1, [Segment(0, 0, 4096)])
        assert region[:4096] == bytes(member.region[:4096])
    finally:
        for _, writer in [*silent, (None, extra_writer)]:
            writer.close()
        await member.close()
        await listener.close()
