"""The byte stream under a TCP data-plane link: the socket itself, or TLS over it.

Both give the link what it needs from a connected, non-blocking socket on the event loop: `recv_exactly` (fill a
view, ConnectionError at the end), `sendall`, `send_parts` (several buffers as one write), `close`. TLS runs in
memory (`ssl.SSLObject` over two `MemoryBIO`s), so the
link keeps its own reader and writer tasks and its `recv_into` straight into the KV region either way.

TLS on the data plane (settings `dataplane_tls_ca`, `dataplane_tls_cert`, `dataplane_tls_key`) is mutual: every
worker presents its certificate and accepts only peers whose certificate the cluster's CA signed. Names are not
checked: workers are addressed by whatever host their container got, and membership is the CA's signature (and
the cluster secret's challenge–response after it, handshake.py). It encrypts KV in flight on a network that is
not trusted, at a cost in throughput (`smartgen bench transport` measures only the plain link).
"""
from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

RECV_SLICE = 1 << 20  # receiving in ≤1 MiB slices measured fastest on these VMs
# NOTE: a view at least this large is received with SO_RCVLOWAT set to what is left of it, so the kernel wakes the
# reader once when the rest has arrived instead of once per packet. Every wake-up is paid by the sender (on a VM,
# an inter-processor interrupt): a reader that outpaced its sender slept and woke ~1,000 times per 64 MiB and cut a
# read from ~3.7 to ~2.5 GB/s (`smartgen bench transport`).
LOW_WATER_BYTES = 16 << 10


async def _recv_exactly(channel: "Channel", view: memoryview, before_each: Callable[[int], None] | None = None) -> None:
    """Fill `view`; `before_each(bytes still to come)` runs before each receive."""
    while view:
        if before_each is not None:
            before_each(len(view))
        n = await channel.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the data-plane connection")
        view = view[n:]


class PlainChannel:
    """The socket as it is."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    async def recv_into(self, view: memoryview) -> int:
        return await asyncio.get_running_loop().sock_recv_into(self.sock, view[:RECV_SLICE])

    async def recv_exactly(self, view: memoryview) -> None:
        if len(view) < LOW_WATER_BYTES:
            await _recv_exactly(self, view)
            return
        def low_water(left: int) -> None:  # NOTE: never above what is left: bytes never sent would never wake us
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(left, RECV_SLICE))
        try:
            await _recv_exactly(self, view, low_water)
        finally:
            if self.sock.fileno() >= 0:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    async def sendall(self, data: bytes | memoryview) -> None:
        await asyncio.get_running_loop().sock_sendall(self.sock, data)

    async def send_parts(self, parts: list[bytes | memoryview]) -> None:
        """Send `parts` in order as one write (sendmsg) while the socket takes them: a frame's header and payload
        reach the peer together, so its reader wakes once for both."""
        parts = [part for part in parts if len(part)]
        while parts:
            try:
                sent = self.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            while parts and sent >= len(parts[0]):
                sent -= len(parts.pop(0))
            if parts:  # the socket is full: the rest of this part when it drains, then try the others together
                await self.sendall(memoryview(parts.pop(0))[sent:])

    def close(self) -> None:
        self.sock.close()


class TlsChannel:
    """TLS over the socket, in memory. One reader and one writer may use it at once (the link's two tasks):
    `recv_into` only feeds the incoming side, `sendall` only drains the outgoing one."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool):
        self.sock = sock
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)

    async def handshake(self) -> None:
        """Raises ssl.SSLError when the peer's certificate is not the CA's (or it refuses ours)."""
        while True:
            try:
                self._tls.do_handshake()
                await self._flush()
                return
            except ssl.SSLWantReadError:
                await self._flush()  # our part of the exchange first, then the peer's answer
                if not await self._fill():
                    raise ConnectionError("peer closed the data-plane connection during the TLS handshake") from None
            except ssl.SSLError:
                await self._flush()  # the alert that tells the peer why (an unknown CA…), then the error here
                raise

    async def recv_into(self, view: memoryview) -> int:
        while True:
            try:
                return self._tls.read(min(len(view), RECV_SLICE), view)
            except ssl.SSLWantReadError:
                if not await self._fill():
                    return 0
            except ssl.SSLZeroReturnError:
                return 0

    async def recv_exactly(self, view: memoryview) -> None:
        await _recv_exactly(self, view)

    async def send_parts(self, parts: list[bytes | memoryview]) -> None:
        for part in parts:
            await self.sendall(part)

    async def sendall(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = self._tls.write(view[:RECV_SLICE])
            view = view[n:]
            await self._flush()

    def close(self) -> None:
        self.sock.close()

    async def _fill(self) -> bool:
        """Move what the socket has into the TLS engine; False at the end of the stream."""
        data = await asyncio.get_running_loop().sock_recv(self.sock, RECV_SLICE)
        if not data:
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)


Channel = PlainChannel | TlsChannel


@dataclass(frozen=True)
class DataPlaneTls:
    """The two sides' TLS settings of one worker (it both dials and accepts)."""

    server: ssl.SSLContext
    client: ssl.SSLContext

    @classmethod
    def from_files(cls, ca: str, cert: str, key: str) -> "DataPlaneTls":
        """Mutual TLS: present `cert`, accept only peers signed by `ca` (no name check: see the module docstring)."""
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False
        for context in (server, client):
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(cert, key)
            context.load_verify_locations(ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return cls(server, client)


async def open_channel(sock: socket.socket, tls: DataPlaneTls | None, server_side: bool) -> Channel:
    """The channel a new connection runs on: after the TLS handshake where TLS is set."""
    if tls is None:
        return PlainChannel(sock)
    channel = TlsChannel(sock, tls.server if server_side else tls.client, server_side)
    await channel.handshake()
    return channel
