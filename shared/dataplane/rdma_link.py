"""One RDMA queue pair toward a peer (rdma.py's RdmaDataPlane owns them): its lanes, and the pump that posts their
chunks by strict priority through the link's Pacer, keeping at most MAX_POSTED_BYTES and SEND_QUEUE_DEPTH work
requests outstanding. Completions come back through the plane's poller (`completed`)."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.dataplane.base import DataPlaneError, Lane
from shared.dataplane.pacing import Pacer

if TYPE_CHECKING:
    from shared.dataplane.rdma import RdmaDataPlane

CHUNK_BYTES = 256 << 10
MAX_POSTED_BYTES = 4 * CHUNK_BYTES  # per link: what may sit in the send queue ahead of an urgent chunk
SEND_QUEUE_DEPTH = 512


@dataclass
class _Pending:
    done: asyncio.Future[None]
    what: str


@dataclass
class _Chunk:
    """The work requests of one chunk, posted together."""

    wrs: list  # pyverbs SendWR
    num_bytes: int
    done: list[asyncio.Future[None]] = field(default_factory=list)
    wr_ids: list[int] = field(default_factory=list)


class _Link:
    def __init__(self, plane: "RdmaDataPlane", peer: str, qp, remote: dict):
        self.plane, self.peer, self.qp, self.remote = plane, peer, qp, remote
        self.queues: dict[Lane, deque[_Chunk]] = {lane: deque() for lane in Lane}
        self.has_work = asyncio.Event()
        self.posted_bytes = 0
        self.posted_wrs = 0  # NOTE: capped like the bytes: a post beyond the send queue's depth fails the link
        self.pacer = Pacer(plane.link_gbps)
        self.error: DataPlaneError | None = None
        self.pump = asyncio.create_task(self._pump())

    def submit(self, lane: Lane, chunk: _Chunk) -> None:
        if self.error:
            raise self.error
        self.queues[lane].append(chunk)
        self.has_work.set()

    async def _pump(self) -> None:
        """Post chunks by strict priority, keeping at most MAX_POSTED_BYTES outstanding on the queue pair."""
        while True:
            lane = self._next_lane()
            if lane is None:
                self.has_work.clear()
                await self.has_work.wait()
                continue
            chunk = self.queues[lane].popleft()
            if all(f.done() for f in chunk.done):  # its transfer was abandoned (cancelled or timed out)
                for wr_id in chunk.wr_ids:
                    self.plane.forget_pending(wr_id)
                continue  # never post it: its destination may already belong to another request
            await self.pacer.wait(chunk.num_bytes)
            if self.error:
                for f in chunk.done:
                    if not f.done():
                        f.set_exception(self.error)
                continue
            self.posted_bytes += chunk.num_bytes
            self.posted_wrs += len(chunk.wrs)
            stats = self.plane.lane_stats[lane]
            stats["bytes"] += chunk.num_bytes
            stats["chunks"] += 1
            try:
                for wr in chunk.wrs:
                    self.qp.post_send(wr, None)
            except Exception as exc:
                self.plane.fail_link(self, DataPlaneError(f"posting to {self.peer} failed: {exc}"))
            self.plane.wake_poller()

    def _next_lane(self) -> Lane | None:
        for lane in Lane:  # strict priority: lower value first
            queue = self.queues[lane]
            if not queue or (lane == Lane.BACKGROUND and self.plane.is_background_paused):
                continue
            if self.posted_wrs and (self.posted_bytes + queue[0].num_bytes > MAX_POSTED_BYTES
                                    or self.posted_wrs + len(queue[0].wrs) > SEND_QUEUE_DEPTH):
                return None  # wait for completions; they wake us
            return lane
        return None

    def completed(self, num_bytes: int) -> None:
        """One work request completed (each is signalled)."""
        self.posted_bytes -= num_bytes
        self.posted_wrs -= 1
        self.has_work.set()
