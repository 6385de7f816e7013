"""KV-profile service. In this build it owns the JetStream key-value bucket where positional importance
profiles live and lists what it holds; building, serving and refreshing profiles arrive with the SmartGen
work (issue 5).
"""
from __future__ import annotations

from typing import Any

import nats.js.errors
from aiohttp import web
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import ListQuery, ProfileList
from shared.rpc import endpoint
from shared.runtime import Service
from services.kvprofile.config import KvProfileConfig


class KvProfileService(Service):
    role = "kvprofile"
    config: KvProfileConfig

    def __init__(self, config: KvProfileConfig):
        super().__init__(config)
        self.kv: Any = None

    async def start(self, nc: Client, micro: MicroService) -> None:
        js = nc.jetstream()
        self.kv = await js.create_key_value(bucket=self.config.bucket, history=5)
        await self.add_endpoints(micro, list=endpoint(ListQuery, self.list))

    async def keys(self) -> list[str]:
        try:
            return sorted(await self.kv.keys())
        except nats.js.errors.NoKeysError:
            return []

    async def list(self, query: ListQuery) -> ProfileList:
        return ProfileList(self.config.bucket, [k for k in await self.keys() if k.startswith(query.prefix)])

    def is_ready(self) -> bool:
        return super().is_ready() and self.kv is not None

    def admin_routes(self) -> list[web.RouteDef]:
        async def profiles(_: web.Request) -> web.Response:
            return web.json_response({"bucket": self.config.bucket, "profiles": await self.keys()})

        return [web.get("/profiles", profiles)]

    def stats(self) -> dict[str, Any]:
        return {"bucket": self.config.bucket, "ready": self.is_ready()}
