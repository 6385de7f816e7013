"""Requests whose gateway is gone: the decode worker stops them instead of decoding on to max_tokens for nobody.

A gateway names itself in each `generate` (Generate.gateway_id) and heartbeats like every service. The decode
worker follows the gateways' heartbeats and, every `check_s`, aborts each running request whose gateway has not
been heard for `ttl_s`: the abort frees its slab, its ticket and the prefill's lease as a client's abort would.
  - The clock of a request starts when it is first seen here, so a gateway not heard yet (this worker just
    started) gets a whole TTL.
  - NOTE: cut off from NATS, this worker hears no gateway, so it judges none; back from a reconnect it waits a TTL
    for heartbeats to return (the same rule as the gateway's own liveness.py).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog
from nats.aio.client import Client

from schemas import WorkerInfo, subjects
from shared.runtime.registry import WorkerRegistry
from shared.runtime.rpc import subscriber

log = structlog.get_logger()


class GatewayWatch:
    def __init__(self, nc: Client, ttl_s: float, check_s: float):
        self.nc, self.ttl_s, self.check_s = nc, ttl_s, check_s
        self.gateways = WorkerRegistry(ttl_s)
        self.first_seen: dict[str, float] = {}  # request id → time.monotonic() this watch first saw it running
        self.told: set[str] = set()  # requests already aborted (each is aborted once)
        self.num_reconnects = 0
        self.judge_from = time.monotonic()  # no verdict until a TTL after this (start, last cut off, a reconnect)
        self._task: asyncio.Task[None] | None = None

    async def start(self, requests: Mapping[str, Any], abort: Callable[[str, str], Awaitable[Any]]) -> None:
        """Follow the gateways' heartbeats; abort, with `abort(request_id, reason)`, the requests among `requests`
        (request id → state with a `req`: its Generate, once running) whose gateway stopped."""
        async def on_heartbeat(info: WorkerInfo) -> None:
            self.gateways.update(info)

        await self.nc.subscribe(subjects.heartbeat("gateway"), cb=subscriber(WorkerInfo, on_heartbeat))
        self._task = asyncio.create_task(self._run(requests, abort))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def orphans(self, requests: Mapping[str, Any]) -> list[tuple[str, str]]:
        """(request id, gateway id) of each running request whose gateway has not been heard for the TTL."""
        now = time.monotonic()
        if not self.nc.is_connected:
            self.judge_from = now  # NOTE: heartbeats come back only after the reconnect: a TTL from then
            return []
        if self.nc.stats["reconnects"] != self.num_reconnects:
            self.num_reconnects, self.judge_from = self.nc.stats["reconnects"], now
        for rid in [rid for rid in self.first_seen if rid not in requests]:
            del self.first_seen[rid]
            self.told.discard(rid)
        found = []
        for rid, state in list(requests.items()):
            gateway_id = state.req.gateway_id if state.req is not None else ""
            if not gateway_id or rid in self.told:
                continue
            seen = self.first_seen.setdefault(rid, now)
            last = max(self.gateways.heard_at(gateway_id) or 0.0, seen, self.judge_from)
            if now - last > self.ttl_s:
                self.told.add(rid)
                found.append((rid, gateway_id))
        return found

    async def _run(self, requests: Mapping[str, Any], abort: Callable[[str, str], Awaitable[Any]]) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            for rid, gateway_id in self.orphans(requests):
                log.warning("gateway_gone", request_id=rid, gateway_id=gateway_id, ttl_s=self.ttl_s)
                try:
                    await abort(rid, f"gateway {gateway_id} stopped sending heartbeats: nobody reads the stream")
                except Exception as exc:  # the watch must outlive any one request
                    log.warning("gateway_gone_abort_failed", request_id=rid, error=str(exc))
