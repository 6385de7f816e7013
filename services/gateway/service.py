"""Gateway: the OpenAI-compatible API in front of the workers.

It tokenizes (so a prompt that cannot fit is refused before any worker is touched), keeps the live
worker registry from heartbeats, routes each request (see completion.py for its life), detokenizes
the token stream and records what clients see: TTFT, TTST, inter-token latency.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import mode_of
from shared.runtime.metrics import LatencyMetrics
from shared.runtime.vllm_metrics import VllmMetrics
from shared.runtime.models import load_tokenizer, model_config, resolve_model
from shared.runtime.service import Service
from shared.runtime import tracing
from services.gateway import api
from services.gateway.api_key import require_api_key
from services.gateway.admission import Admission
from services.gateway.completion import CompletionRun
from services.gateway.config import GatewayConfig
from shared.runtime.registry import WorkerRegistry
from services.gateway.routing import PrefixRoutes

def _generation_end_ids(path) -> list[int]:
    """The end-of-sequence ids of the model's generation_config.json (one id or a list), [] without one."""
    eos = model_config(path, "generation_config.json").get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


class GatewayService(Service):
    role = "gateway"
    # the OpenAI API (and vLLM's tokenizer routes) is the public API: no admin token (the API key, if set, for /v1)
    public_path_prefixes = ("/v1/", "/tokenize", "/detokenize")
    private_read_paths = ("/workers",)  # pids and internal addresses: the admin token, even to read
    cancel_on_disconnect = True  # a client that leaves a non-streamed completion frees the workers at once
    config: GatewayConfig

    def __init__(self, config: GatewayConfig):
        super().__init__(config)
        self.registry = WorkerRegistry(config.worker_ttl_s)
        self.routes = PrefixRoutes(config.cache_route_slack)
        self.prefill_routes = PrefixRoutes(config.cache_route_slack)
        self.latency = LatencyMetrics(self.metrics)
        self.prompt_tokens = self.metrics.counter("smartgen_prompt_tokens_total", "Prompt tokens of finished requests")
        self.generation_tokens = self.metrics.counter("smartgen_generation_tokens_total", "Tokens generated")
        self.migrations = self.metrics.counter("smartgen_migrations_total", "Requests resumed on another decode worker "
                                               "after theirs died (failure_policy recompute)")
        self.refusals = self.metrics.counter("smartgen_api_refusals_total", "API answers of 4xx and 5xx by status and "
                                             "error code (400 bad input, 401 key, 429 full, 503 no worker, …)",
                                             ["status", "code"])
        self.metrics.gauge("smartgen_kv_cache_usage_ratio", "Share of the live decode workers' KV pages in use",
                           self._kv_usage)
        self.local_share = self.metrics.histogram(
            "smartgen_local_share", "Share of the selected KV entries already on the decode node, per request",
            ["transfer_mode"], buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0))
        self.admission = Admission(self.capacity, config.max_waiting, config.queue_timeout_s, self.metrics,
                                   config.max_running_per_client, config.max_waiting_per_client)
        path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(path)  # NOTE: the gateway never imports torch (load_tokenizer)
        self.max_positions = model_config(path)["max_position_embeddings"]
        self.model_id = config.served_model_name or path.name
        # every id that ends a turn: the tokenizer's EOS and the generation config's (a chat template with its own
        # end-of-turn token lists it there)
        self.stop_token_ids = sorted({self.tokenizer.eos_token_id, *_generation_end_ids(path)} - {None})
        self.is_started = False  # NATS connected and the registry following heartbeats: requests can be routed
        self.num_http_in_progress = 0  # HTTP requests whose handler has not returned (a stream: until its last byte)
        self.vllm = VllmMetrics(self.metrics, self.model_id, lambda: float(self.admission.running),
                                lambda: float(self.admission.num_waiting), self._kv_usage) if config.vllm_metrics else None

    def http_port(self) -> int:
        return self.config.gateway_port

    async def start(self, nc: Client, micro: MicroService) -> None:
        await self.registry.follow(nc, self.worker_id)
        self.is_started = True

    def admin_routes(self) -> list[web.RouteDef]:
        return api.routes(self)

    def is_idle(self) -> bool:
        # NOTE: the HTTP count too: a request that passed the `draining` check but is not admitted yet (its body
        # still arriving) needs NATS as much as a running one; the drain closes NATS only after it
        return self.num_http_in_progress == 0 and self.admission.running == 0 and not self.admission.waiting

    def max_body_bytes(self) -> int:
        return int(self.config.max_body_mb * (1 << 20))

    def middlewares(self) -> list:
        return [self._track_requests, self._count_refusals, require_api_key(self.config.api_key)]

    @web.middleware
    async def _track_requests(self, request: web.Request, handler) -> web.StreamResponse:
        """Count the requests in progress (the drain waits for them), and once this gateway is stopping end each
        connection after its answer (`Connection: close`): a client's next request opens a new connection, to a live gateway, instead of reusing this one
        as it closes (a reset the client cannot tell from a lost request)."""
        self.num_http_in_progress += 1
        try:
            response = await handler(request)
        finally:
            self.num_http_in_progress -= 1
        # NOTE: not a stream that began before: closed right after its last chunk, its connection could go back to
        # the client's pool and carry a request before the close arrives (a reset); its next request gets the 503
        if self.is_stopping and not response.prepared:
            response.force_close()
        return response

    @web.middleware
    async def _count_refusals(self, request: web.Request, handler) -> web.StreamResponse:
        """Every 4xx/5xx answer of the API in /metrics, by status and OpenAI error code (a stream's error after its
        first chunk is counted with the request instead: smartgen_requests_total{status="error"})."""
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # aiohttp's own (a 413 for a body past max_body_mb): json_errors answers it
            if exc.status >= 400 and request.path.startswith("/v1"):
                self.refusals.inc(status=str(exc.status), code=str(exc.status))  # the code json_errors' body carries
            raise
        if response.status >= 400 and isinstance(response, web.Response) and request.path.startswith("/v1"):
            try:
                code = str(json.loads(response.body)["error"].get("code") or "none")[:40]
            except (TypeError, ValueError, KeyError, AttributeError):
                code = "none"
            self.refusals.inc(status=str(response.status), code=code)
        return response

    def health(self) -> tuple[bool, dict[str, Any]]:
        nats_ok, body = super().health()
        # NOTE: the broker counts: every disaggregated request needs a plan from it
        counts = {role: len(self.registry.alive(role)) for role in ("prefill", "decode", "broker")}
        ok = nats_ok and all(counts.values())
        missing = [role for role, n in counts.items() if n == 0]
        body.update(status="ok" if ok else body["status"] if not nats_ok else f"no {' or '.join(missing)} worker",
                    workers=counts)
        return ok, body

    def is_ready(self) -> bool:
        return self.health()[0]

    def capacity(self) -> int:
        """Requests that may run at once: `max_running`, else what the live decode workers say they take, and no
        more than the live prefill workers take (a disaggregated request holds a slot on each side; partial and
        smartgen keep theirs on the prefill until every entry is local)."""
        if self.config.max_running:
            return self.config.max_running
        decode = sum(w.max_requests for w in self.registry.alive("decode"))
        prefill = self.registry.alive("prefill")
        return min(decode, sum(w.max_requests for w in prefill)) if prefill else decode

    def _kv_usage(self) -> float:
        decode = self.registry.alive("decode")
        total = sum(w.kv_pages_total for w in decode)
        return 1 - sum(w.kv_pages_free for w in decode) / total if total else 0.0

    def record(self, run: CompletionRun) -> None:
        """Count a finished request in /metrics."""
        mode = run.mode or run.job.transfer_mode
        self.latency.observe_timeline(run.token_times_s, mode, self.model_id)
        # NOTE: a client that left is not a failure (stop_string: the gateway ended it on a stop string)
        status = run.finish_reason or ("client_gone" if run.client_gone else "error")
        self.latency.requests.inc(status=status)
        if run.final is not None:
            self.local_share.observe(run.final.local_share, transfer_mode=mode)
        if self.vllm:
            queried = len(run.job.prompt_ids) if mode_of(mode).is_disaggregated else 0  # colocated: no prefill worker
            self.vllm.observe(run.token_times_s, len(run.job.prompt_ids), status, run.queue_s, queried,
                              run.num_cached_tokens)
        self.prompt_tokens.inc(len(run.job.prompt_ids))
        if run.migrated_from:
            self.migrations.inc(len(run.migrated_from))
        self.generation_tokens.inc(len(run.token_ids))
        for path, n in run.kv_bytes.items():
            self.latency.kv_bytes.inc(n, path=path)
        tracing.annotate(mode=mode, status=status, completion_tokens=len(run.token_ids))

    def stats(self) -> dict[str, Any]:
        return {"model": self.model_id, "workers": {r: len(self.registry.alive(r)) for r in ("prefill", "decode", "broker", "kvprofile")},
                "requests_done": self.latency.requests.by_first_label(), "capacity": self.capacity(),
                "running": self.admission.running, "waiting": self.admission.num_waiting,
                "waiting_client_cap": self.admission.num_waiting_at_cap(),
                "waiting_client_max": self.admission.most_waiting_of_one_client(),
                "clients_running": len(self.admission.running_by_client)}
