"""The data-plane contract. Implementations: tcp.py (reference), rdma.py (pyverbs), inproc.py (fake).

Vocabulary:
- region: the one memoryview a process registers (its KvStore's pages). Offsets are bytes into it.
- grant: the owner of a region says "ticket T may write (push) or read these byte ranges".
  Anything outside a grant is refused: a ticket is the only key to a request's KV.
- segment: (src offset, dst offset, length); `push` copies local src → peer dst, `read` copies peer src → local dst.
- gather: many scattered entries of one size (`Gather`), read with one descriptor instead of one segment each:
  token-level KV selections name thousands of single-token entries a step.
- lane: the sending side of every link serves ON_DEMAND and PUSH before BACKGROUND, one chunk at a time,
  so an urgent transfer never waits behind more than one background chunk; between ON_DEMAND and PUSH, TCP
  shares the link while both wait (lane_share.py), RDMA serves ON_DEMAND first.
- link lost: a connection to a peer failed; every transfer on it has failed, and `on_link_lost` (if set)
  hears the peer's address, so a service waiting on bytes from that peer can stop waiting at once.
- faults: test-only switches (`Faults`) that a transport honours to let fault-injection tests break it.
"""
from __future__ import annotations

import abc
import asyncio
import bisect
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import structlog

log = structlog.get_logger()


class Lane(IntEnum):
    """Priority of a transfer on the sending side of a link (lower value goes first)."""

    ON_DEMAND = 1  # what a decode step is waiting on now: on-demand reads
    PUSH = 2  # full, quantized and proactive pushes during prefill: on TCP they share the link with on-demand
    #           reads while both wait (lane_share.py), so neither starves the other (a read may ask for it too)
    BACKGROUND = 3  # speculative transfer of what remains; preemptible, can be paused


class DataPlaneError(RuntimeError):
    """A transfer failed (connection lost, peer refused, bad frame, corrupted bytes)."""


class TicketRefused(DataPlaneError):
    """The peer does not know the ticket or the ranges fall outside its grant."""


class ChecksumMismatch(DataPlaneError):
    """A chunk arrived with bytes that do not match its checksum."""


@dataclass
class Faults:
    """Fault injection for tests (`POST /fault` on a model worker started with SMARTGEN_FAULT_INJECTION=1).
    TCP honours every switch; other transports ignore them."""

    corrupt_frames: int = 0  # flip a byte in the payload of the next N data frames this process sends
    refuse_tickets: bool = False  # refuse every incoming push and read as if its ticket were unknown
    delay_s: float = 0.0  # hold every data frame this process sends this long before sending it
    delay_lanes: list[str] = field(default_factory=list)  # … on these lanes only (Lane names, lower case); [] = all
    prefill_delay_s: float = 0.0  # a prefill worker holds each prompt this long before computing it (alive, busy)
    open_delay_s: float = 0.0  # a decode worker holds each `open` this long after reserving, before it answers
    prefix_insert_delay_s: float = 0.0  # a prefill worker's prefix cache insertion takes this much longer

    def maybe_corrupt(self, payload: list[memoryview]) -> list[memoryview]:
        """`payload`, or a corrupted copy of it if a corruption is due (the region itself is never touched)."""
        if not (self.corrupt_frames and payload):
            return payload
        self.corrupt_frames -= 1
        first = bytearray(payload[0])
        first[0] ^= 0xFF
        return [memoryview(first), *payload[1:]]

    def delay_for(self, lane: Lane) -> float:
        """How long a data frame on `lane` is held before it is sent."""
        return self.delay_s if not self.delay_lanes or lane.name.lower() in self.delay_lanes else 0.0

    def summary(self) -> dict[str, object]:
        return {"corrupt_frames": self.corrupt_frames, "refuse_tickets": self.refuse_tickets, "delay_s": self.delay_s,
                "delay_lanes": list(self.delay_lanes), "prefill_delay_s": self.prefill_delay_s,
                "open_delay_s": self.open_delay_s, "prefix_insert_delay_s": self.prefix_insert_delay_s}


def check_within(segments: Sequence["Segment"], region_len: int, side: str) -> None:
    """Raise DataPlaneError if a segment's local (`src` or `dst`) range falls outside the region."""
    for s in segments:
        offset = s.src if side == "src" else s.dst
        if s.length <= 0 or offset < 0 or offset + s.length > region_len:
            raise DataPlaneError(f"segment {side}={offset} length={s.length} is outside the registered region "
                                 f"of {region_len} bytes")


@dataclass(frozen=True, slots=True)
class Segment:
    src: int  # byte offset in the source region
    dst: int  # byte offset in the destination region
    length: int  # bytes


@dataclass(slots=True)
class Grant:
    """What one ticket may touch in this process's region, and what has landed under it."""

    ticket: int
    ranges: list[tuple[int, int]]  # sorted, non-overlapping (start, end) byte ranges
    on_landed: Callable[[int], None] | None = None  # called with the byte count of each completed push
    bytes_landed: int = 0
    num_busy: int = 0  # frames under this ticket being received or sent right now
    _starts: list[int] = field(default_factory=list)
    _bounds: np.ndarray = field(default_factory=lambda: np.zeros((2, 0), np.int64))  # (start|end, range) bytes
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.ranges = _merge(self.ranges)
        self._starts = [s for s, _ in self.ranges]
        self._bounds = np.array(self.ranges, np.int64).reshape(-1, 2).T
        self._idle.set()

    def begin_io(self) -> None:
        self.num_busy += 1
        self._idle.clear()

    def end_io(self) -> None:
        self.num_busy -= 1
        if self.num_busy == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """NOTE: after `revoke`, wait for this before reusing the pages: a frame that started under the
        ticket may still be writing into them."""
        await self._idle.wait()

    def covers(self, offset: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, offset) - 1
        return i >= 0 and offset + length <= self.ranges[i][1] and length >= 0

    def covers_entries(self, base: int, unit: int, index: np.ndarray) -> bool:
        """`covers` for every entry of a gather: `unit` bytes at `base + index[i] * unit` (vectorized)."""
        starts = base + index.astype(np.int64) * unit
        at = np.searchsorted(self._bounds[0], starts, side="right") - 1
        return bool(index.size == 0 or (at.min() >= 0 and (starts + unit <= self._bounds[1][at]).all()))


def _merge(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def split_into_chunks(segments: Sequence[Segment], chunk_bytes: int) -> list[list[Segment]]:
    """Cut a scatter-gather list into frames of at most `chunk_bytes` payload, splitting segments as needed."""
    chunks: list[list[Segment]] = [[]]
    room = chunk_bytes
    for seg in segments:
        src, dst, left = seg.src, seg.dst, seg.length
        while left:
            if room == 0:
                chunks.append([])
                room = chunk_bytes
            n = min(left, room)
            chunks[-1].append(Segment(src, dst, n))
            src, dst, left, room = src + n, dst + n, left - n, room - n
    return [c for c in chunks if c]


@dataclass(frozen=True, slots=True)
class Gather:
    """Scattered entries of `unit` bytes each: entry i is at `src_base + src_index[i] * unit` in the peer's region
    and lands at `dst_base + dst_index[i] * unit` in ours. For the KV slab: unit = one token of one head's K or
    V, base = a layer's first row, index = row * capacity + token."""

    src_base: int  # bytes
    dst_base: int  # bytes
    unit: int  # bytes per entry
    src_index: np.ndarray  # (n,) int64, ≥ 0, in units from src_base
    dst_index: np.ndarray  # (n,) int64, ≥ 0, in units from dst_base; no two alike

    @property
    def num_bytes(self) -> int:
        return self.unit * self.src_index.size

    def check_within(self, region_len: int) -> None:
        """DataPlaneError if a destination entry falls outside the local region (checked before anything is sent)."""
        if self.dst_index.size and (self.dst_index.min() < 0 or self.dst_base < 0 or self.unit <= 0 or
                                    self.dst_base + (int(self.dst_index.max()) + 1) * self.unit > region_len):
            raise DataPlaneError(f"a gather's destination entries fall outside the registered region of "
                                 f"{region_len} bytes")

    def segments(self) -> list[Segment]:
        """The same bytes as segments: one per run of entries consecutive on both sides (transports without a
        gather of their own, such as RDMA, whose one-sided READ takes one remote address per work request)."""
        src, dst, unit = self.src_index, self.dst_index, self.unit
        if not src.size:
            return []
        breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
        firsts, ends = np.r_[0, breaks], np.r_[breaks, src.size]
        return [Segment(self.src_base + int(src[a]) * unit, self.dst_base + int(dst[a]) * unit, (b - a) * unit)
                for a, b in zip(firsts.tolist(), ends.tolist())]


def entries(buffer: memoryview, base: int, unit: int, count: int) -> np.ndarray:
    """`count` entries of `unit` bytes from byte `base` of `buffer`: a 1-D np.void view (no copy), so one fancy
    index moves whole entries."""
    return np.frombuffer(buffer, np.uint8, count * unit, base).view(np.dtype((np.void, unit)))


class DataPlane(abc.ABC):
    """One per process. Both roles use the same object: it serves its region and calls peers.

    Implementations keep their per-peer links in `links`; each link has `has_work` (an asyncio.Event that
    wakes its sender) and `pacer`, which is all the lane and pacing controls below need.
    """

    address: str = ""  # what peers connect to; advertised over NATS

    def __init__(self, link_gbps: float = 0.0):
        self.region = memoryview(bytearray(0))
        self.grants: dict[int, Grant] = {}
        self.links: dict[str, Any] = {}
        self.link_gbps = link_gbps
        self.is_background_paused = False
        self.faults = Faults()
        # Called with (peer address, error) when a link to that peer fails; the owner of the process sets it.
        self.on_link_lost: Callable[[str, DataPlaneError], None] | None = None

    def register_region(self, region: memoryview) -> None:
        """Register the process's KV buffer. Called once, before `start`."""
        self.region = region.cast("B") if region.format != "B" else region

    @abc.abstractmethod
    async def start(self) -> str:
        """Start serving the region; returns `address`."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop serving and close every connection. Pending transfers fail with DataPlaneError."""

    def grant(self, grant: Grant) -> None:
        """Owner side: let `grant.ticket` touch `grant.ranges` of the registered region."""
        if grant.ranges and (grant.ranges[0][0] < 0 or grant.ranges[-1][1] > len(self.region)):
            raise ValueError("a grant must lie inside the registered region")
        self.grants[grant.ticket] = grant

    def revoke(self, ticket: int) -> Grant | None:
        """Owner side: forget a ticket; later frames under it are refused. Idempotent.
        Returns the grant so the caller can `await grant.wait_idle()` before reusing its pages."""
        return self.grants.pop(ticket, None)

    async def retire(self, ticket: int, timeout_s: float) -> None:
        """Owner side, before its pages are reused: revoke the ticket and wait until no frame touches them.
        A frame still on them after `timeout_s` (a peer that stopped reading) has its link cut, which ends it;
        DataPlaneError if even that does not free them (the pages must then stay unused: a leak, but a loud one)."""
        grant = self.revoke(ticket)
        if grant is None:
            return
        try:
            # NOTE: not wait_for (here and below), which on Python 3.11 returns, dropping the cancellation, when the
            # caller (a request's task, aborted) is cancelled as the pages go idle: the request went on
            async with asyncio.timeout(timeout_s):
                await grant.wait_idle()
            return
        except TimeoutError:
            pass
        cut = self.cut_links_holding(ticket, f"held revoked ticket {ticket} past {timeout_s:g} s")
        log.warning("dataplane_retire_cut", ticket=ticket, timeout_s=timeout_s, links_cut=cut, busy=grant.num_busy)
        try:
            async with asyncio.timeout(timeout_s):
                await grant.wait_idle()
        except TimeoutError:
            raise DataPlaneError(f"ticket {ticket} still has {grant.num_busy} frame(s) on its pages "
                                 f"{2 * timeout_s:g} s after it was revoked") from None

    def cut_links_holding(self, ticket: int, reason: str) -> int:
        """Fail the links with a frame under `ticket` in progress. Transports whose frames cannot hang on the
        owner's side (the owner takes no part in a one-sided RDMA read; the in-process fake) cut nothing."""
        return 0

    @abc.abstractmethod
    async def push(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND) -> None:
        """Caller side: copy local `src` ranges into the peer's `dst` ranges. Returns when the peer has them
        (checksums verified); raises DataPlaneError otherwise."""

    @abc.abstractmethod
    async def read(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND,
                   whole_frames: bool = False) -> None:
        """Caller side: copy the peer's `src` ranges into local `dst` ranges; the data comes back on `lane`
        (on-demand fetches, or speculative background transfer). Returns when they have landed and verified;
        raises DataPlaneError otherwise. `whole_frames`: a hint that no urgent reply will queue behind these
        replies, so they may come in a few large frames rather than the paced link's small ones (TCP only:
        `TcpDataPlane._read_frame_bytes`; the others ignore it)."""

    async def read_gather(self, peer: str, ticket: int, gather: Gather, lane: Lane = Lane.ON_DEMAND,
                          whole_frames: bool = False) -> None:
        """`read` for scattered entries of one size, named by one descriptor (TCP: one frame per chunk, gathered
        by the owner with one `np.take`). This fallback reads them as segments, one per run."""
        gather.check_within(len(self.region))
        segments = gather.segments()
        if segments:
            await self.read(peer, ticket, segments, lane)

    def link_lost(self, peer: str, error: DataPlaneError) -> None:
        """Implementations call this once per failed link, after failing its transfers."""
        if self.on_link_lost is not None:
            self.on_link_lost(peer, error)

    def cut_links(self, reason: str = "cut by fault injection", peer: str | None = None) -> int:
        """Fail every open link (or those to `peer`) now, as a lost connection would: transfers on them fail,
        later ones dial again. For fault injection, and to stop reads from a peer known to be gone. Returns how
        many were cut. Transports that cannot do it raise NotImplementedError."""
        raise NotImplementedError(f"{type(self).__name__} cannot cut its links")

    def apply_faults(self) -> None:
        """`faults` changed: pass them on to where the frames are sent (the transfer agent's process)."""

    def pause_background(self) -> None:
        """Stop starting BACKGROUND chunks on every link (ON_DEMAND goes on). Idempotent."""
        self.is_background_paused = True

    def resume_background(self) -> None:
        """Undo `pause_background`."""
        self.is_background_paused = False
        for link in self.links.values():
            link.has_work.set()

    def set_link_gbps(self, gbps: float) -> None:
        """Pace every link of this process to `gbps` (10⁹ bit/s; 0 = unpaced)."""
        self.link_gbps = gbps
        for link in self.links.values():
            link.pacer.set_gbps(gbps)

    def send_rate_gbps(self) -> float:
        """The rate this process's data lanes achieved while they were sending (bytes / busy time, paced or
        not), 10⁹ bit/s; 0.0 before anything was sent or where the transport cannot tell."""
        return 0.0

    def stats(self) -> dict[str, object]:
        return {}
