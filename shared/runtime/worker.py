"""What prefill and decode services share: the model on its own torch thread, the page store,
the data plane, and the numbers every model worker reports (`/stats`, heartbeats)."""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Awaitable
from typing import Any, Callable, ClassVar

import structlog
from aiohttp import web
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import RdmaEndpoint, subjects
from shared.runtime.config import ModelWorkerConfig
from shared.dataplane import DataPlane, DataPlaneError, Lane, make_dataplane
from shared.dataplane.agent import AgentDataPlane
from shared.dataplane.rdma import rdma_devices
from shared.compute.kvstore import KvStore
from shared.compute.prefix_cache import PrefixCache
from shared.runtime.metrics import LatencyMetrics
from shared.compute.modeling import ModelRunner, set_torch_threads
from shared.runtime.torch_thread import TorchThread
from shared.runtime.models import resolve_model
from shared.runtime.rpc import call, endpoint
from shared.runtime.service import Service

log = structlog.get_logger()
# NOTE: a switch of the process's environment, not a config field: no deployment should carry it, and
# without it `POST /fault` does not exist (404).
FAULT_INJECTION_ENV = "SMARTGEN_FAULT_INJECTION"
# the faults that hold one step of a worker's work `delay_s` seconds → the Faults field each sets
SLOW_FAULTS = {"slow_prefill": "prefill_delay_s", "slow_open": "open_delay_s", "slow_prefix_insert": "prefix_insert_delay_s"}
FAULT_KINDS = ("corrupt_next_chunk", "cut_links", "refuse_tickets", "delay", *SLOW_FAULTS, "clear")


class ModelWorkerService(Service):
    config: ModelWorkerConfig
    drain_announce_s: ClassVar[float] = 0.5  # a gateway's pick → the request's arrival: ms, on a loaded host more

    def __init__(self, config: ModelWorkerConfig):
        super().__init__(config)
        # NOTE: every torch call runs on this one thread; handlers never call torch directly.
        self.torch_thread = TorchThread()
        self.in_torch = self.torch_thread.run  # `await self.in_torch(fn, *args)`: fn(*args) on that thread
        self.runner: ModelRunner | None = None
        self.store: KvStore | None = None
        self.dataplane: DataPlane | None = None
        self.pool: PrefixCache | None = None  # this worker's prefix cache, if on (`prefix_cache`)
        self.latency = LatencyMetrics(self.metrics)
        self.active: dict[str, Any] = {}  # request_id → per-request state (each service defines it)
        self.metrics.gauge("smartgen_kv_pages_in_use", "KV pages held by requests",
                           lambda: self.store.num_pages_in_use if self.store else 0)
        self.metrics.gauge("smartgen_active_requests", "Requests in progress", lambda: len(self.active))
        # counts since the process started (the data plane keeps them; over the transfer agent, as last reported)
        self.metrics.gauge("smartgen_dataplane_refused", "Data-plane frames refused (unknown, revoked or outside their "
                           "ticket) since start", lambda: self._dataplane_count("refused"))
        self.metrics.gauge("smartgen_dataplane_peers_refused", "Data-plane peers refused at the handshake since start",
                           lambda: self._dataplane_count("peers_refused"))
        self.metrics.gauge("smartgen_dataplane_checksum_failures", "Data-plane chunks whose crc32c did not match "
                           "since start", lambda: self._dataplane_count("checksum_failures"))

    def is_idle(self) -> bool:
        return not self.active

    def _dataplane_count(self, name: str) -> float:
        return float(self.dataplane.stats().get(name, 0) or 0) if self.dataplane is not None else 0.0

    def prefix_cache(self, capacity_mb: int, metric_prefix: str, looked_up: str) -> PrefixCache | None:
        """This worker's prefix cache (`pool`) of `capacity_mb` (None when 0: off), its counts exported as
        `<metric_prefix>_queries_total` (prompt tokens `looked_up`), `_hits_total` (of those, found) and `_bytes`,
        its state in /stats as `prefix_cache`."""
        if not capacity_mb:
            return None
        assert self.store
        cache = PrefixCache(capacity_mb * 2**20, self.store.layout.page_tokens)
        self.metrics.counter_read(f"{metric_prefix}_queries_total", f"Prompt tokens {looked_up}",
                                  lambda: cache.num_queried_tokens)
        self.metrics.counter_read(f"{metric_prefix}_hits_total", "Of those, the ones found cached (their KV reused)",
                                  lambda: cache.num_hit_tokens)
        self.metrics.gauge(f"{metric_prefix}_bytes", "Host memory held by the prefix cache's pages",
                           lambda: cache.num_bytes)
        self.pool = cache
        return cache

    async def start(self, nc: Client, micro: MicroService) -> None:
        path = resolve_model(self.config.model)
        started = time.monotonic()
        await self.in_torch(set_torch_threads, self.config.torch_threads)
        self.runner = await self.in_torch(ModelRunner, path, self.config.device, self.config.dtype)
        layout = self.runner.kv_layout(self.config.page_tokens, self.config.kv_dtype)
        self.store = await self.in_torch(KvStore.with_capacity_mb, layout, self.config.kv_cache_mb,
                                         self.config.dataplane_agent and not self._uses_rdma())
        self.dataplane = await self._start_dataplane(nc, micro)
        log.info("model_loaded", model=str(path), load_s=round(time.monotonic() - started, 2),
                 kv_pages=self.store.num_pages_total, page_bytes=self.store.page_bytes, dataplane=self.dataplane.address)

    def _uses_rdma(self) -> bool:
        return self.config.transport == "rdma" or (self.config.transport == "auto" and bool(rdma_devices()))

    async def _start_dataplane(self, nc: Client, micro: MicroService) -> DataPlane:
        """RDMA where a device exists (or was asked for), TCP otherwise (in a transfer agent process with
        `dataplane_agent`); says which, once."""
        cfg = self.config
        use_rdma = self._uses_rdma()
        assert self.store
        if use_rdma:
            from shared.dataplane.rdma import RdmaDataPlane

            async def rendezvous(peer: str, offer: dict) -> dict:
                peer_id = peer.removeprefix("rdma:")
                reply = await call(nc, subjects.dataplane_connect(peer_id), RdmaEndpoint(**offer), RdmaEndpoint, 10)
                return dataclasses.asdict(reply)

            try:
                plane: DataPlane = RdmaDataPlane(f"rdma:{self.worker_id}", rendezvous, cfg.rdma_device,
                                                 link_gbps=cfg.link_gbps)
            except DataPlaneError as exc:
                raise SystemExit(f"{self.role}: transport 'rdma': {exc}") from None

            async def accept(offer: RdmaEndpoint) -> RdmaEndpoint:
                return RdmaEndpoint(**await plane.accept(dataclasses.asdict(offer)))  # type: ignore[attr-defined]

            await nc.subscribe(subjects.dataplane_connect(self.worker_id), cb=_as_handler(endpoint(RdmaEndpoint, accept)))
        else:
            tls = (cfg.dataplane_tls_ca, cfg.dataplane_tls_cert, cfg.dataplane_tls_key) if cfg.dataplane_tls_ca else None
            tcp_args = dict(host=cfg.host, port=cfg.dataplane_port, advertise_host=cfg.public_host,
                            link_gbps=cfg.link_gbps, checksums=cfg.dataplane_checksums,
                            cluster_secret=cfg.cluster_secret, tls=tls)
            if self.store.shared_arena is not None:
                plane = AgentDataPlane(self.store.shared_arena, self.worker_id, cfg.log_level, **tcp_args)
                plane.on_agent_lost = _stop_without_a_data_plane
            else:
                plane = make_dataplane("tcp", **tcp_args)
            if not cfg.cluster_secret:
                log.warning("dataplane_open", hint="any process that reaches the data-plane port may link to it: set "
                                                   "SMARTGEN_CLUSTER_SECRET_FILE (smartgen up and compose do)")
        plane.register_region(self.store.region)
        await plane.start()
        log.info("dataplane_started", transport="rdma" if use_rdma else "tcp", address=plane.address,
                 agent=isinstance(plane, AgentDataPlane),
                 tls=bool(cfg.dataplane_tls_ca) and not use_rdma,
                 reason=None if use_rdma or cfg.transport == "tcp" else "no RDMA device found",
                 link_gbps=cfg.link_gbps or None)
        return plane

    async def stop(self) -> None:
        if self.dataplane is not None:
            await self.dataplane.close()
        self.torch_thread.close()

    def is_ready(self) -> bool:
        return super().is_ready() and self.runner is not None

    def admin_routes(self) -> list[web.RouteDef]:
        async def link(request: web.Request) -> web.Response:
            """POST /link {"gbps": X}: pace this worker's data-plane links (0 = unpaced), as --link-gbps does."""
            try:
                gbps = (await request.json())["gbps"]
                if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or gbps < 0:
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                return web.json_response({"error": 'send {"gbps": X} with X ≥ 0 (0 = unpaced)'}, status=400)
            if self.dataplane is None:
                return web.json_response({"error": "the data plane has not started"}, status=503)
            self.dataplane.set_link_gbps(float(gbps))
            log.info("link_paced", link_gbps=gbps)
            try:  # the broker plans with the new pacing from now, not from the next heartbeat
                await self.publish_heartbeat()
            except Exception as exc:  # the pacing is set either way; the heartbeat loop announces it
                log.warning("heartbeat_failed", error=str(exc))
            return web.json_response({"link_gbps": self.dataplane.link_gbps})

        routes = [web.post("/link", link)]
        if os.environ.get(FAULT_INJECTION_ENV) == "1":
            routes.append(web.post("/fault", self._inject_fault))
        return routes

    async def _inject_fault(self, request: web.Request) -> web.Response:
        """POST /fault (tests only, SMARTGEN_FAULT_INJECTION=1): break this worker's data plane on purpose.
          {"kind": "corrupt_next_chunk", "count": N}  the next N data frames sent arrive corrupted (crc32c fails)
          {"kind": "cut_links"}                       drop every data-plane connection now (later ones redial)
          {"kind": "refuse_tickets", "on": true}      refuse every incoming push and read, as for an unknown ticket
          {"kind": "delay", "delay_s": X}             hold every data frame sent X seconds (0 = off); "lanes":
                                                      ["push", …] holds only those lanes' frames
          {"kind": "slow_prefill", "delay_s": X}      a prefill worker holds each prompt X seconds before computing it
          {"kind": "slow_open", "delay_s": X}         a decode worker holds each `open` X seconds after reserving the KV
          {"kind": "slow_prefix_insert", "delay_s": X}  a prefill worker's prefix cache insertion takes X seconds more
          {"kind": "clear"}                           undo the switches above"""
        try:
            body = await request.json()
            kind = body["kind"]
            if kind not in FAULT_KINDS:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": f"send {{\"kind\": K}} with K one of {', '.join(FAULT_KINDS)}"}, status=400)
        if self.dataplane is None:
            return web.json_response({"error": "the data plane has not started"}, status=503)
        faults, cut = self.dataplane.faults, 0
        try:
            if kind == "corrupt_next_chunk":
                faults.corrupt_frames += int(body.get("count", 1))
            elif kind == "refuse_tickets":
                faults.refuse_tickets = bool(body.get("on", True))
            elif kind == "delay":
                lanes = [str(lane).lower() for lane in body.get("lanes", [])]
                if not set(lanes) <= {lane.name.lower() for lane in Lane}:
                    raise ValueError(lanes)
                faults.delay_s, faults.delay_lanes = max(0.0, float(body["delay_s"])), lanes
            elif kind in SLOW_FAULTS:
                setattr(faults, SLOW_FAULTS[kind], max(0.0, float(body["delay_s"])))
            elif kind == "clear":
                faults.corrupt_frames, faults.refuse_tickets, faults.delay_s = 0, False, 0.0
                for name in SLOW_FAULTS.values():
                    setattr(faults, name, 0.0)
                faults.delay_lanes = []
            else:
                cut = self.dataplane.cut_links()
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": f"bad arguments for fault {kind!r}"}, status=400)
        except NotImplementedError as exc:
            return web.json_response({"error": str(exc)}, status=501)
        self.dataplane.apply_faults()
        log.warning("fault_injected", kind=kind, links_cut=cut, **faults.summary())
        return web.json_response({"kind": kind, "links_cut": cut, **faults.summary()})

    def load_info(self) -> dict[str, Any]:
        return {
            "dataplane_addr": self.dataplane.address if self.dataplane else "",
            "model": self.runner.name if self.runner else "",
            "active_requests": len(self.active),
            "max_requests": self.config.max_active_requests,
            "kv_pages_free": self.store.num_pages_free if self.store else 0,
            "kv_pages_total": self.store.num_pages_total if self.store else 0,
            "send_rate_gbps": round(self.dataplane.send_rate_gbps(), 4) if self.dataplane else 0.0,
            "link_gbps": self.dataplane.link_gbps if self.dataplane else 0.0,
            "request_ids": sorted(self.active),
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
            "dataplane": {"address": self.dataplane.address, **self.dataplane.stats(),
                          "faults": self.dataplane.faults.summary()} if self.dataplane else None,
            "kv_bytes": self.latency.kv_bytes.by_first_label(),
            **({"prefix_cache": self.pool.stats()} if self.pool is not None else {}),
        }


def _as_handler(handle: Callable[[Any], Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
    """A nats.micro-style handler used on a plain subscription (data-plane set-up is not a service endpoint)."""
    from nats.micro.request import Request

    async def on_msg(msg: Any) -> None:
        await handle(Request(msg))

    return on_msg


def _stop_without_a_data_plane(error: DataPlaneError) -> None:
    """The transfer agent died: this worker can move no KV, so it stops (as on SIGTERM: requests in flight are
    told) and its supervisor (`smartgen up`, compose, Kubernetes) starts it again, agent and all."""
    log.error("stopping_without_a_data_plane", error=str(error))
    os.kill(os.getpid(), signal.SIGTERM)
