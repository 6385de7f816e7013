"""Steps 1 and 3 of a request's trip (completion.py), the calls that start it: pick the workers, then
`decode.open` → `broker.open` → `prefill.prefill` → `decode.generate` (colocated: `decode.generate` only).
A decode worker that refuses for room (`overloaded`, `at_capacity`) or is gone (`unavailable`; at `open`, also one
that stops heartbeating before it answers) is passed over for the next least loaded (`_on_some_decode`): every one
full, a 429; none left alive, a 503. Mixed into CompletionRun, whose fields these methods read and set.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import structlog

from schemas import (ErrorCode, Accepted, Generate, KvHandle, OpenKv, OpenPlan, Prefill, PrefillDone, Sampling,
                     TransferPlan, WorkerInfo, mode_of, subjects)
from schemas.modes import Aux, ModeName
from shared.runtime.rpc import RemoteError, call
from services.gateway.liveness import DecodeLost, RequestFailed
from services.gateway.requests import ApiError

if TYPE_CHECKING:
    from services.gateway.completion import CompletionRun

log = structlog.get_logger()
T = TypeVar("T")
CONTROL_TIMEOUT_S = 10.0  # open / generate / abort are bookkeeping: fast or failed
DECODE_FULL_WAIT_S = 10.0  # every decode worker full after admission: keep trying this long before a 429
DECODE_FULL_RETRY_S = 0.25
BROKER_WAIT_S = 4.0  # no broker registered (the one broker restarting: ~2-3 s): wait this long before a 503 no_worker
WORKER_WAIT_POLL_S = 0.1


class Dispatch:
    def _pick(self: CompletionRun, role: str, cached: dict[str, int] | None = None) -> WorkerInfo:
        """The least loaded worker of `role`; with `cached` (worker → prompt tokens it holds), the one holding the most
        unless it runs more than the routes' slack beyond the least loaded (routing.py)."""
        worker = self.registry.pick(role, cached=cached, slack=self.routes.slack if self.routes else 0)
        if worker is None:
            raise ApiError(503, f"no {role} worker is registered; try again when /health says ok", code="no_worker")
        return worker

    async def _pick_within(self: CompletionRun, role: str, wait_s: float) -> WorkerInfo:
        """`_pick(role)`, waiting up to `wait_s` for one to register: the one broker restarting is back in ~2 s, and
        a request that waits for it is better served than refused (it holds only its admission slot meanwhile)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while self.registry.pick(role) is None and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(WORKER_WAIT_POLL_S)
        return self._pick(role)

    async def _on_some_decode(self: CompletionRun, ask: Callable[[], Awaitable[T]]) -> T:
        """`ask()` the chosen decode worker; while one answers `overloaded` (no room for the request's pages) or
        does not answer at all (`unavailable`: it died), move on to the next least loaded. When every live one refused with all its request slots taken
        (ErrorCode.AT_CAPACITY), try them all again every DECODE_FULL_RETRY_S for up to DECODE_FULL_WAIT_S: admission
        counted a slot that is not there (yet), e.g. on a worker that died and still counts until its heartbeats
        expire. Otherwise (no room for the request's KV pages), a 429 at once."""
        assert self.decode
        refused: dict[str, RemoteError] = {}
        deadline = asyncio.get_running_loop().time() + DECODE_FULL_WAIT_S
        while True:
            try:
                return await ask()
            except RemoteError as exc:
                # NOTE: `unavailable`: nobody answers on its subjects, it died (its heartbeats have not expired yet)
                if not (exc.code.is_busy or exc.code is ErrorCode.UNAVAILABLE):
                    raise
                refused[self.decode.worker_id] = exc
            following = self.registry.pick("decode", exclude=refused)
            if following is None and all(e.code is ErrorCode.AT_CAPACITY for e in refused.values()) \
                    and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(DECODE_FULL_RETRY_S)
                refused.clear()
                following = self.registry.pick("decode")
            if following is None:
                why = "; ".join(f"{worker_id}: {exc.message}" for worker_id, exc in refused.items())
                if all(e.code.is_busy for e in refused.values()):
                    raise ApiError(429, f"every decode worker is full ({why}); try again shortly", code="overloaded")
                raise ApiError(503, f"no live decode worker could take the request ({why}); try again shortly",
                               code=ErrorCode.UNAVAILABLE)
            self.decode = following

    async def _open(self: CompletionRun, prefill_hit: int) -> KvHandle:
        """decode.open → broker.open: the slab (on a decode worker with room), then the plan, which carries the
        mode and selector the request runs with (the broker resolves `auto`; nothing here decides it again) and is
        sized for a prefill that finds `prefill_hit` prompt tokens in its prefix cache."""
        job = self.job
        assert self.prefill and self.broker
        wants_metadata = mode_of(job.transfer_mode).aux is Aux.METADATA

        async def open_kv() -> KvHandle:
            assert self.decode
            ask = call(self.nc, subjects.worker("decode", self.decode.worker_id, "open"),
                       OpenKv(job.request_id, len(job.prompt_ids), job.max_tokens, job.transfer_mode,
                              self.selector if wants_metadata else "", job.kv_bits,
                              list(job.prompt_ids) if job.transfer_mode == ModeName.FULL else []),
                       KvHandle, CONTROL_TIMEOUT_S)
            # NOTE: watched by heartbeats only (the request is not in them before `open` returns): a decode worker that
            # dies between reserving and answering is `unavailable` within the TTL, not after CONTROL_TIMEOUT_S
            try:
                return await self._wait(ask, self.decode, "open", is_listed=False)
            except DecodeLost as exc:
                await self._abort(self.decode, "it stopped sending heartbeats during open", wait=False)  # if only frozen
                raise RemoteError(ErrorCode.UNAVAILABLE, str(exc)) from None

        handle = await self._on_some_decode(open_kv)
        assert self.decode
        self.decode_cached_tokens, self.page_tokens = handle.cached_tokens, handle.layout.page_tokens
        self._plan_asked = True
        self.plan = await call(self.nc, subjects.worker("broker", self.broker.worker_id, "open"),
                               OpenPlan(job.request_id, job.transfer_mode, self.decode.model, self.selector,
                                        len(job.prompt_ids), handle.layout, handle.aux_bytes, self.prefill.worker_id,
                                        self.decode.worker_id, job.ablate, job.kv_budget, handle.floor,
                                        job.kv_bits, prefill_hit),
                               TransferPlan,
                               CONTROL_TIMEOUT_S)
        self.mode, self.selector, self.decode_layers = self.plan.transfer_mode, self.plan.selector, handle.layout.num_layers
        self.kv_bits = self.plan.kv_bits
        return handle

    async def _run_prefill(self: CompletionRun, handle: KvHandle, sampling: Sampling) -> PrefillDone | None:
        """prefill.prefill: the prompt, with its pushes to `handle`; token 1 comes back. None when the prefill
        failed and failure_policy `recompute` leaves the prefill to the decode worker."""
        job = self.job
        assert self.prefill
        sends_metadata = mode_of(self.mode).aux is Aux.METADATA
        # NOTE: under `fail` the decode worker holding the reservation is watched too: if it dies while the prompt
        # waits or runs, the client is told within the heartbeat TTL, not when `generate` finds it gone
        watched = [self.decode] if job.failure_policy == "fail" and self.decode else []
        try:
            return await self._wait(
                call(self.nc, subjects.worker("prefill", self.prefill.worker_id, "prefill"),
                     Prefill(job.request_id, job.prompt_ids, self.mode, sampling, handle, self.plan,
                             self.selector if sends_metadata else "", self.kv_bits,
                             job.kv_budget if sends_metadata and self.selector else None),
                     PrefillDone, self.timeout_s), self.prefill, "the prefill", watched)
        except (RequestFailed, RemoteError) as exc:
            # NOTE: a prefill worker at capacity is load, not a failure: recomputing on decode would add load
            if job.failure_policy != "recompute" or getattr(exc, "code", None) in (ErrorCode.BAD_REQUEST, ErrorCode.OVERLOADED, ErrorCode.AT_CAPACITY):
                raise
            self.recompute_reason = f"prefill worker {self.prefill.worker_id} failed before the first token: {exc}"
            log.warning("prefill_failed_recompute", error=str(exc))
            await self._abort(self.prefill, "recomputed on the decode worker", wait=False)
            return None

    async def _generate(self: CompletionRun, first: int, done: PrefillDone | None, sampling: Sampling) -> Accepted:
        """decode.generate: continue from token 1 (or, colocated or recomputing, from the prompt)."""
        job = self.job
        assert self.decode
        prefill = self.prefill if done is not None else None
        # NOTE: watched: a decode worker that died after `open` (before NATS dropped its subscriptions) fails
        # this within the heartbeat TTL (DecodeLost), not after the call's timeout
        return await self._wait(call(self.nc, subjects.worker("decode", self.decode.worker_id, "generate"),
                          Generate(job.request_id, self.mode, job.prompt_ids, first, job.max_tokens,
                                   self.stop_token_ids, sampling, subjects.stream(job.request_id),
                                   self.selector, job.kv_budget if self.selector else None, self.plan,
                                   done.source if done else None, self.kv_bits,
                                   self.prefill.worker_id if self.prefill else "",
                                   prefill.dataplane_addr if prefill else "", job.failure_policy,
                                   done.query_entries if done else 0,
                                   prefill_aux_bytes=done.aux_bytes if done else 0,
                                   layer_push_bytes=done.layer_push_bytes if done else [], gateway_id=self.gateway_id),
                          Accepted, CONTROL_TIMEOUT_S), self.decode, "generate")
