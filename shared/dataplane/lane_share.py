"""How the sending side of a TCP link shares it between ON_DEMAND and PUSH frames (tcp_link.py's writer).

On the prefill node's side of a link, ON_DEMAND holds the replies to the reads a running request's decode step
waits on, and PUSH holds a new request's prefill push, which its step 1 waits on. Strict priority between the two
let one request's reads hold another's push off for as long as they kept coming (two requests on one R = 6.5
link at 2K: the second's TTST 6–7 s against a 1.7 s bound, docs/results/serve-2k-concurrency-link). So while
both lanes have frames queued, the push gets `push_share` of the bytes sent (by a byte-count deficit, whatever
the frames' sizes) and the reads the rest; a lane alone has the whole link. Nothing is banked: a lane that was
alone earns no credit for later. `push_share` 0 is the strict priority of before, 1 puts pushes first.
Measured (docs/results/serve-2k-concurrency-link-2026-12-06): where the two fill the link, any share only moves
the wait between the requests; 0.5 bounds both.

NOTE: pushes keep their FIFO order within the PUSH lane (decode counts a layer as landed by the bytes before it),
and CONTROL (acks) still goes first and BACKGROUND last; only the order between the two lanes here changes.
"""
from __future__ import annotations

import os

from shared.dataplane.base import Lane

# The push's share of the link while a read waits too. At 0.5 an on-demand reply of n bytes waits behind at most
# n more bytes of push (plus one chunk), and a push behind a stream of reads still moves at half the link's rate.
PUSH_SHARE = float(os.environ.get("SMARTGEN_PUSH_SHARE", "0.5"))


class LaneShare:
    def __init__(self, push_share: float = PUSH_SHARE):
        if not 0.0 <= push_share <= 1.0:
            raise ValueError(f"push_share is a share of the link, in [0, 1], not {push_share}")
        self.push_share = push_share
        self.push_owed = 0.0  # bytes: > 0, the push is behind its share and goes next

    def pick(self, on_demand_bytes: int | None, push_bytes: int | None) -> Lane | None:
        """The lane to send from next, given the payload size of the frame at the head of each (None: empty).
        The caller sends that frame."""
        if on_demand_bytes is None or push_bytes is None:
            self.push_owed = 0.0
            return Lane.ON_DEMAND if on_demand_bytes is not None else Lane.PUSH if push_bytes is not None else None
        if self.push_owed > 0:
            self.push_owed -= push_bytes * (1.0 - self.push_share)
            return Lane.PUSH
        self.push_owed += on_demand_bytes * self.push_share
        return Lane.ON_DEMAND
