"""The plain channel under a TCP link, over a real socket pair: a gathered write that the socket cannot take at once
arrives whole and in order, and a large receive (woken by the kernel only at its low-water mark) neither hangs on
its last bytes nor leaves the mark raised for the small frame after it."""
from __future__ import annotations

import asyncio
import os
import socket

from shared.dataplane.channel import LOW_WATER_BYTES, PlainChannel


def _pair(send_buffer: int = 0) -> tuple[PlainChannel, PlainChannel]:
    """Two connected loopback TCP sockets (not a Unix socket pair: its poll ignores the low-water mark)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    for sock in (a, b):
        sock.setblocking(False)
    if send_buffer:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    return PlainChannel(a), PlainChannel(b)


async def test_send_parts_through_a_full_socket_arrives_whole_and_in_order():
    sender, receiver = _pair(send_buffer=16 << 10)
    head, payload, tail = os.urandom(40), os.urandom(3 << 20), os.urandom(7)  # far more than the socket holds
    got = memoryview(bytearray(len(head) + len(payload) + len(tail)))
    await asyncio.wait_for(asyncio.gather(sender.send_parts([head, memoryview(payload), b"", tail]),
                                          receiver.recv_exactly(got)), 10)
    assert bytes(got) == head + payload + tail
    sender.close(), receiver.close()


async def test_a_large_receive_whose_bytes_trickle_in_completes_and_resets_the_low_water_mark():
    sender, receiver = _pair()
    size = 4 * LOW_WATER_BYTES
    data = os.urandom(size)

    async def trickle() -> None:  # the last piece is smaller than any earlier mark: a mark left above it would hang
        for at in range(0, size, 3000):
            await sender.sendall(data[at: at + 3000])
            await asyncio.sleep(0.001)

    got = memoryview(bytearray(size))
    await asyncio.wait_for(asyncio.gather(trickle(), receiver.recv_exactly(got)), 10)
    assert bytes(got) == data
    assert receiver.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    small = bytearray(40)  # the next frame's header: it must wake the reader on its own
    await sender.sendall(b"h" * 40)
    await asyncio.wait_for(receiver.recv_exactly(memoryview(small)), 2)
    assert small == b"h" * 40
    sender.close(), receiver.close()


async def test_a_peer_that_closes_mid_payload_ends_the_receive_with_an_error():
    sender, receiver = _pair()
    await sender.sendall(os.urandom(1000))
    sender.close()
    got = memoryview(bytearray(2 * LOW_WATER_BYTES))
    try:
        await asyncio.wait_for(receiver.recv_exactly(got), 5)
    except ConnectionError as exc:
        assert "closed" in str(exc)
    else:
        raise AssertionError("a receive cut short by the peer must fail")
    receiver.close()
