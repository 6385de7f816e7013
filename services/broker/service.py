"""Transfer broker. In this build it knows the live workers (from heartbeats, so a restarted broker
rebuilds its picture within one heartbeat) and answers for them; transfer plans, leases and the
speculative queue arrive with the SmartGen work (issue 5). It never touches KV bytes.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import ListQuery, WorkerList
from shared.registry import WorkerRegistry
from shared.rpc import endpoint
from shared.runtime import Service
from services.broker.config import BrokerConfig


class BrokerService(Service):
    role = "broker"
    config: BrokerConfig

    def __init__(self, config: BrokerConfig):
        super().__init__(config)
        self.registry = WorkerRegistry(config.worker_ttl_s)
        self.transfers: dict[str, dict[str, Any]] = {}  # request_id → plan (filled from issue 5 on)

    async def start(self, nc: Client, micro: MicroService) -> None:
        await self.add_endpoints(micro, workers=endpoint(ListQuery, self.workers))
        await self.registry.follow(nc, self.worker_id)

    async def workers(self, query: ListQuery) -> WorkerList:
        return WorkerList([w for w in self.registry.alive() if w.worker_id.startswith(query.prefix)])

    def admin_routes(self) -> list[web.RouteDef]:
        async def transfers(_: web.Request) -> web.Response:
            return web.json_response({"transfers": list(self.transfers.values())})

        return [web.get("/transfers", transfers)]

    def stats(self) -> dict[str, Any]:
        alive = self.registry.alive()
        return {"workers": {role: sum(w.role == role for w in alive) for role in ("gateway", "prefill", "decode", "kvprofile")},
                "transfers_open": len(self.transfers)}
