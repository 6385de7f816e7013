"""Which workers are alive, from their heartbeats, and which one gets the next request."""
from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import structlog
from nats.aio.client import Client

from schemas import Discover, WorkerInfo, encode, subjects
from shared.runtime.rpc import subscriber

log = structlog.get_logger()


@dataclass
class _Entry:
    info: WorkerInfo
    seen: float  # time.monotonic() of the last heartbeat
    num_assigned: int = 0  # requests this gateway sent since that heartbeat (heartbeats lag)


class WorkerRegistry:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._workers: dict[str, _Entry] = {}

    async def follow(self, nc: Client, asker: str, on_info: Callable[[WorkerInfo], None] | None = None) -> None:
        """Keep this registry current from every service's heartbeats, and ask for one from each now.
        `on_info` sees every heartbeat too (the broker reads plan registrations from them)."""

        async def on_heartbeat(info: WorkerInfo) -> None:
            if not (subjects.is_token(info.role) and subjects.is_token(info.worker_id)):  # both go into subjects
                log.warning("bad_heartbeat", worker_id=info.worker_id[:64], error="role and worker_id must be subject tokens")
                return
            self.update(info)
            if on_info is not None:
                on_info(info)

        await nc.subscribe(subjects.HEARTBEATS, cb=subscriber(WorkerInfo, on_heartbeat))
        await nc.publish(subjects.DISCOVER, encode(Discover(asker)))

    def update(self, info: WorkerInfo) -> None:
        self._workers[info.worker_id] = _Entry(info, time.monotonic())

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        now = time.monotonic()
        for wid in [w for w, e in self._workers.items() if now - e.seen > self.ttl_s]:
            del self._workers[wid]
        return [e.info for e in self._workers.values() if role is None or e.info.role == role]

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers[worker_id].info if self.is_alive(worker_id) else None

    def heard_at(self, worker_id: str) -> float | None:
        """time.monotonic() of the worker's last heartbeat (None if never heard or dropped)."""
        entry = self._workers.get(worker_id)
        return entry.seen if entry is not None else None

    def is_alive(self, worker_id: str) -> bool:
        entry = self._workers.get(worker_id)
        return entry is not None and time.monotonic() - entry.seen <= self.ttl_s

    def pick(self, role: str, exclude: Collection[str] = (), cached: Mapping[str, int] | None = None,
             slack: int = 0) -> WorkerInfo | None:
        """The least loaded live worker of `role` (active requests + what we sent since its heartbeat), leaving
        out the worker ids in `exclude` (those that just refused). With `cached` (worker id → prompt tokens it
        holds cached), the one holding the most, among those running at most `slack` more than the least loaded."""
        candidates = [w for w in self.alive(role) if w.worker_id not in exclude and not w.draining]
        if not candidates:
            return None
        load = {w.worker_id: w.active_requests + self._workers[w.worker_id].num_assigned for w in candidates}
        cached, least = cached or {}, min(load.values())
        best = min(candidates, key=lambda w: (load[w.worker_id] > least + slack, -cached.get(w.worker_id, 0),
                                              load[w.worker_id], w.worker_id))
        self._workers[best.worker_id].num_assigned += 1
        return best
