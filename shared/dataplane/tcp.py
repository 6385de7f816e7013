"""TCP data plane (the reference implementation): direct sockets between prefill and decode.

Bytes land with `recv_into` straight into the registered region and leave with `sendall` of
memoryviews of it: no per-message multi-MiB `bytes` objects (fresh allocations are slow here).
One connection per peer; frames on it are serialized by a lock; replies are matched by `seq`.
"""
from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Sequence

import structlog

from shared.dataplane import frames
from shared.dataplane.base import DataPlane, DataPlaneError, Grant, Segment, TicketRefused
from shared.dataplane.frames import FrameError, Header

log = structlog.get_logger()
RECV_SLICE = 1 << 20  # receiving in ≤1 MiB slices measured fastest on these VMs


async def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    loop = asyncio.get_running_loop()
    while view:
        n = await loop.sock_recv_into(sock, view[:RECV_SLICE])
        if n == 0:
            raise ConnectionError("peer closed the data-plane connection")
        view = view[n:]


class _PeerConnection:
    """Caller side of one connection: send requests, match replies by seq."""

    def __init__(self, sock: socket.socket, region: memoryview, peer: str):
        self.sock, self.region, self.peer = sock, region, peer
        self.lock = asyncio.Lock()
        self.pending: dict[int, tuple[asyncio.Future[None], Sequence[Segment]]] = {}
        self.seq = itertools.count(1)
        self.reader = asyncio.create_task(self._read_replies())

    async def request(self, op: int, ticket: int, table: list[tuple[int, int]], payload: Sequence[memoryview],
                      local: Sequence[Segment]) -> None:
        loop = asyncio.get_running_loop()
        seq = next(self.seq)
        done: asyncio.Future[None] = loop.create_future()
        self.pending[seq] = (done, local)
        header = Header(op, frames.STATUS_OK, seq, ticket, len(table), sum(len(p) for p in payload))
        try:
            async with self.lock:
                await loop.sock_sendall(self.sock, header.pack() + frames.pack_segments(table))
                for part in payload:
                    await loop.sock_sendall(self.sock, part)
        except OSError as exc:
            self.fail(DataPlaneError(f"send to {self.peer} failed: {exc}"))
        await done

    async def _read_replies(self) -> None:
        raw = bytearray(frames.HEADER.size)
        try:
            while True:
                await _recv_exactly(self.sock, memoryview(raw))
                header = Header.unpack(raw)
                done, local = self.pending.pop(header.seq, (None, ()))
                if done is None:
                    raise FrameError(f"reply for unknown seq {header.seq}")
                if header.status != frames.STATUS_OK:
                    done.set_exception(TicketRefused(f"{self.peer} refused ticket {header.ticket}"))
                    continue
                if header.op == frames.OP_READ_DATA:
                    if header.payload_len != sum(s.length for s in local):
                        raise FrameError("read reply length does not match the request")
                    for seg in local:
                        await _recv_exactly(self.sock, self.region[seg.dst: seg.dst + seg.length])
                done.set_result(None)
        except (OSError, ConnectionError, FrameError) as exc:
            self.fail(DataPlaneError(f"data-plane connection to {self.peer} lost: {exc}"))
        except asyncio.CancelledError:
            self.fail(DataPlaneError("data plane closed"))
            raise

    def fail(self, error: DataPlaneError) -> None:
        for done, _ in self.pending.values():
            if not done.done():
                done.set_exception(error)
        self.pending.clear()
        self.sock.close()

    @property
    def is_open(self) -> bool:
        return self.sock.fileno() >= 0 and not self.reader.done()

    async def close(self) -> None:
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        self.sock.close()


class TcpDataPlane(DataPlane):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str = ""):
        self.host, self.port, self.advertise_host = host, port, advertise_host or host
        self.region = memoryview(bytearray(0))
        self._grants: dict[int, Grant] = {}
        self._peers: dict[str, _PeerConnection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._server_tasks: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._scratch = memoryview(bytearray(256 << 10))  # where refused payloads are drained to
        self.num_bytes_sent = 0
        self.num_bytes_received = 0
        self.num_refused = 0

    @property
    def grants(self) -> dict[int, Grant]:
        return self._grants

    def register_region(self, region: memoryview) -> None:
        self.region = region.cast("B") if region.format != "B" else region

    async def start(self) -> str:
        listener = socket.create_server((self.host, self.port), reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        self.address = f"{self.advertise_host}:{listener.getsockname()[1]}"
        self._accept_task = asyncio.create_task(self._accept_loop())
        return self.address

    async def close(self) -> None:
        if self._accept_task:
            self._accept_task.cancel()
        if self._listener:
            self._listener.close()
        for conn in list(self._peers.values()):
            await conn.close()
        self._peers.clear()
        for task in list(self._server_tasks):
            task.cancel()
        await asyncio.gather(*self._server_tasks, *( [self._accept_task] if self._accept_task else []), return_exceptions=True)

    def stats(self) -> dict[str, int]:
        return {"bytes_sent": self.num_bytes_sent, "bytes_received": self.num_bytes_received,
                "refused": self.num_refused, "peer_connections": len(self._peers),
                "served_connections": len(self._server_tasks), "grants": len(self._grants)}

    # --- caller side ---------------------------------------------------------------------
    async def push(self, peer: str, ticket: int, segments: Sequence[Segment]) -> None:
        conn = await self._connection(peer)
        table = [(s.dst, s.length) for s in segments]
        payload = [self.region[s.src: s.src + s.length] for s in segments]
        await conn.request(frames.OP_PUSH, ticket, table, payload, ())
        self.num_bytes_sent += sum(s.length for s in segments)

    async def read(self, peer: str, ticket: int, segments: Sequence[Segment]) -> None:
        conn = await self._connection(peer)
        await conn.request(frames.OP_READ, ticket, [(s.src, s.length) for s in segments], [], segments)
        self.num_bytes_received += sum(s.length for s in segments)

    async def _connection(self, peer: str) -> _PeerConnection:
        lock = self._connecting.setdefault(peer, asyncio.Lock())
        async with lock:
            conn = self._peers.get(peer)
            if conn is not None and conn.is_open:
                return conn
            host, port = peer.rsplit(":", 1)
            try:
                _, writer = await asyncio.open_connection(host, int(port))
            except OSError as exc:
                raise DataPlaneError(f"cannot connect to data plane at {peer}: {exc}") from None
            sock = writer.transport.get_extra_info("socket").dup()  # a plain socket; the stream is closed
            writer.transport.abort()
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._peers[peer] = _PeerConnection(sock, self.region, peer)
            return conn

    # --- serving side ----------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = asyncio.create_task(self._serve(sock))
            self._server_tasks.add(task)
            task.add_done_callback(self._server_tasks.discard)

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        raw = bytearray(frames.HEADER.size)
        try:
            while True:
                await _recv_exactly(sock, memoryview(raw))
                header = Header.unpack(raw)
                table_raw = bytearray(header.num_segments * frames.SEGMENT.size)
                await _recv_exactly(sock, memoryview(table_raw))
                table = frames.unpack_segments(table_raw, header.num_segments)
                grant = self._grants.get(header.ticket)
                allowed = grant is not None and all(grant.covers(off, n) for off, n in table)
                if header.op == frames.OP_PUSH:
                    if header.payload_len != sum(n for _, n in table):
                        raise FrameError("push payload length does not match its segment table")
                    await self._receive_push(sock, table, header.payload_len, grant if allowed else None)
                    if allowed:
                        assert grant is not None
                        grant.bytes_landed += header.payload_len
                        self.num_bytes_received += header.payload_len
                        if grant.on_landed:
                            grant.on_landed(header.payload_len)
                    reply = Header(frames.OP_PUSH_ACK, frames.STATUS_OK if allowed else frames.STATUS_REFUSED,
                                   header.seq, header.ticket, 0, 0)
                    await loop.sock_sendall(sock, reply.pack())
                elif header.op == frames.OP_READ:
                    if header.payload_len != 0:
                        raise FrameError("a read request carries no payload")
                    total = sum(n for _, n in table) if allowed else 0
                    reply = Header(frames.OP_READ_DATA, frames.STATUS_OK if allowed else frames.STATUS_REFUSED,
                                   header.seq, header.ticket, 0, total)
                    await loop.sock_sendall(sock, reply.pack())
                    if allowed:
                        assert grant is not None
                        grant.begin_io()
                        try:
                            for off, n in table:
                                await loop.sock_sendall(sock, self.region[off: off + n])
                        finally:
                            grant.end_io()
                    self.num_bytes_sent += total
                else:
                    raise FrameError(f"op {header.op} is a reply, not a request")
                if not allowed:
                    self.num_refused += 1
                    log.warning("dataplane_refused", ticket=header.ticket, op=header.op)
        except (ConnectionError, OSError):
            pass  # the peer went away; its own side reports the failure
        except FrameError as exc:
            log.warning("dataplane_bad_frame", error=str(exc))
        finally:
            sock.close()

    async def _receive_push(self, sock: socket.socket, table: list[tuple[int, int]], total: int,
                            grant: Grant | None) -> None:
        if grant is not None:
            grant.begin_io()
            try:
                for off, n in table:
                    await _recv_exactly(sock, self.region[off: off + n])
            finally:
                grant.end_io()
            return
        while total:  # keep the stream in step: drain what we refuse
            n = min(total, len(self._scratch))
            await _recv_exactly(sock, self._scratch[:n])
            total -= n
