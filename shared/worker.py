"""What prefill and decode services share: the model on its own torch thread, the page store,
the data plane, and the numbers every model worker reports (`/stats`, heartbeats)."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import structlog
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from shared.config import ModelWorkerConfig
from shared.dataplane import DataPlane, make_dataplane
from shared.kvstore import KvStore
from shared.metrics import LatencyMetrics
from shared.modeling import ModelRunner, set_torch_threads
from shared.models import resolve_model
from shared.runtime import Service

T = TypeVar("T")
log = structlog.get_logger()


class ModelWorkerService(Service):
    config: ModelWorkerConfig

    def __init__(self, config: ModelWorkerConfig):
        super().__init__(config)
        # NOTE: every torch call runs on this one thread; handlers never call torch directly.
        self.torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        self.runner: ModelRunner | None = None
        self.store: KvStore | None = None
        self.dataplane: DataPlane | None = None
        self.latency = LatencyMetrics(self.metrics)
        self.active: dict[str, Any] = {}  # request_id → per-request state (each service defines it)
        self.metrics.gauge("smartgen_kv_pages_in_use", "KV pages held by requests",
                           lambda: self.store.num_pages_in_use if self.store else 0)
        self.metrics.gauge("smartgen_active_requests", "Requests in progress", lambda: len(self.active))

    async def in_torch(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.torch_thread, fn, *args)

    async def start(self, nc: Client, micro: MicroService) -> None:
        path = resolve_model(self.config.model)
        started = time.monotonic()
        await self.in_torch(set_torch_threads, self.config.torch_threads)
        self.runner = await self.in_torch(ModelRunner, path, self.config.device, self.config.dtype)
        layout = self.runner.kv_layout(self.config.page_tokens)
        self.store = KvStore.with_capacity_mb(layout, self.config.kv_cache_mb)
        self.dataplane = make_dataplane(self.config.transport, self.config.host, self.config.dataplane_port,
                                        self.config.advertise_host, self.config.link_gbps,
                                        self.config.dataplane_checksums)
        if self.config.transport == "auto":
            log.info("dataplane_transport", transport="tcp", reason="this build has no RDMA transport yet")
        self.dataplane.register_region(self.store.region)
        await self.dataplane.start()
        log.info("model_loaded", model=str(path), load_s=round(time.monotonic() - started, 2),
                 kv_pages=self.store.num_pages_total, page_bytes=layout.page_bytes, dataplane=self.dataplane.address)

    async def stop(self) -> None:
        if self.dataplane is not None:
            await self.dataplane.close()
        self.torch_thread.shutdown(wait=False, cancel_futures=True)

    def is_ready(self) -> bool:
        return super().is_ready() and self.runner is not None

    def load_info(self) -> dict[str, Any]:
        return {
            "dataplane_addr": self.dataplane.address if self.dataplane else "",
            "model": self.runner.name if self.runner else "",
            "active_requests": len(self.active),
            "kv_pages_free": self.store.num_pages_free if self.store else 0,
            "kv_pages_total": self.store.num_pages_total if self.store else 0,
        }

    def stats(self) -> dict[str, Any]:
        store = self.store
        return {
            "ready": self.is_ready(),
            "model": self.runner.name if self.runner else None,
            "active_requests": len(self.active),
            "request_ids": sorted(self.active),
            "kv_pages_in_use": store.num_pages_in_use if store else 0,
            "kv_pages_total": store.num_pages_total if store else 0,
            "kv_requests_holding_pages": store.request_ids if store else [],
            "leases_open": len(self.dataplane.grants) if self.dataplane else 0,
            "dataplane": {"address": self.dataplane.address, **self.dataplane.stats()} if self.dataplane else None,
            "kv_bytes": {k[0]: v for k, v in self.latency.kv_bytes._values.items()},
        }
