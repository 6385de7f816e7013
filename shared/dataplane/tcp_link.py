"""One TCP data-plane link: the frames both ends of one connection exchange, and the two tasks that move them.

Each end of a connection (a `Link`, owned by tcp.py's TcpDataPlane) has:
  - a writer task, the only one that sends: it takes the next frame by priority (CONTROL acks first; then
    ON_DEMAND and PUSH, which share the link while both wait: lane_share.py; then BACKGROUND unless paused),
    waits for the link's Pacer, sends;
  - a reader task, the only one that receives: requests from the peer (PUSH data lands with `recv_into`
    straight in the registered region; a READ is answered by queueing its data on the lane it names; a GATHER
    likewise, its scattered entries copied with one `np.take` into the writer's stage just before sending) and
    replies to our own requests (matched by `seq`; a GATHER's reply is scattered into place with one index).
Transfers are cut into chunks of ≤ CHUNK_BYTES (less on a paced link: pacing.chunk_bytes), one frame each,
checksummed (crc32c) unless turned off. Nothing on this path allocates per message beyond small headers: payloads
are memoryviews of the region. The bytes run on a `Channel` (channel.py): the socket, or TLS over it.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import structlog

from shared.dataplane import frames
from shared.dataplane.base import ChecksumMismatch, DataPlaneError, Grant, Lane, Segment, TicketRefused, entries
from shared.dataplane.channel import Channel
from shared.dataplane.frames import CHUNK_BYTES, FrameError, Header
from shared.dataplane.lane_share import LaneShare

if TYPE_CHECKING:
    from shared.dataplane.tcp import TcpDataPlane

log = structlog.get_logger()
CONTROL = 0  # the acks' lane: above ON_DEMAND, never paced (they are 40 bytes)
# NOTE: background chunks that are sent but not yet acked sit in kernel socket buffers, where an urgent
# frame cannot overtake them. Capping them keeps an on-demand reply behind at most this much.
BACKGROUND_WINDOW = 2 * CHUNK_BYTES
STAGE_PARTS = 3  # frames of this many parts or more are copied through one staging buffer (one syscall)


@dataclass
class _Frame:
    """One frame waiting for the writer."""

    header: Header
    table: list[tuple[int, int]] = field(default_factory=list)
    payload: list[memoryview] = field(default_factory=list)
    on_done: Callable[[], None] | None = None  # runs once the frame is sent or dropped (releases a grant)
    fill: Callable[[memoryview], None] | None = None  # instead of `payload`: writes it into the view the writer gives


@dataclass
class _Waiting:
    """One of our requests, waiting for its reply."""

    done: asyncio.Future[None]
    local: list[Segment] = field(default_factory=list)  # READ: where the data lands here
    scatter: tuple[int, int, np.ndarray] | None = None  # GATHER: (dst base, unit, dst index) where its entries land
    background_bytes: int = 0  # a BACKGROUND push chunk: its size, counted in the link's window until acked


@dataclass
class LaneStats:
    num_bytes: int = 0
    num_frames: int = 0
    busy_s: float = 0.0  # time the writer spent on this lane's frames, pacing included


class Link:
    def __init__(self, plane: "TcpDataPlane", channel: Channel, peer: str):
        self.plane, self.channel, self.peer = plane, channel, peer
        # NOTE: no bound needed: every frame queued is a chunk of a push or read some caller awaits, or the ack or
        # reply to one of the peer's, so the queues hold what the requests in progress move, no more.
        self.queues: dict[int, deque[_Frame]] = {CONTROL: deque(), **{lane: deque() for lane in Lane}}
        self.has_work = asyncio.Event()
        self.waiting: dict[int, _Waiting] = {}
        self.seq = itertools.count(1)
        self.pacer = plane.pacer_for(peer)  # shared with our other links to this peer
        self.share = LaneShare()  # ON_DEMAND against PUSH (lane_share.py)
        self.error: DataPlaneError | None = None
        self.background_in_flight = 0  # bytes of BACKGROUND chunks sent and not yet acked
        self.holding: Counter[int] = Counter()  # ticket → frames on its pages being received, queued or sent here
        self.send_stage = bytearray(frames.HEADER.size + frames.MAX_STAGED_TABLE + CHUNK_BYTES)
        self.recv_stage = memoryview(bytearray(CHUNK_BYTES))
        self.tasks = [asyncio.create_task(self._write_loop()), asyncio.create_task(self._read_loop())]

    # --- our requests ------------------------------------------------------------------------
    def request(self, lane: int, header: Header, table: list[tuple[int, int]], payload: list[memoryview],
                local: list[Segment], scatter: tuple[int, int, np.ndarray] | None = None) -> asyncio.Future[None]:
        if self.error:
            raise self.error
        seq = next(self.seq)
        done = asyncio.get_running_loop().create_future()
        size = sum(len(p) for p in payload)
        acked_background = size if lane == Lane.BACKGROUND and header.op == frames.OP_PUSH else 0
        self.waiting[seq] = _Waiting(done, local, scatter, acked_background)
        self.send(lane, _Frame(Header(header.op, seq=seq, ticket=header.ticket, num_segments=len(table),
                                      payload_len=size, flags=header.flags), table, payload))
        return done

    def send(self, lane: int, frame: _Frame) -> None:
        self.queues[lane].append(frame)
        self.has_work.set()

    # --- the writer ----------------------------------------------------------------------------
    def _next_frame(self) -> tuple[int, _Frame] | None:
        """CONTROL first; then ON_DEMAND and PUSH, shared by `LaneShare` while both wait; BACKGROUND last."""
        if self.queues[CONTROL]:
            return CONTROL, self.queues[CONTROL].popleft()
        on_demand, push = self.queues[Lane.ON_DEMAND], self.queues[Lane.PUSH]
        lane = self.share.pick(on_demand[0].header.payload_len if on_demand else None,
                               push[0].header.payload_len if push else None)
        if lane is not None:
            return lane, self.queues[lane].popleft()
        queue = self.queues[Lane.BACKGROUND]
        if queue and not self.plane.is_background_paused and not (
                self.background_in_flight and self.background_in_flight + queue[0].header.payload_len > BACKGROUND_WINDOW):
            return Lane.BACKGROUND, queue.popleft()
        return None

    async def _write_loop(self) -> None:
        try:
            while True:
                picked = self._next_frame()
                if picked is None:
                    self.has_work.clear()
                    await self.has_work.wait()
                    continue
                lane, frame = picked
                if self._is_abandoned(frame):
                    if frame.on_done:
                        frame.on_done()
                    continue
                started = time.monotonic()
                try:
                    header, payload = frame.header, frame.payload
                    if frame.fill is not None:  # a gather's reply: its entries are copied out of the region now
                        stage = memoryview(self.send_stage)[frames.HEADER.size: frames.HEADER.size + header.payload_len]
                        frame.fill(stage)
                        payload = [stage]
                    if payload and self.plane.use_checksums:
                        header = header.with_crc(frames.crc32c(payload))
                    if lane != CONTROL:
                        await self.pacer.wait(header.payload_len, background=lane == Lane.BACKGROUND)
                        if delay := self.plane.faults.delay_for(Lane(lane)):
                            await asyncio.sleep(delay)
                    if lane == Lane.BACKGROUND and header.op == frames.OP_PUSH:  # only pushes are acked
                        self.background_in_flight += header.payload_len
                    await self._send_frame(header, frame.table, self.plane.faults.maybe_corrupt(payload))
                finally:
                    if frame.on_done:
                        frame.on_done()
                self.plane.note_frame(lane, frame.header.payload_len, time.monotonic() - started)
        except (OSError, ConnectionError) as exc:
            self.fail(DataPlaneError(f"data-plane link to {self.peer} lost while sending: {exc}"))
        except Exception as exc:  # a bug must not leave waiters hanging: fail the link loudly
            log.exception("dataplane_writer_crashed", peer=self.peer)
            self.fail(DataPlaneError(f"data-plane link to {self.peer} failed: {exc!r}"))

    def _is_abandoned(self, frame: _Frame) -> bool:
        """A chunk of our own push or read whose caller is gone (the request was aborted, or the transfer failed on
        another chunk): it would only take link time from live requests, so it is dropped unsent."""
        if frame.header.op not in (frames.OP_PUSH, frames.OP_READ, frames.OP_GATHER):
            return False  # a reply or ack to the peer: always owed
        waiting = self.waiting.get(frame.header.seq)
        if waiting is None or not waiting.done.done():
            return False
        del self.waiting[frame.header.seq]  # no reply will come: the peer never sees the frame
        return True

    async def _send_frame(self, header: Header, table: list[tuple[int, int]], payload: list[memoryview]) -> None:
        head = header.pack() + frames.pack_segments(table)
        if len(payload) < STAGE_PARTS or len(head) > frames.HEADER.size + frames.MAX_STAGED_TABLE:
            await self.channel.send_parts([head, *payload])
            return
        # many small parts (a scattered read reply): one copy into the stage beats one syscall per part
        stage, n = self.send_stage, len(head)
        stage[:n] = head
        for part in payload:
            stage[n: n + len(part)] = part
            n += len(part)
        await self.channel.sendall(memoryview(stage)[:n])

    async def _recv_into(self, views: list[memoryview]) -> None:
        """Receive a frame's payload into `views` (via the stage when they are many and small)."""
        if len(views) < STAGE_PARTS:
            for view in views:
                await self.channel.recv_exactly(view)
            return
        total = sum(len(v) for v in views)
        await self.channel.recv_exactly(self.recv_stage[:total])
        at = 0
        for view in views:
            view[:] = self.recv_stage[at: at + len(view)]
            at += len(view)

    # --- the reader ------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        raw = bytearray(frames.HEADER.size)
        try:
            while True:
                await self.channel.recv_exactly(memoryview(raw))
                header = Header.unpack(raw)
                table_raw = bytearray(header.num_segments * frames.SEGMENT.size)
                await self.channel.recv_exactly(memoryview(table_raw))
                table = frames.unpack_segments(table_raw, header.num_segments)
                if header.op == frames.OP_PUSH:
                    await self._on_push(header, table)
                elif header.op == frames.OP_READ:
                    self._on_read(header, table)
                elif header.op == frames.OP_GATHER:
                    await self._on_gather(header)
                elif header.op in (frames.OP_PUSH_ACK, frames.OP_READ_DATA):
                    await self._on_reply(header)
                else:
                    raise FrameError(f"unexpected op {header.op} on an open link")
        except (OSError, ConnectionError) as exc:
            self.fail(DataPlaneError(f"data-plane link to {self.peer} lost: {exc or 'closed'}"))
        except FrameError as exc:
            log.warning("dataplane_bad_frame", peer=self.peer, error=str(exc))
            self.fail(DataPlaneError(f"data-plane link to {self.peer} closed after a bad frame: {exc}"))
        except Exception as exc:  # e.g. an on_landed callback raising: fail the link instead of hanging waiters
            log.exception("dataplane_reader_crashed", peer=self.peer)
            self.fail(DataPlaneError(f"data-plane link to {self.peer} failed: {exc!r}"))

    async def _on_push(self, header: Header, table: list[tuple[int, int]]) -> None:
        if header.payload_len != sum(n for _, n in table):
            raise FrameError("push payload length does not match its segment table")
        grant = self.plane.grant_for(header.ticket, table)
        status = frames.STATUS_REFUSED
        if grant is None:
            await self._drain(header.payload_len)
        else:
            release = self._hold(grant)
            try:
                views = [self.plane.region[off: off + n] for off, n in table]
                await self._recv_into(views)
                if header.flags & frames.FLAG_CHECKSUM and frames.crc32c(views) != header.crc:
                    status = frames.STATUS_CORRUPT
                    self.plane.num_checksum_failures += 1
                    log.warning("dataplane_checksum_mismatch", peer=self.peer, ticket=header.ticket)
                else:
                    status = frames.STATUS_OK
                    self.plane.num_bytes_received += header.payload_len
                    grant.bytes_landed += header.payload_len
                    if grant.on_landed:
                        grant.on_landed(header.payload_len)
            finally:
                release()
        self.send(CONTROL, _Frame(Header(frames.OP_PUSH_ACK, status, header.seq, header.ticket)))

    def _on_read(self, header: Header, table: list[tuple[int, int]]) -> None:
        if header.payload_len:
            raise FrameError("a read request carries no payload")
        if sum(n for _, n in table) > CHUNK_BYTES:
            raise FrameError("a read request asks for more than one chunk")
        grant = self.plane.grant_for(header.ticket, table)
        if grant is None:
            self.send(CONTROL, _Frame(Header(frames.OP_READ_DATA, frames.STATUS_REFUSED, header.seq, header.ticket)))
            return
        release = self._hold(grant)  # NOTE: until the data has left, so the owner cannot reuse the pages under it
        payload = [self.plane.region[off: off + n] for off, n in table]
        reply = Header(frames.OP_READ_DATA, frames.STATUS_OK, header.seq, header.ticket,
                       payload_len=sum(n for _, n in table))
        self.send(frames.reply_lane(header.flags), _Frame(reply, [], payload, on_done=release))
        self.plane.num_bytes_sent += reply.payload_len

    async def _on_gather(self, header: Header) -> None:
        """A read of scattered entries: check the descriptor and the grant, then queue a reply whose payload the
        writer gathers from the region right before sending it (one `np.take`, into its stage: nothing allocated)."""
        descriptor = self.recv_stage[: header.payload_len]
        await self.channel.recv_exactly(descriptor)
        if header.flags & frames.FLAG_CHECKSUM and frames.crc32c([descriptor]) != header.crc:
            self.plane.num_checksum_failures += 1
            log.warning("dataplane_checksum_mismatch", peer=self.peer, ticket=header.ticket)
            self.send(CONTROL, _Frame(Header(frames.OP_READ_DATA, frames.STATUS_CORRUPT, header.seq, header.ticket)))
            return
        base, unit, index = frames.unpack_gather(descriptor)
        grant = self.plane.granted(header.ticket, lambda g: g.covers_entries(base, unit, index))
        if grant is None:
            self.send(CONTROL, _Frame(Header(frames.OP_READ_DATA, frames.STATUS_REFUSED, header.seq, header.ticket)))
            return
        release = self._hold(grant)  # NOTE: until the data has left, so the owner cannot reuse the pages under it
        rows = entries(self.plane.region, base, unit, int(index.max()) + 1) if index.size else None

        def fill(stage: memoryview) -> None:
            if rows is not None:
                np.take(rows, index, out=entries(stage, 0, unit, index.size), mode="clip")  # bounds checked above

        reply = Header(frames.OP_READ_DATA, frames.STATUS_OK, header.seq, header.ticket, payload_len=unit * index.size)
        self.send(frames.reply_lane(header.flags), _Frame(reply, fill=fill, on_done=release))
        self.plane.num_bytes_sent += reply.payload_len

    def _hold(self, grant: Grant) -> Callable[[], None]:
        """Count one frame on `grant`'s pages (the owner waits until none is left before reusing them); returns
        its release, to be called exactly once."""
        grant.begin_io()
        self.holding[grant.ticket] += 1

        def release() -> None:
            grant.end_io()
            self.holding[grant.ticket] -= 1
            if not self.holding[grant.ticket]:
                del self.holding[grant.ticket]
        return release

    def refuse_queued_replies(self, ticket: int) -> None:
        """The owner revoked `ticket`: its read replies that have not started are answered REFUSED instead (the
        request they served has ended), so its pages are free at once, not after whatever is queued ahead of them
        (a background reply can wait behind many pushes)."""
        def is_refused(frame: _Frame) -> bool:
            return frame.header.op == frames.OP_READ_DATA and frame.header.ticket == ticket and frame.on_done is not None

        for lane in Lane:
            queue = self.queues[lane]
            refused = [frame for frame in queue if is_refused(frame)]
            if refused:
                kept = [frame for frame in queue if not is_refused(frame)]
                queue.clear()
                queue.extend(kept)
            for frame in refused:
                frame.on_done()
                self.send(CONTROL, _Frame(Header(frames.OP_READ_DATA, frames.STATUS_REFUSED, frame.header.seq, ticket)))

    async def _on_reply(self, header: Header) -> None:
        waiting = self.waiting.pop(header.seq, None)
        if waiting is None:
            raise FrameError(f"reply for unknown seq {header.seq}")
        if waiting.background_bytes:
            self.background_in_flight -= waiting.background_bytes
            self.has_work.set()
        error: DataPlaneError | None = None
        if header.status == frames.STATUS_REFUSED:
            error = TicketRefused(f"{self.peer} refused ticket {header.ticket}: unknown, revoked, or ranges outside its grant")
        elif header.status == frames.STATUS_CORRUPT:
            error = ChecksumMismatch(f"{self.peer} received a corrupted chunk (crc32c mismatch)")
        elif header.op == frames.OP_READ_DATA and waiting.scatter is not None:
            base, unit, index = waiting.scatter
            if header.payload_len != unit * index.size:
                raise FrameError("gather reply length does not match the request")
            stage = self.recv_stage[: header.payload_len]
            await self.channel.recv_exactly(stage)
            if not frames.land_gather_reply(header, stage, self.plane.region, base, unit, index):
                self.plane.num_checksum_failures += 1
                error = ChecksumMismatch(f"a gather read from {self.peer} arrived corrupted (crc32c mismatch)")
        elif header.op == frames.OP_READ_DATA:
            if header.payload_len != sum(s.length for s in waiting.local):
                raise FrameError("read reply length does not match the request")
            views = [self.plane.region[s.dst: s.dst + s.length] for s in waiting.local]
            await self._recv_into(views)
            if header.flags & frames.FLAG_CHECKSUM and frames.crc32c(views) != header.crc:
                self.plane.num_checksum_failures += 1
                error = ChecksumMismatch(f"a chunk read from {self.peer} arrived corrupted (crc32c mismatch)")
        if not waiting.done.done():
            if error:
                waiting.done.set_exception(error)
            else:
                waiting.done.set_result(None)

    async def _drain(self, num_bytes: int) -> None:
        scratch = self.plane.scratch
        while num_bytes:
            n = min(num_bytes, len(scratch))
            await self.channel.recv_exactly(scratch[:n])
            num_bytes -= n

    # --- ending ----------------------------------------------------------------------------------
    def fail(self, error: DataPlaneError) -> None:
        """Fail every waiting request at once, release every queued frame, close the socket. Idempotent."""
        if self.error is not None:
            return
        self.error = error
        for waiting in self.waiting.values():
            if not waiting.done.done():
                waiting.done.set_exception(error)
        self.waiting.clear()
        for queue in self.queues.values():
            while queue:
                frame = queue.popleft()
                if frame.on_done:
                    frame.on_done()
        self.channel.close()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        self.plane.forget(self)
        self.plane.link_lost(self.peer, error)

    async def close(self) -> None:
        self.fail(DataPlaneError("data plane closed"))
        await asyncio.gather(*self.tasks, return_exceptions=True)

