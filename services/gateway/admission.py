"""The gateway's admission queue: how many requests run at once, and who waits, in order, when that is all.

- Capacity is what the decode workers say they take (`WorkerInfo.max_requests`, summed over the live ones), or
  the gateway's `max_running` where set. While fewer requests run, a new one starts at once.
- Beyond it a request waits in one FIFO (a freed slot goes to the longest waiter) for up to `queue_timeout_s`;
  it then gets a 503 with Retry-After. When `max_waiting` requests already wait, a new one gets a 429 with
  Retry-After at once. A client that leaves while waiting leaves the queue.
- With no decode worker registered (capacity 0) nothing waits here: the request goes on and gets the 503 that
  names the missing role.
- Queue time is measured (`smartgen_queue_seconds`, and `queue_s` in each response) and the running and
  waiting counts are gauges.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from services.gateway.requests import ApiError
from shared.runtime.metrics import Registry

RECHECK_S = 0.5  # a waiter looks at the capacity again this often (a decode worker may have joined)


class Admission:
    def __init__(self, capacity: Callable[[], int], max_waiting: int, queue_timeout_s: float, metrics: Registry):
        self.capacity, self.max_waiting, self.queue_timeout_s = capacity, max_waiting, queue_timeout_s
        self.running = 0
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.queue_seconds = metrics.histogram("smartgen_queue_seconds", "Time requests waited in the admission queue")
        metrics.gauge("smartgen_requests_running", "Requests admitted and not finished", lambda: float(self.running))
        metrics.gauge("smartgen_requests_waiting", "Requests waiting in the admission queue", lambda: float(len(self.waiting)))

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold one running slot for the body; yields the seconds spent waiting for it. ApiError 429 (queue full)
        or 503 (waited `queue_timeout_s`) when there is none."""
        started = time.monotonic()
        capacity = self.capacity()
        if capacity > 0 and (self.running >= capacity or self.waiting):
            await self._wait(started)
        else:
            self.running += 1
        waited = time.monotonic() - started
        self.queue_seconds.observe(waited)
        try:
            yield waited
        finally:
            self.running -= 1
            self._admit()

    async def _wait(self, started: float) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise ApiError(429, f"the server is at capacity ({self.running} running, {len(self.waiting)} waiting); "
                                "try again shortly", code="overloaded", retry_after_s=1)
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            while not turn.done():
                left = self.queue_timeout_s - (time.monotonic() - started)
                if left <= 0:
                    raise ApiError(503, f"waited {self.queue_timeout_s:g} s in the admission queue without a free "
                                        f"slot ({self.running} running); try again later", code="queue_timeout",
                                   retry_after_s=max(1, round(self.queue_timeout_s / 4)))
                await asyncio.wait([turn], timeout=min(left, RECHECK_S))
                self._admit()  # NOTE: the capacity may have grown (a decode worker joined) with no slot freed
        except BaseException:
            if turn in self.waiting:
                self.waiting.remove(turn)
            elif turn.done() and not turn.cancelled():  # admitted just as it gave up: pass the slot on
                self.running -= 1
                self._admit()
            raise

    def _admit(self) -> None:
        """Give free slots to the longest waiters."""
        capacity = self.capacity()
        while self.waiting and (capacity <= 0 or self.running < capacity):
            turn = self.waiting.popleft()
            if not turn.done():
                self.running += 1
                turn.set_result(None)
