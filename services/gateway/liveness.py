"""Is what a request waits on still coming? The gateway's answer, from heartbeats and its own NATS connection.

  - A worker whose heartbeats stop for the registry's TTL is dead: the request fails at once (or, under
    failure_policy `recompute`, a dead prefill is only reported to the decode worker, which carries on).
  - While the gateway itself is cut off from NATS it hears no heartbeat, so it blames no worker; cut off
    for longer than the TTL, it fails the request. Back from a reconnect, it waits a TTL for heartbeats
    to return before judging again.
  - NOTE: NATS core is at most once: what was published while the gateway was away, or what a NATS server that
    died had not delivered yet (a reply, token events), is lost. So the worker it waits on must list the request
    in its heartbeats (`request_ids`); one whose heartbeats, heard since anything last came from it, lack it
    twice in a row has finished or dropped it, and what we wait for will never come: EventsLost (token events
    can then be asked for again: completion.py).
"""
from __future__ import annotations

import time

from nats.aio.client import Client

from schemas import WorkerInfo
from shared.runtime.registry import WorkerRegistry


class RequestFailed(RuntimeError):
    """A worker failed the request after it was admitted, or what the gateway waits for will not come."""


class EventsLost(RequestFailed):
    """What the gateway waits for was published and lost on the way (the worker no longer holds the request)."""


class DecodeLost(RequestFailed):
    """The decode worker streaming the request stopped sending heartbeats (under failure_policy `recompute` the
    request moves to another decode worker)."""


class Liveness:
    def __init__(self, nc: Client, registry: WorkerRegistry, request_id: str):
        self.nc, self.registry, self.request_id = nc, registry, request_id
        self.num_reconnects = nc.stats["reconnects"]
        self.reconnected_at: float | None = None  # monotonic; the last reconnect this request lived through
        self.cut_off_since: float | None = None
        self.is_suspect = False  # the last check found the awaited worker without the request
        self.suspect_heard = 0.0  # the heartbeat that made it suspect (the next one must lack the request too)
        self.last_heard = time.monotonic()  # when something (a reply, a token event) last came for this request

    def heard(self) -> None:
        """Something came for the request: the worker still had it then."""
        self.last_heard, self.is_suspect = time.monotonic(), False

    def dead(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        """The workers among `workers` whose heartbeats stopped; [] while this gateway cannot judge. Raises
        RequestFailed once the gateway has been cut off from NATS for longer than the TTL."""
        now, ttl = time.monotonic(), self.registry.ttl_s
        if not self.nc.is_connected:
            self.cut_off_since = self.cut_off_since or now
            if now - self.cut_off_since > ttl:
                raise RequestFailed(f"the gateway lost its NATS connection for more than {ttl:g} s")
            return []
        self.cut_off_since = None
        if self.nc.stats["reconnects"] != self.num_reconnects:
            self.num_reconnects, self.reconnected_at = self.nc.stats["reconnects"], now
        if self.reconnected_at is not None and now - self.reconnected_at <= ttl:
            return []  # heartbeats are only coming back
        return [w for w in workers if not self.registry.is_alive(w.worker_id)]

    def check_not_lost(self, awaited: WorkerInfo, what: str) -> None:
        """Raise EventsLost if `awaited` no longer holds the request (two heartbeats heard since anything last
        came, and since this gateway's last reconnect, lack it)."""
        if not self.nc.is_connected:
            return
        info, heard = self.registry.get(awaited.worker_id), self.registry.heard_at(awaited.worker_id)
        since = max(self.last_heard, self.reconnected_at or 0.0)
        lacks = info is not None and heard is not None and heard > since and self.request_id not in info.request_ids
        if lacks and self.is_suspect and heard != self.suspect_heard:
            raise EventsLost(f"{awaited.role} worker {awaited.worker_id} no longer holds the request during {what}: "
                             "its reply or its last tokens were lost on the way (NATS reconnected, or a server died)")
        if lacks and not self.is_suspect:
            self.is_suspect, self.suspect_heard = True, heard
        elif not lacks:
            self.is_suspect = False
