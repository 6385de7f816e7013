"""Is what a request waits on still coming? The gateway's answer, from heartbeats and its own NATS connection.

  - A worker whose heartbeats stop for the registry's TTL is dead: the request fails at once (or, under
    failure_policy `recompute`, a dead prefill is only reported to the decode worker, which carries on).
  - While the gateway itself is cut off from NATS it hears no heartbeat, so it blames no worker; cut off
    for longer than the TTL, it fails the request. Back from a reconnect, it waits a TTL for heartbeats
    to return before judging again.
  - NOTE: what was published while the gateway was away (a reply, token events) is lost, so after a
    reconnect the worker it waits on must still list the request in its heartbeats (`request_ids`); one that
    does not, twice in a row, has finished or dropped it, and what we wait for will never come.
"""
from __future__ import annotations

import time

from nats.aio.client import Client

from schemas import WorkerInfo
from shared.registry import WorkerRegistry


class RequestFailed(RuntimeError):
    """A worker failed the request after it was admitted, or what the gateway waits for will not come."""


class Liveness:
    def __init__(self, nc: Client, registry: WorkerRegistry, request_id: str):
        self.nc, self.registry, self.request_id = nc, registry, request_id
        self.num_reconnects = nc.stats["reconnects"]
        self.reconnected_at: float | None = None  # monotonic; the last reconnect this request lived through
        self.cut_off_since: float | None = None
        self.is_suspect = False  # the last check found the awaited worker without the request

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
        """After a reconnect: raise RequestFailed if `awaited` no longer holds the request."""
        if self.reconnected_at is None or not self.nc.is_connected:
            return
        info, heard = self.registry.get(awaited.worker_id), self.registry.heard_at(awaited.worker_id)
        lacks = info is not None and heard is not None and heard > self.reconnected_at \
            and self.request_id not in info.request_ids
        if lacks and self.is_suspect:
            raise RequestFailed(f"NATS reconnected during {what} and {awaited.role} worker {awaited.worker_id} no longer "
                                "holds the request: its reply or its last tokens were lost")
        self.is_suspect = lacks
