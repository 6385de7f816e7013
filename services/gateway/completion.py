"""One request's trip through the system, seen from the gateway.

  1. Pick a decode worker (and, unless colocated, a prefill worker and the broker): least loaded first.
  2. Subscribe to the request's stream subject before anything can be published on it.
  3. Disaggregated modes: `decode.open` reserves the slab (and its aux area) and returns the KvHandle →
     `broker.open` returns the TransferPlan (resolving `auto`) → `prefill.prefill` runs the prompt, pushing
     what the plan says straight to those pages, and returns token 1 (and, for partial and smartgen, the
     KvSource of what stayed behind) → `decode.generate` continues from it.
     colocated: `decode.generate` does both phases itself.
  4. Tokens arrive on the stream; each is stamped on arrival here (what a client sees).
  5. `close()` always runs: if the request did not finish (client gone, stop string, error), both workers
     get `abort` and the broker hears the plan failed, so nothing stays allocated.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client

from schemas import (SELECTIVE_MODES, Abort, Accepted, Ack, Generate, KvHandle, OpenKv, OpenPlan, PlanEvent, Prefill,
                     PrefillDone, Sampling, SchemaError, TokenEvent, TransferPlan, WorkerInfo, decode, encode, subjects)
from shared.rpc import RemoteError, call
from shared.timeline import Timeline
from shared.registry import WorkerRegistry
from services.gateway.requests import ApiError, CompletionJob

log = structlog.get_logger()
T = TypeVar("T")
CONTROL_TIMEOUT_S = 10.0  # open / generate / abort are bookkeeping: fast or failed
LIVENESS_POLL_S = 0.5  # while waiting on a worker, how often to check that its heartbeats still come


class RequestFailed(RuntimeError):
    """A worker failed the request after it was admitted."""


@dataclass
class CompletionRun:
    nc: Client
    registry: WorkerRegistry
    job: CompletionJob
    stop_token_ids: list[int]
    timeout_s: float
    token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    finish_reason: str = ""
    kv_bytes: dict[str, int] = field(default_factory=dict)
    kv_wait_s: float = 0.0
    selected_share: float = 1.0
    final: TokenEvent | None = None  # the stream's last event (transfer figures)
    prefill_s: float | None = None
    prefill: WorkerInfo | None = None
    decode: WorkerInfo | None = None
    broker: WorkerInfo | None = None
    plan: TransferPlan | None = None
    mode: str = ""  # the mode that ran (auto resolved)
    selector: str = ""  # the selector that ran ("" = dense)
    decode_layers: int = 0  # from the KvHandle, to report the plan's block count
    _sub: Any = None
    _closed: bool = False

    def _pick(self, role: str) -> WorkerInfo:
        worker = self.registry.pick(role)
        if worker is None:
            raise ApiError(503, f"no {role} worker is registered; try again when /health says ok", code="no_worker")
        return worker

    async def tokens(self) -> AsyncIterator[int]:
        """Yield completion token ids as they arrive. Raises ApiError before the first token, RequestFailed after."""
        job = self.job
        self.mode, self.selector = job.transfer_mode, job.selector or ""
        self.decode = self._pick("decode")
        if job.transfer_mode != "colocated":
            self.prefill, self.broker = self._pick("prefill"), self._pick("broker")
        self._sub = await self.nc.subscribe(subjects.stream(job.request_id))
        sampling = Sampling(job.temperature, job.seed)
        first, done = -1, None
        try:
            if job.transfer_mode != "colocated":
                done = await self._prefill(sampling)
                first, self.prefill_s = done.first_token, done.prefill_s
            await call(self.nc, subjects.worker("decode", self.decode.worker_id, "generate"),
                       Generate(job.request_id, self.mode, job.prompt_ids, first, job.max_tokens,
                                self.stop_token_ids, sampling, subjects.stream(job.request_id),
                                self.selector, (job.kv_budget or 0.0) if self.selector else 0.0, self.plan,
                                done.source if done else None, job.kv_bits,
                                self.prefill.worker_id if self.prefill else ""),
                       Accepted, CONTROL_TIMEOUT_S)
        except RemoteError as exc:
            status = {"overloaded": 429, "unavailable": 503, "bad_request": 400}.get(exc.code, 502)
            raise ApiError(status, f"{exc.message}", code=exc.code) from None
        if first >= 0:
            yield self._stamp(first)
        async for event in self._events():
            if event.token_id >= 0:
                yield self._stamp(event.token_id)
            if event.finish_reason:
                self.final = event
                self.kv_bytes, self.kv_wait_s, self.selected_share = event.kv_bytes, event.kv_wait_s, event.selected_share
                if event.finish_reason == "error":
                    raise RequestFailed(event.error)
                self.finish_reason = event.finish_reason
                return

    async def _prefill(self, sampling: Sampling) -> PrefillDone:
        """decode.open → broker.open → prefill.prefill: the slab, the plan, then the prompt with its pushes."""
        job = self.job
        assert self.decode and self.prefill and self.broker
        wants_metadata = job.transfer_mode in (*SELECTIVE_MODES, "auto")
        handle = await call(self.nc, subjects.worker("decode", self.decode.worker_id, "open"),
                            OpenKv(job.request_id, len(job.prompt_ids), job.max_tokens, job.transfer_mode,
                                   self.selector if wants_metadata else "", job.kv_bits), KvHandle, CONTROL_TIMEOUT_S)
        self.plan = await call(self.nc, subjects.worker("broker", self.broker.worker_id, "open"),
                               OpenPlan(job.request_id, job.transfer_mode, self.decode.model, self.selector,
                                        len(job.prompt_ids), handle.layout, handle.aux_bytes, self.prefill.worker_id,
                                        self.decode.worker_id, job.ablate), TransferPlan, CONTROL_TIMEOUT_S)
        self.mode, self.decode_layers = self.plan.mode, handle.layout.num_layers
        if job.transfer_mode == "auto" and self.mode == "full":
            self.selector = ""  # the whole KV arrives in time: attend densely
        selective = self.mode in SELECTIVE_MODES
        return await self._while_alive(
            call(self.nc, subjects.worker("prefill", self.prefill.worker_id, "prefill"),
                 Prefill(job.request_id, job.prompt_ids, self.mode, sampling, handle, self.plan,
                         self.selector if selective else "", job.kv_bits),
                 PrefillDone, self.timeout_s), self.prefill, "prefill")

    async def _events(self) -> AsyncIterator[TokenEvent]:
        assert self.decode
        # Until decode's first event the prefill node matters too: decode may still be waiting on its pushes.
        watched = [self.decode, *([self.prefill] if self.prefill else [])]
        while True:
            try:
                msg = await asyncio.wait_for(self._while_alive(self._sub.next_msg(timeout=None), watched, "decoding"),
                                             self.timeout_s)
            except asyncio.TimeoutError:
                raise RequestFailed(f"no token from decode worker {self.decode.worker_id} within {self.timeout_s:g} s") from None
            watched = [self.decode]
            try:
                yield decode(TokenEvent, msg.data)
            except SchemaError as exc:
                log.warning("bad_token_event", error=str(exc))

    async def _while_alive(self, awaitable: Awaitable[T], workers: WorkerInfo | list[WorkerInfo], what: str) -> T:
        """Await `awaitable`, but fail at once (within the registry's heartbeat TTL) if one of `workers` dies
        meanwhile, instead of waiting out a long timeout."""
        workers = workers if isinstance(workers, list) else [workers]
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
                if done:
                    return task.result()
                for worker in workers:
                    if not self.registry.is_alive(worker.worker_id):
                        raise RequestFailed(f"{worker.role} worker {worker.worker_id} stopped sending heartbeats "
                                            f"during {what}")
        finally:
            if not task.done():
                task.cancel()

    def _stamp(self, token_id: int) -> int:
        self.token_ids.append(token_id)
        self.token_times_s.append(time.monotonic() - self.job.arrival)
        return token_id

    def stop_early(self, reason: str) -> None:
        """The gateway ended the stream itself (a stop string): close() will abort the workers."""
        self.finish_reason = reason

    async def close(self) -> None:
        """Unsubscribe, and abort the workers if the request did not finish on its own. Idempotent."""
        if self._closed:
            return
        self._closed = True
        unfinished = not self.finish_reason or self.finish_reason == "stop_string"
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:  # NATS closing or reconnecting: the aborts below matter more
                log.warning("unsubscribe_failed", error=str(exc))
        if unfinished:
            reason = self.finish_reason or "client_gone"
            for worker in (self.prefill, self.decode):  # the writer stops first, then the slab it writes to is freed
                if worker is None:
                    continue
                try:
                    await call(self.nc, subjects.worker(worker.role, worker.worker_id, "abort"),
                               Abort(self.job.request_id, reason), Ack, CONTROL_TIMEOUT_S)
                except RemoteError as exc:
                    log.warning("abort_failed", worker_id=worker.worker_id, error=str(exc))
            if self.plan is not None:
                try:
                    await self.nc.publish(subjects.worker("broker", self.plan.broker_worker_id, "event"),
                                          encode(PlanEvent(self.job.request_id, "failed", f"aborted: {reason}")))
                except Exception as exc:  # NATS closing: the broker expires the plan instead
                    log.warning("plan_event_failed", error=str(exc))
        if self.finish_reason == "stop_string":
            self.finish_reason = "stop"

    def summary(self) -> dict[str, Any]:
        """The `smartgen` object of the response."""
        t = Timeline.of(self.token_times_s)
        final, plan = self.final, self.plan
        return {
            "ttft_s": t.ttft_s, "ttst_s": t.ttst_s, "tbt_s": t.tbt_s,
            "token_times_s": [round(x, 6) for x in self.token_times_s],
            "kv_bytes": self.kv_bytes,
            "kv_wait_s": self.kv_wait_s,
            "prefill_s": self.prefill_s,
            "transfer_mode": self.mode or self.job.transfer_mode,
            "requested_mode": self.job.transfer_mode,
            "attention": "selective" if self.selector else "dense",
            "selector": self.selector or None,
            "kv_budget": self.job.kv_budget if self.selector else None,
            "kv_bits": self.job.kv_bits or None,
            "ablate": self.job.ablate,
            "selected_share": self.selected_share,
            "local_share": final.local_share if final else None,
            "on_demand_wait_s": final.on_demand_wait_s if final else None,
            "step_local_share": final.step_local_share if final else [],
            "step_wait_s": final.step_wait_s if final else [],
            "all_local_step": final.all_local_step if final and final.all_local_step >= 0 else None,
            "plan": {"mode": plan.mode, "reason": plan.reason, "profile": plan.profile or None,
                     "profile_version": plan.profile_version, "profile_source": plan.profile_source or None,
                     "num_push_blocks": plan.num_push_blocks, "num_blocks": plan.num_pages * (self.decode_layers or 0),
                     "link_gbps": plan.link_gbps, "prefill_tokens_per_s": plan.prefill_tokens_per_s,
                     "parallel": plan.parallel, "background": plan.background} if plan else None,
            "prefill_worker_id": self.prefill.worker_id if self.prefill else None,
            "decode_worker_id": self.decode.worker_id if self.decode else None,
            "prompt_tokens": len(self.job.prompt_ids),
            "token_ids": self.token_ids,
        }
