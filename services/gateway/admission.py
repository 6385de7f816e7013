"""The gateway's admission queue: how many requests run at once and wait, how many of each one client may hold,
and who gets a freed slot.

- Capacity is what the decode workers say they take (`WorkerInfo.max_requests`, summed over the live ones), or
  the gateway's `max_running` where set. While fewer requests run, a new one starts at once, unless its client
  already runs `max_running_per_client` (default half the capacity, at least 1; 0 = no cap).
- A client is who sent the request (`client_of`): the peer's IP address, or with `trust_forwarded_for` the address
  the gateway's own proxy saw. NOTE: the gateway has one API key, shared by everyone who has it, so the key tells
  no client apart.
- Beyond that a request waits, in its client's FIFO. A freed slot goes to the longest waiter of the client that
  runs the fewest requests, among the clients under their cap (ties: the longest waiter): clients take turns, so
  one that sends many requests, or holds slots with streams it never reads, cannot starve the others. A request
  waits for up to `queue_timeout_s`, then gets a 503 with Retry-After. When `max_waiting` requests already wait
  (all clients together), a new one gets a 429 with Retry-After at once, and so does one whose client already has
  `max_waiting_per_client` waiting (default half of `max_waiting`, at least 1; 0 = no cap): one client cannot fill
  the queue and turn every other client away. A client that leaves while waiting leaves the queue.
- With no decode worker registered (capacity 0) nothing waits here: the request goes on and gets the 503 that
  names the missing role.
- Queue time is measured (`smartgen_queue_seconds`, and `queue_s` in each response); the running and waiting
  counts are gauges, and so are the waiters held back only by their client's cap and the most places one client
  holds in the queue.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from services.gateway.requests import ApiError
from shared.runtime.metrics import Registry

RECHECK_S = 0.5  # a waiter looks at the capacity again this often (a decode worker may have joined)
HALF_THE_CAPACITY = -1  # max_running_per_client's default: half the capacity, at least 1
HALF_THE_QUEUE = -1  # max_waiting_per_client's default: half of max_waiting, at least 1
NO_CAP = 0


def client_of(remote: str | None, forwarded_for: str | None, trust_forwarded_for: bool) -> str:
    """Who sent a request: the peer's address (`remote`), or, when the gateway sits behind a proxy that it trusts,
    the last address of that proxy's X-Forwarded-For (the client the proxy saw; earlier entries are whatever the
    client itself claimed)."""
    if trust_forwarded_for and forwarded_for and (last := forwarded_for.rsplit(",", 1)[-1].strip()):
        return last
    return remote or "unknown"


@dataclass(slots=True, eq=False)
class Waiter:
    client: str
    since_s: float  # time.monotonic() at arrival
    turn: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(slots=True, eq=False)
class Slot:
    """A running slot held by one request: `release` gives it back before the holder's block ends (a stream whose
    generation is over while its text is still being written to a slow reader), at most once."""

    waited_s: float  # seconds spent in the queue for it
    release: Callable[[], None]


class Admission:
    def __init__(self, capacity: Callable[[], int], max_waiting: int, queue_timeout_s: float, metrics: Registry,
                 max_running_per_client: int = HALF_THE_CAPACITY, max_waiting_per_client: int = HALF_THE_QUEUE):
        self.capacity, self.max_waiting, self.queue_timeout_s = capacity, max_waiting, queue_timeout_s
        self.max_running_per_client = max_running_per_client
        self.client_waiting_cap = (max(1, max_waiting // 2) if max_waiting_per_client == HALF_THE_QUEUE else
                                   float("inf") if max_waiting_per_client == NO_CAP else max_waiting_per_client)
        self.running = 0
        self.running_by_client: dict[str, int] = {}  # only clients running ≥ 1
        self.waiting: dict[str, deque[Waiter]] = {}  # client → its waiters, longest first; only non-empty ones
        self.queue_seconds = metrics.histogram("smartgen_queue_seconds", "Time requests waited in the admission queue")
        metrics.gauge("smartgen_requests_running", "Requests admitted and not finished", lambda: float(self.running))
        metrics.gauge("smartgen_requests_waiting", "Requests waiting in the admission queue",
                      lambda: float(self.num_waiting))
        metrics.gauge("smartgen_requests_waiting_client_cap", "Of the waiting requests, those whose client runs its "
                      "max_running_per_client (they would wait with free capacity too)",
                      lambda: float(self.num_waiting_at_cap()))
        metrics.gauge("smartgen_requests_waiting_client_max", "The most waiting requests one client has (at most "
                      "max_waiting_per_client)", lambda: float(self.most_waiting_of_one_client()))

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.waiting.values())

    def client_cap(self, capacity: int) -> float:
        """The most requests one client may run at once with this capacity."""
        if capacity <= 0 or self.max_running_per_client == NO_CAP:
            return float("inf")
        if self.max_running_per_client == HALF_THE_CAPACITY:
            return max(1, capacity // 2)
        return self.max_running_per_client

    def running_of(self, client: str) -> int:
        return self.running_by_client.get(client, 0)

    def most_waiting_of_one_client(self) -> int:
        return max((len(queue) for queue in self.waiting.values()), default=0)

    def num_waiting_at_cap(self) -> int:
        cap = self.client_cap(self.capacity())
        return sum(len(queue) for client, queue in self.waiting.items() if self.running_of(client) >= cap)

    @asynccontextmanager
    async def slot(self, client: str = "") -> AsyncIterator[Slot]:
        """Hold one running slot for `client` for the body (or until its `release`); yields it, with the seconds
        spent waiting for it. ApiError 429 (queue full) or 503 (waited `queue_timeout_s`) when there is none."""
        started = time.monotonic()
        if self.capacity() > 0:
            await self._wait(Waiter(client, started))
        else:  # no decode worker: the request goes on to its 503
            self._start(client)
        waited = time.monotonic() - started
        self.queue_seconds.observe(waited)
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._finish(client)
                self._admit()

        try:
            yield Slot(waited, release)
        finally:
            release()

    async def _wait(self, waiter: Waiter) -> None:
        self.waiting.setdefault(waiter.client, deque()).append(waiter)
        self._admit()
        if waiter.turn.done():  # a free slot, and its client under its cap
            return
        if self.num_waiting > self.max_waiting:
            self._leave_queue(waiter)
            raise ApiError(429, f"the server is at capacity ({self.running} running, {self.num_waiting} waiting); "
                                "try again shortly", code="overloaded", retry_after_s=1)
        if len(self.waiting[waiter.client]) > self.client_waiting_cap:  # room in the queue, not for this client
            self._leave_queue(waiter)
            raise ApiError(429, f"your client already has {self.client_waiting_cap:g} requests waiting, the most one "
                                "client may (max_waiting_per_client); try again when one has started",
                           code="client_queue_full", retry_after_s=1)
        try:
            while not waiter.turn.done():
                left = self.queue_timeout_s - (time.monotonic() - waiter.since_s)
                if left <= 0:
                    raise self._timed_out(waiter.client)
                await asyncio.wait([waiter.turn], timeout=min(left, RECHECK_S))
                self._admit()  # NOTE: the capacity may have grown (a decode worker joined) with no slot freed
        except BaseException:
            if not waiter.turn.done():
                self._leave_queue(waiter)
            else:  # admitted just as it gave up: pass the slot on
                self._finish(waiter.client)
                self._admit()
            raise

    def _timed_out(self, client: str) -> ApiError:
        cap = self.client_cap(self.capacity())
        why = (f"your client already runs {self.running_of(client)}, the most one client may "
               "(max_running_per_client)") if self.running_of(client) >= cap else f"{self.running} running"
        return ApiError(503, f"waited {self.queue_timeout_s:g} s in the admission queue without a free slot ({why}); "
                             "try again later", code="queue_timeout", retry_after_s=max(1, round(self.queue_timeout_s / 4)))

    def _admit(self) -> None:
        """Give free slots to waiters: each to the longest waiter of the client running the fewest requests, among
        the clients under their cap."""
        capacity = self.capacity()
        cap = self.client_cap(capacity)
        while capacity <= 0 or self.running < capacity:
            heads = [queue[0] for client, queue in self.waiting.items() if self.running_of(client) < cap]
            if not heads:
                return
            waiter = min(heads, key=lambda w: (self.running_of(w.client), w.since_s))
            self._leave_queue(waiter)
            self._start(waiter.client)
            waiter.turn.set_result(None)

    def _leave_queue(self, waiter: Waiter) -> None:
        queue = self.waiting[waiter.client]
        queue.remove(waiter)
        if not queue:
            del self.waiting[waiter.client]

    def _start(self, client: str) -> None:
        self.running += 1
        self.running_by_client[client] = self.running_of(client) + 1

    def _finish(self, client: str) -> None:
        self.running -= 1
        self.running_by_client[client] -= 1
        if not self.running_by_client[client]:
            del self.running_by_client[client]
