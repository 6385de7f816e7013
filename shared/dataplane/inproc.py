"""In-process data plane: the fake for unit tests. Same contract as TCP (grants, tickets, region bounds),
memcpy instead of sockets; no lanes or pacing, since nothing queues."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from shared.dataplane.base import (DataPlane, DataPlaneError, Gather, Lane, Segment, TicketRefused, check_within,
                                   entries)

_REGISTRY: dict[str, "InProcDataPlane"] = {}
_IDS = itertools.count(1)


class InProcDataPlane(DataPlane):
    async def start(self) -> str:
        self.address = f"inproc:{next(_IDS)}"
        _REGISTRY[self.address] = self
        return self.address

    async def close(self) -> None:
        _REGISTRY.pop(self.address, None)

    def _peer(self, peer: str, ticket: int, offsets: list[tuple[int, int]]) -> "InProcDataPlane":
        target = _REGISTRY.get(peer)
        if target is None:
            raise DataPlaneError(f"no in-process data plane at {peer}")
        grant = target.grants.get(ticket)
        if grant is None or not all(grant.covers(o, n) for o, n in offsets):
            raise TicketRefused(f"{peer} refused ticket {ticket}")
        return target

    async def push(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND) -> None:
        check_within(segments, len(self.region), "src")
        target = self._peer(peer, ticket, [(s.dst, s.length) for s in segments])
        for s in segments:
            target.region[s.dst: s.dst + s.length] = self.region[s.src: s.src + s.length]
        grant = target.grants[ticket]
        total = sum(s.length for s in segments)
        grant.bytes_landed += total
        if grant.on_landed:
            grant.on_landed(total)

    async def read(self, peer: str, ticket: int, segments: Sequence[Segment], lane: Lane = Lane.ON_DEMAND,
                   whole_frames: bool = False) -> None:
        check_within(segments, len(self.region), "dst")
        target = self._peer(peer, ticket, [(s.src, s.length) for s in segments])
        for s in segments:
            self.region[s.dst: s.dst + s.length] = target.region[s.src: s.src + s.length]

    async def read_gather(self, peer: str, ticket: int, gather: Gather, lane: Lane = Lane.ON_DEMAND,
                          whole_frames: bool = False) -> None:
        gather.check_within(len(self.region))
        target = self._peer(peer, ticket, [])
        if not target.grants[ticket].covers_entries(gather.src_base, gather.unit, gather.src_index):
            raise TicketRefused(f"{peer} refused ticket {ticket}")
        if gather.src_index.size:
            source = entries(target.region, gather.src_base, gather.unit, int(gather.src_index.max()) + 1)
            landing = entries(self.region, gather.dst_base, gather.unit, int(gather.dst_index.max()) + 1)
            landing[gather.dst_index] = source[gather.src_index]
