"""Decode worker: receives a request's KV over the data plane and streams tokens.

Life of a request here:
  1. `open` (full mode): reserve a slab for the prompt's KV and the completion, grant a fresh ticket over
     exactly the prompt's rows of it; reply with the KvHandle the prefill node pushes to. Unclaimed
     reservations expire.
  2. The prefill node pushes the KV straight into the slab; each landed push is counted.
  3. `generate`: the request is admitted and a task starts. In full mode it waits until every byte has
     landed (or a `transfer_failed` arrives), then decodes with the slab as its cache (no copy), densely or
     with a selector.
     In colocated mode it runs the prefill here instead. Each token goes out on the request's stream subject.
  4. At the end, on `abort`, or on failure: revoke the ticket, wait out any frame still landing,
     free the slab and drop the cache. The last stream event says how it ended.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import (Abort, Accepted, Ack, Generate, KvHandle, OpenKv, SchemaError, TokenEvent, TransferFailed,
                     decode, encode)
from shared.dataplane import Grant
from shared.kvstore import OutOfPages, Slab
from shared.rpc import RequestRefused, endpoint
from shared.worker import ModelWorkerService
from services.decode.config import DecodeConfig
from services.decode.engine import DecodeEngine
from services.decode.selectors import Budget, PreparationMissing, default_prep_dir

log = structlog.get_logger()
RELEASE_TIMEOUT_S = 30.0  # a frame still landing under a revoked ticket gets this long before we give up on it


class TransferError(RuntimeError):
    """The KV for a request did not arrive (push failed, or timed out)."""


@dataclass
class DecodeRequest:
    request_id: str
    transfer_mode: str
    slab: Slab | None = None
    grant: Grant | None = None
    expected_bytes: int = 0
    landed: asyncio.Event = field(default_factory=asyncio.Event)  # set when all KV is here, or on failure
    failure: str = ""
    task: asyncio.Task[None] | None = None
    expiry: asyncio.TimerHandle | None = None
    is_claimed: bool = False  # `generate` has taken the request and is preparing to run it
    is_aborted: bool = False

    def on_landed(self, num_bytes: int) -> None:
        if self.expiry is not None:  # the prefill is delivering: the reservation is in use
            self.expiry.cancel()
        if self.grant is not None and self.grant.bytes_landed >= self.expected_bytes:
            self.landed.set()


class DecodeService(ModelWorkerService):
    role = "decode"
    config: DecodeConfig

    def __init__(self, config: DecodeConfig):
        super().__init__(config)
        self.engine: DecodeEngine | None = None
        self.active: dict[str, DecodeRequest] = {}

    async def start(self, nc: Client, micro: MicroService) -> None:
        await super().start(nc, micro)
        assert self.runner and self.store
        self.engine = DecodeEngine(self.runner, self.store, default_prep_dir(self.runner.path))
        await self.add_endpoints(micro, open=endpoint(OpenKv, self.open), generate=endpoint(Generate, self.generate),
                                 abort=endpoint(Abort, self.abort))
        await nc.subscribe(self.subject("transfer_failed"), cb=self.transfer_failed)

    # --- handlers ------------------------------------------------------------------------
    async def open(self, req: OpenKv) -> KvHandle:
        assert self.store and self.dataplane and self.runner
        if req.transfer_mode != "full":
            raise RequestRefused("bad_request", f"open is for transfer_mode 'full', not {req.transfer_mode!r}")
        if not 0 < req.num_tokens or req.max_tokens < 1 or req.num_tokens + req.max_tokens > self.runner.max_positions:
            raise RequestRefused("bad_request", f"{req.num_tokens} prompt + {req.max_tokens} completion tokens do not "
                                                f"fit 1..{self.runner.max_positions}")
        if self.store.pages_needed(req.num_tokens + req.max_tokens) > self.store.num_pages_total:
            raise RequestRefused("bad_request", f"{req.num_tokens} + {req.max_tokens} tokens of KV exceed this worker's "
                                                f"whole store ({self.store.num_pages_total * self.store.layout.page_tokens} "
                                                "tokens): ask for fewer tokens or raise kv_cache_mb")
        self._admit(req.request_id)
        try:
            slab = self.store.allocate(req.request_id, req.num_tokens + req.max_tokens)
        except OutOfPages as exc:
            raise RequestRefused("overloaded", str(exc)) from None
        rows = [r for layer in range(self.store.layout.num_layers) for r in self.store.rows(slab, layer, 0, req.num_tokens)]
        state = DecodeRequest(req.request_id, req.transfer_mode, slab,
                              expected_bytes=req.num_tokens * self.store.layout.token_bytes)
        state.grant = Grant(secrets.randbits(63), [(off, off + n) for off, n in rows], state.on_landed)
        self.dataplane.grant(state.grant)
        state.expiry = asyncio.get_running_loop().call_later(
            self.config.open_timeout_s, lambda: asyncio.ensure_future(self._expire(req.request_id)))
        self.active[req.request_id] = state
        return KvHandle(req.request_id, self.worker_id, self.dataplane.address, state.grant.ticket, self.store.layout,
                        req.num_tokens, self.store.offset(slab), slab.capacity)

    async def generate(self, req: Generate) -> Accepted:
        if req.transfer_mode == "full":
            state = self.active.get(req.request_id)
            if state is None or state.task is not None or state.is_claimed:
                raise RequestRefused("not_found", f"no open KV reservation for request {req.request_id}")
            if state.expiry:
                state.expiry.cancel()
        elif req.transfer_mode == "colocated":
            self._admit(req.request_id)
            state = self.active[req.request_id] = DecodeRequest(req.request_id, req.transfer_mode)
        else:
            raise RequestRefused("bad_request", f"decode serves transfer modes full and colocated, not {req.transfer_mode!r}")
        if req.max_tokens < 1 or (req.transfer_mode == "full" and req.first_token < 0):
            await self._release(state)
            raise RequestRefused("bad_request", "max_tokens must be ≥ 1 and full mode needs the first token")
        if req.selector:
            # NOTE: claimed while we wait on the torch thread, so an abort now only flags the request (it must
            # not cancel this handler: nats runs an endpoint's handlers in one long-lived task).
            state.is_claimed = True
            try:
                await self.in_torch(self.engine.selector, req.selector)  # loads offline preparation once
                Budget(req.kv_budget)
            except (ValueError, PreparationMissing) as exc:
                await self._release(state)
                raise RequestRefused("bad_request", str(exc)) from None
            if state.is_aborted:
                await self._release(state)
                raise RequestRefused("not_found", f"request {req.request_id} was aborted")
        state.task = asyncio.create_task(self._run(state, req))
        return Accepted(req.request_id, self.worker_id)

    async def abort(self, req: Abort) -> Ack:
        state = self.active.get(req.request_id)
        if state is not None:
            log.info("request_aborted", reason=req.reason)
            if state.task is not None:
                state.task.cancel()
            elif state.is_claimed:
                state.is_aborted = True  # `generate` is mid-way; it releases the request itself
            else:
                await self._release(state)
        return Ack()

    async def transfer_failed(self, msg: Any) -> None:
        try:
            failed = decode(TransferFailed, msg.data)
        except SchemaError as exc:
            log.warning("bad_message", subject=msg.subject, error=str(exc))
            return
        state = self.active.get(failed.request_id)
        if state is not None:
            state.failure = failed.error
            state.landed.set()

    # --- the request's task ---------------------------------------------------------------
    async def _run(self, state: DecodeRequest, req: Generate) -> None:
        assert self.engine and self.nc
        rid, stop_ids = req.request_id, set(req.stop_token_ids)
        kv_wait_s, index, reason, error = 0.0, 0, "length", ""
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                if state.transfer_mode == "colocated":
                    token = await self.in_torch(self.engine.prefill_local, rid, req.token_ids, req.sampling)
                    await self._emit(req, TokenEvent(rid, 0, token))
                else:
                    token = req.first_token
                    kv_wait_s = await self._wait_for_kv(state)
                    await self.in_torch(self.engine.load_from_store, rid, state.slab, len(req.token_ids))
                if req.selector:
                    self.engine.use_selection(rid, req.selector, req.kv_budget)
                while token not in stop_ids and index + 1 < req.max_tokens:
                    index += 1
                    token = await self.in_torch(self.engine.step, rid, token, req.sampling, index)
                    await self._emit(req, TokenEvent(rid, index, token))
                reason = "stop" if token in stop_ids else "length"
            except asyncio.CancelledError:
                reason = "abort"
            except Exception as exc:
                reason, error = "error", f"{type(exc).__name__}: {exc}"
                log.warning("decode_failed", error=error)
            kv_bytes = {"full": state.grant.bytes_landed} if state.grant else {}
            selection = self.engine.selections.get(rid)
            selected_share = selection.selected_share if selection and selection.selected_share is not None else 1.0
            self.latency.requests.inc(status=reason)
            for path, n in kv_bytes.items():
                self.latency.kv_bytes.inc(n, path=path)
            await self._release(state)
            if reason != "abort":
                await self._emit(req, TokenEvent(rid, index + 1, -1, reason, error, kv_bytes, kv_wait_s, selected_share))
            log.info("decode_done", finish_reason=reason, tokens=index + 1, kv_wait_s=round(kv_wait_s, 3))

    async def _wait_for_kv(self, state: DecodeRequest) -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            await asyncio.wait_for(state.landed.wait(), self.config.kv_timeout_s)
        except asyncio.TimeoutError:
            raise TransferError(f"KV did not arrive within {self.config.kv_timeout_s:g} s") from None
        if state.failure:
            raise TransferError(state.failure)
        return loop.time() - started

    async def _emit(self, req: Generate, event: TokenEvent) -> None:
        assert self.nc
        await self.nc.publish(req.stream_subject, encode(event))

    # --- cleanup ----------------------------------------------------------------------------
    def _admit(self, request_id: str) -> None:
        if request_id in self.active:
            raise RequestRefused("bad_request", f"request {request_id} is already here")
        if len(self.active) >= self.config.max_active_requests:
            raise RequestRefused("overloaded", f"{len(self.active)} requests in progress")

    async def _expire(self, request_id: str) -> None:
        state = self.active.get(request_id)
        if state is not None and state.task is None and not state.is_claimed:
            log.warning("reservation_expired", request_id=request_id)
            await self._release(state)

    async def _release(self, state: DecodeRequest) -> None:
        """Free everything a request holds. Idempotent."""
        if self.active.get(state.request_id) is state:
            del self.active[state.request_id]
        if state.expiry:
            state.expiry.cancel()
        if state.grant is not None and self.dataplane is not None:
            self.dataplane.revoke(state.grant.ticket)
            await asyncio.wait_for(state.grant.wait_idle(), RELEASE_TIMEOUT_S)
        if self.engine:
            # NOTE: queued behind any step still running for this request on the torch thread, so the slab is
            # never freed (and reused) under a computation that still writes into it.
            await asyncio.shield(self.in_torch(self.engine.end, state.request_id))
        if self.store:
            self.store.free(state.request_id)

    async def stop(self) -> None:
        for state in list(self.active.values()):
            if state.task is not None:
                state.task.cancel()
                await asyncio.gather(state.task, return_exceptions=True)
            await self._release(state)
        await super().stop()
