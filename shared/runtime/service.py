"""The shape every SmartGen service shares, and the runner that brings one up and down.

A service subclasses `Service` (endpoints in `start`, numbers in `stats`) and its `__main__` calls `config_main`
(settings, then JSON logging) and `run_main`. The runner, in order: admin HTTP server (routes that change state
behind the admin token, shared/runtime/admin_auth.py) → NATS (credentials and TLS from shared/runtime/natsconn.py) → nats.micro
registration (`smartgen-<role>`, so `$SRV.PING/INFO/STATS` answer) → the service's endpoints → heartbeats
(tracing, when on, before all of them: shared/runtime/tracing.py).
SIGINT/SIGTERM set an event; on the way out everything is undone in reverse, NATS drained last.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import socket
import sys
import time
import uuid
from contextlib import AsyncExitStack
from typing import Any, ClassVar, TypeVar

import nats
import nats.micro
import structlog
from aiohttp import web
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import Discover, WorkerInfo, encode, subjects
from shared import __version__
from shared.runtime.admin_auth import require_admin_token
from shared.runtime.config import ServiceConfig
from shared.runtime.access_log import JsonAccessLogger
from shared.runtime.logging import LOGGER_NAME, setup_logging
from shared.runtime.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, Registry
from shared.runtime.natsconn import connect_options, redacted_url
from shared.runtime import tracing
from shared.runtime.rpc import subscriber

log = structlog.get_logger()
C = TypeVar("C", bound=ServiceConfig)
SHUTDOWN_GRACE_S = 10.0  # after SIGINT/SIGTERM the process ends within this, cleanly or not (tools/stack.py kills at 15 s)


class Service:
    """Base of every service. Subclasses set `role` and override the hooks they need."""

    role: ClassVar[str] = ""
    # Admin paths anyone may POST to (the gateway's OpenAI API); every other non-GET route needs the admin token
    public_path_prefixes: ClassVar[tuple[str, ...]] = ()
    # Admin paths that need the admin token even to read (they show pids and internal addresses)
    private_read_paths: ClassVar[tuple[str, ...]] = ()
    # Cancel an HTTP handler when its client disconnects (the gateway: a client that leaves a non-streamed
    # completion must free the workers at once). Off elsewhere: an admin action runs to its end.
    cancel_on_disconnect: ClassVar[bool] = False
    # After a drain is announced, new requests are still taken this long (seconds): those a gateway routed here
    # before it heard the heartbeat saying `draining` (a model worker's refusal would reach the client as a 429)
    drain_announce_s: ClassVar[float] = 0.0

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.worker_id = config.worker_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.metrics = Registry()
        self.metrics.gauge("smartgen_service_restarts", "Times a supervisor (smartgen up) restarted this service "
                           "after it died, before this process", lambda: float(config.restarts))
        self.nc: Client | None = None
        self.is_stopping = False  # told to stop: heartbeats say `draining`, /ready is 503, gateways route elsewhere
        self.draining = False  # stopping: take nothing new (set drain_announce_s after is_stopping)
        self.admin_url = ""
        self.started_unix = time.time()

    # --- hooks -------------------------------------------------------------------------
    async def start(self, nc: Client, micro: MicroService) -> None:
        """Register endpoints and subscriptions. Called once NATS is connected."""

    async def stop(self) -> None:
        """Cancel work and free resources. Called before NATS drains."""

    def is_ready(self) -> bool:
        return self.nc is not None and self.nc.is_connected and not self.is_stopping

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, body) for GET /health. Healthy = the process can talk to NATS."""
        ok = self.nc is not None and self.nc.is_connected
        return ok, {"status": "ok" if ok else "nats_disconnected", "role": self.role, "worker_id": self.worker_id}

    def stats(self) -> dict[str, Any]:
        return {}

    def admin_routes(self) -> list[web.RouteDef]:
        return []

    def max_body_bytes(self) -> int:
        """The largest request body the admin server reads (a larger one is a 413)."""
        return 1 << 20

    def middlewares(self) -> list:
        """aiohttp middlewares of the admin server besides the JSON errors and the admin token (the gateway's API key)."""
        return []

    def http_port(self) -> int:
        return self.config.admin_port

    def worker_info(self) -> WorkerInfo:
        return WorkerInfo(
            role=self.role, worker_id=self.worker_id, pid=os.getpid(), host=socket.gethostname(),
            admin_url=self.admin_url, version=__version__, started_unix=self.started_unix, draining=self.is_stopping,
            **self.load_info(),
        )

    def is_idle(self) -> bool:
        """Nothing in progress that a drain should wait for (each service says what it holds)."""
        return True

    async def drain(self, timeout_s: float) -> None:
        """Take nothing new (`draining`, announced in a heartbeat now) and wait up to `timeout_s` for what is in
        progress to finish: a rolling restart loses no request that can finish in time."""
        self.is_stopping = True
        await self.publish_heartbeat()
        deadline = time.monotonic() + timeout_s
        await asyncio.sleep(min(self.drain_announce_s, timeout_s))
        self.draining = True
        while not self.is_idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        log.info("service_drained", idle=self.is_idle(), waited_s=round(timeout_s - max(0.0, deadline - time.monotonic()), 2))

    def load_info(self) -> dict[str, Any]:
        """Extra WorkerInfo fields (dataplane_addr, active_requests, kv pages…)."""
        return {}

    # --- helpers for subclasses ------------------------------------------------------------
    def subject(self, verb: str) -> str:
        return subjects.worker(self.role, self.worker_id, verb)

    async def add_endpoints(self, micro: MicroService, **handlers: Any) -> None:
        """Register `verb=handler` pairs as nats.micro endpoints on `smartgen.<role>.<worker_id>.<verb>`."""
        group = micro.add_group(name=subjects.worker(self.role, self.worker_id, "").rstrip("."))
        for verb, handler in handlers.items():
            await group.add_endpoint(name=verb, handler=handler)

    async def publish_heartbeat(self) -> None:
        if self.nc is not None and self.nc.is_connected:
            await self.nc.publish(subjects.heartbeat(self.role), encode(self.worker_info()))


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every HTTP error a route did not answer itself (404, 405, 413, …) gets an OpenAI-style JSON body, with
    the error's own headers (Allow on a 405)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        headers = {k: v for k, v in exc.headers.items() if k.lower() not in ("content-type", "content-length")}
        return web.json_response({"error": {"message": f"{exc.status} {exc.reason}: {request.method} {request.path}",
                                            "type": kind, "param": None, "code": exc.status}},
                                 status=exc.status, headers=headers)


def build_admin_app(service: Service) -> web.Application:
    async def health(_: web.Request) -> web.Response:
        ok, body = service.health()
        return web.json_response(body, status=200 if ok else 503)

    async def ready(_: web.Request) -> web.Response:
        ok = service.is_ready()
        return web.json_response({"ready": ok}, status=200 if ok else 503)

    async def live(_: web.Request) -> web.Response:
        """Liveness (a Kubernetes livenessProbe): the process answers, whatever NATS or the workers do. A pod
        that is alive but not ready is taken out of service, not restarted."""
        return web.json_response({"live": True, "role": service.role, "worker_id": service.worker_id})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=service.metrics.render().encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def stats(_: web.Request) -> web.Response:
        return web.json_response({"role": service.role, "worker_id": service.worker_id, **service.stats()})

    app = web.Application(middlewares=[json_errors, *service.middlewares(),
                                       require_admin_token(service.config.admin_token, service.public_path_prefixes,
                                                           service.private_read_paths)],
                          client_max_size=service.max_body_bytes())
    app.add_routes([web.get("/health", health), web.get("/ready", ready), web.get("/live", live), web.get("/metrics", metrics),
                    web.get("/stats", stats), *service.admin_routes()])
    return app


def http_runner(service: Service) -> web.AppRunner:
    """The service's HTTP server (not yet set up). NOTE: aiohttp's keep-alive timer starts when a connection opens
    and closes it if no whole request head has arrived when it fires, however the bytes trickle in; so
    `header_timeout_s` as the keep-alive timeout is the header read timeout (the body has its own: gateway/api.py)."""
    return web.AppRunner(build_admin_app(service), access_log_class=JsonAccessLogger,
                         access_log=logging.getLogger(LOGGER_NAME), handler_cancellation=service.cancel_on_disconnect,
                         keepalive_timeout=service.config.header_timeout_s)


async def run_service(service: Service) -> None:
    config = service.config
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async with AsyncExitStack() as stack:
        tracing.setup(service.role, service.worker_id, config.tracing, config.tracing_file)
        stack.callback(tracing.shutdown)  # last: after NATS drained, so every span is out
        runner = http_runner(service)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, config.host, service.http_port())
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        service.admin_url = f"http://{config.public_host}:{port}"

        async def on_disconnect() -> None:
            if not stop.is_set():
                log.warning("nats_disconnected")

        async def on_reconnect() -> None:
            log.info("nats_reconnected")
            await service.publish_heartbeat()

        async def on_error(exc: Exception) -> None:
            if "authorization violation" in str(exc).lower():  # the client keeps retrying: say what to fix
                log.error("nats_auth_refused", error=str(exc), fix="give this service the server's credentials: "
                          "SMARTGEN_NATS_TOKEN(_FILE), or SMARTGEN_NATS_USER and SMARTGEN_NATS_PASSWORD(_FILE)")
            else:
                log.warning("nats_error", error=str(exc))

        nc = await nats.connect(**connect_options(config), name=service.worker_id, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.5, disconnected_cb=on_disconnect,
                                reconnected_cb=on_reconnect, error_cb=on_error)
        stack.push_async_callback(nc.drain)
        service.nc = nc
        micro = await nats.micro.add_service(
            nc, name="-".join(filter(None, ("smartgen", config.namespace, service.role))), version=__version__,
            description=f"SmartGen {service.role} service",
            metadata={"worker_id": service.worker_id, "admin_url": service.admin_url})
        stack.push_async_callback(micro.stop)

        await service.start(nc, micro)
        stack.push_async_callback(service.stop)

        async def answer_discover(_: Discover) -> None:
            await service.publish_heartbeat()

        await nc.subscribe(subjects.DISCOVER, cb=subscriber(Discover, answer_discover))
        heartbeats = asyncio.create_task(_heartbeat_loop(service))
        stack.callback(heartbeats.cancel)
        log.info("service_started", admin_url=service.admin_url, nats_url=redacted_url(config.nats_url),
                 nats_auth=("creds" if config.nats_creds else "token" if config.nats_token
                            else "user" if config.nats_user else "none"),
                 admin_token_set=bool(config.admin_token), pid=os.getpid())
        await stop.wait()
        log.info("service_stopping")
        if config.drain_s > 0:
            await service.drain(config.drain_s)
        # NOTE: undoing can hang where what it waits on is gone (draining a NATS connection whose server died
        # with the stack): whatever happens, the process ends SHUTDOWN_GRACE_S after the signal (a thread, so a
        # blocked event loop cannot hold it up)
        watchdog = threading.Timer(SHUTDOWN_GRACE_S, _exit_late)
        watchdog.daemon = True
        watchdog.start()
    log.info("service_stopped")


def _exit_late() -> None:
    log.error("shutdown_timed_out", grace_s=SHUTDOWN_GRACE_S)
    os._exit(1)


async def _heartbeat_loop(service: Service) -> None:
    while True:
        try:
            await service.publish_heartbeat()
        except Exception as exc:  # a heartbeat must never kill the service
            log.warning("heartbeat_failed", error=str(exc))
        await asyncio.sleep(service.config.heartbeat_s)


def config_main(config_cls: type[C], role: str) -> C:
    """A service's `__main__`, first half: its config from flags, env and the settings file. Exits with a JSON
    config_error line on a bad setting, or, given --show-config, after printing the effective settings as JSON
    (`smartgen config show`; the `__main__` imports its service, torch and all, only after this)."""
    import json
    import sys

    from shared.runtime.config import SHOW_CONFIG_FLAG, ConfigError, describe_config, resolve_config

    try:
        config, sources = resolve_config(config_cls, sys.argv[1:], role=role)
    except ConfigError as exc:  # a JSON line like every other (the stack's log is JSON throughout)
        setup_logging(role, "")
        log.error("config_error", error=str(exc))
        sys.exit(1)
    if SHOW_CONFIG_FLAG in sys.argv[1:]:
        print(json.dumps({"role": role, "settings": describe_config(config, sources)}))
        sys.exit(0)
    # NOTE: logging from here on, so that loading the service (its imports, the model) logs JSON too, a crash
    # included; the worker id is drawn now for that reason (Service takes config.worker_id)
    config.worker_id = config.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    setup_logging(role, config.worker_id, config.log_level)
    return config


def run_main(service: Service) -> None:
    """A service's `__main__`, second half: run it until SIGINT/SIGTERM, then exit 0 (a failure raises out of
    `asyncio.run` first, with its traceback and a non-zero status). With SMARTGEN_PROFILE_LOOP set, the event-loop
    thread runs under cProfile and its stats go to `<that path>.<Service>.<pid>` (docs/operations.md)."""
    profile_to = os.environ.get("SMARTGEN_PROFILE_LOOP")
    if profile_to:
        import cProfile
        profiler = cProfile.Profile()
        profiler.runcall(asyncio.run, run_service(service))
        profiler.dump_stats(f"{profile_to}.{type(service).__name__}.{os.getpid()}")
    else:
        asyncio.run(run_service(service))
    # NOTE: everything is undone by now (NATS drained, spans written, service_stopped logged): the interpreter's own
    # teardown of torch and transformers only frees memory (~1.4 s of CPU a model worker), so it is skipped
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)
