"""A blocking, reads-only TCP data-plane link, for the one thread that waits on its reads anyway.

The decode's torch thread waits for each on-demand read before it attends (services/decode/remote.py). Through the
event loop every such read costs two hand-offs of the GIL (the torch thread wakes the loop to send, the loop wakes
the torch thread once the reply has landed) plus the loop's own Python work, all under the GIL the step needs:
at 2K, ~19 reads a step and ~18 ms of a 137 ms step (docs/results/event-loop-2026-12-06). A `DirectReader` is a
second link to the same peer that only the torch thread uses: `start` sends a read's GATHER frames itself and
returns (the step gathers its local entries meanwhile); `wait` receives the replies straight into the region.
No event loop, no hand-off; the GIL is released while it blocks in recv.

The event loop opens it (TcpDataPlane.dial_reads_only: the same handshake, the dialer named READS_ONLY so the peer
never sends its own transfers on it) and hands the socket over, blocking. The frames are the data plane's own
(frames.py); the peer serves them as on any link, paced together with its other links to us (one pacer a peer).

One thread uses it. Replies come in any order (a refusal travels on the peer's control lane): each lands when it
arrives, whichever read it answers. An error of the socket breaks the reader: every read on it fails, and the
owner opens another. `close` (any thread) shuts the socket down, which wakes a thread blocked in it.
"""
from __future__ import annotations

import itertools
import socket
import struct
import threading
from dataclasses import dataclass, field

import numpy as np

from shared.dataplane import frames
from shared.dataplane.base import ChecksumMismatch, DataPlaneError, Gather, TicketRefused
from shared.dataplane.frames import CHUNK_BYTES, FrameError, Header


@dataclass
class DirectRead:
    """One gather sent on a DirectReader: the frames whose replies have not landed yet, and its first error."""

    left: set[int]
    num_bytes: int
    error: DataPlaneError | None = None


@dataclass
class _Reply:
    """Where the reply to one GATHER frame lands: entry i at dst_base + index[i] · unit of the region."""

    read: DirectRead
    dst_base: int
    unit: int
    index: np.ndarray = field(repr=False)


class DirectReader:
    def __init__(self, sock: socket.socket, region: memoryview, peer: str, checksums: bool = True,
                 timeout_s: float = 30.0):
        # NOTE: blocking without a Python timeout (which polls before every receive: two GIL round trips instead of
        # one); the kernel's own timeouts end a receive or send that waits longer (EAGAIN: the reader breaks)
        sock.setblocking(True)
        timeval = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.region, self.peer, self.checksums = sock, region, peer, checksums
        self.seq = itertools.count(1)
        self.replies: dict[int, _Reply] = {}  # seq → where its reply lands
        self.stage = memoryview(bytearray(CHUNK_BYTES))  # a reply's payload, checked before it reaches the region
        self.head = memoryview(bytearray(frames.HEADER.size))
        self.error: DataPlaneError | None = None
        self.num_reads = 0
        self.num_bytes = 0  # landed
        self.num_checksum_failures = 0  # replies whose crc32c did not match (each fails its read)
        self._using = threading.Lock()  # held while the owner is inside the socket; `close` waits for it

    @property
    def is_broken(self) -> bool:
        return self.error is not None

    def start(self, ticket: int, gather: Gather) -> DirectRead:
        """Send `gather` as GATHER frames whose replies are whole chunks (≤ CHUNK_BYTES each) and return at once;
        `wait` lands it. DataPlaneError if the reader is broken or the send fails.
        NOTE: whole chunks, not the paced link's ~1 ms ones (pacing.chunk_bytes): each frame is a wake-up of the
        waiting thread that must take the GIL back from the event loop, and a 2K read is 5-10 paced chunks
        (measured: with paced chunks the reads waited less and the steps took longer: docs/results/direct-reads-*).
        A reply then holds the peer's pacer for its whole time: an on-demand read goes first anyway."""
        gather.check_within(len(self.region))
        per_frame = max(1, CHUNK_BYTES // gather.unit)
        if gather.unit > CHUNK_BYTES or (gather.src_index.size and int(gather.src_index.max()) >> 32):
            raise DataPlaneError("a gather too large for one descriptor")  # the caller reads through the loop then
        read = DirectRead(set(), gather.num_bytes)
        out, replies = [], {}
        for at in range(0, gather.src_index.size, per_frame):
            seq = next(self.seq)
            descriptor = frames.pack_gather(gather.src_base, gather.unit, gather.src_index[at: at + per_frame])
            header = Header(frames.OP_GATHER, seq=seq, ticket=ticket, payload_len=len(descriptor))
            if self.checksums:
                header = header.with_crc(frames.crc32c([descriptor]))
            out += [header.pack(), descriptor]
            replies[seq] = _Reply(read, gather.dst_base, gather.unit, gather.dst_index[at: at + per_frame])
        with self._using:
            self._check()
            read.left.update(replies)
            self.replies.update(replies)
            try:
                self.sock.sendall(b"".join(out))
            except OSError as exc:
                self._break(f"sending: {exc}")
                self._check()
        self.num_reads += 1
        return read

    def wait(self, read: DirectRead) -> None:
        """Receive replies (any read's) until every frame of `read` has landed. DataPlaneError if a frame was
        refused or arrived corrupted (the rest of the read still lands), or the reader broke."""
        with self._using:
            while read.left and self.error is None:
                self._receive_one()
        if read.error is not None:
            raise read.error
        if read.left:
            assert self.error is not None
            raise self.error

    def close(self) -> None:
        """Break the reader (any thread): wake its owner if it is blocked in the socket, then close it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        with self._using:  # NOTE: the owner leaves the socket at once after the shutdown; only then is its fd closed
            self._break("closed")

    # --- internals (the owner's thread, holding `_using`) ----------------------------------------------
    def _receive_one(self) -> None:
        try:
            self._recv_exactly(self.head)
            header = Header.unpack(self.head)
            if header.op != frames.OP_READ_DATA or header.num_segments:
                raise FrameError(f"unexpected op {header.op} on a reads-only link")
            reply = self.replies.pop(header.seq, None)
            if reply is None:
                raise FrameError(f"reply for unknown seq {header.seq}")
            read = reply.read
            read.left.discard(header.seq)
            if header.status == frames.STATUS_REFUSED:
                read.error = read.error or TicketRefused(f"{self.peer} refused ticket {header.ticket}: unknown, "
                                                         "revoked, or entries outside its grant")
                return
            if header.status == frames.STATUS_CORRUPT:
                read.error = read.error or ChecksumMismatch(f"{self.peer} received a corrupted read request")
                return
            if header.payload_len != reply.unit * reply.index.size:
                raise FrameError("gather reply length does not match the request")
            stage = self.stage[: header.payload_len]
            self._recv_exactly(stage)
            if not frames.land_gather_reply(header, stage, self.region, reply.dst_base, reply.unit, reply.index):
                self.num_checksum_failures += 1
                read.error = read.error or ChecksumMismatch(f"a read from {self.peer} arrived corrupted (crc32c)")
                return
            self.num_bytes += header.payload_len
        except (OSError, FrameError) as exc:  # socket.timeout is an OSError
            self._break(str(exc) or type(exc).__name__)

    def _recv_exactly(self, view: memoryview) -> None:
        """Fill `view`. MSG_WAITALL: the kernel wakes this thread once the whole of it is here, not once a packet
        (each wake-up must take the GIL back, and may wait up to the switch interval for it)."""
        while view:
            n = self.sock.recv_into(view, len(view), socket.MSG_WAITALL)
            if n == 0:
                raise ConnectionError("the peer closed the connection")
            view = view[n:]

    def _break(self, why: str) -> None:
        if self.error is None:
            self.error = DataPlaneError(f"direct read link to {self.peer} broken: {why}")
        for reply in self.replies.values():
            reply.read.error = reply.read.error or self.error
        self.replies.clear()
        self.sock.close()

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
