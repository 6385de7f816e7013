"""Decode worker: receives a request's KV over the data plane and streams tokens. The handlers and the request's
task are here, `open` and admission in admission.py; the request's state, its checks and what it reports are in
request.py, the cache on what landed in kv_loader.py, the remote KV in remote.py and remote_lifecycle.py, the torch
work in shared/compute/decode_engine.py.

Life of a request here:
  1. `open` (admission.py): reserve a slab for the prompt's KV and the completion, plus an aux area for what
     travels ahead of or instead of the KV (selector metadata, quantized codes); in full mode, copy the prompt's longest
     prefix-cached run of pages into it (`cached_tokens`); grant a fresh ticket over exactly the bytes still
     to come; reply with the KvHandle the prefill node pushes to. Unclaimed reservations expire.
  2. The prefill node pushes into the slab during its prefill (the plan says what); landed bytes are counted.
  3. `generate`: the request is admitted and a task starts. It waits until everything its plan pushes has
     landed (or a `transfer_failed` arrives, or the data-plane link to the prefill drops), then:
       full       decodes in place on the slab (no copy), densely or with a selector;
       quantized  dequantizes the codes into the slab first;
       partial,   restores the selector's metadata and decodes selectively while part of the KV is still on
       smartgen   the prefill node: each step reads the missing selected entries on demand (path 2) and, in
                  smartgen, the broker feeds the rest to the background lane (path 3). Once every entry is
                  local, remote reads stop and the prefill node's lease is released.
     colocated runs the prefill here instead. Each token goes out on the request's stream subject.
     When the KV cannot arrive (the push failed, the prefill died, the link dropped, a checksum failed) or an
     on-demand read fails, failure_policy `fail` ends the request with an error that names the cause, and
     `recompute` runs the prefill here from the prompt (replaying the tokens so far) and carries on.
  4. At the end, on `abort`, or on failure: stop reading, release the prefill's lease, tell the broker,
    revoke the ticket, wait out any frame still landing, free the slab and drop the cache (a full-mode request
    that finished copies its prompt's full pages into the prefix cache first). The last
    stream event says how it ended and what moved on which path. A request whose gateway stops heartbeating
    is aborted (gateway_watch.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict, deque
from typing import Any, NoReturn

import structlog
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import (ErrorCode, ModeName, PlanState, Abort, Accepted, Ack, Generate, OpenKv, ResendTokens, TokenBacklog,
                     TokenEvent, TokenLogprobs, TransferFailed, encode, mode_of, modes_where, subjects)
from shared.compute.decode_engine import DecodeEngine
from shared.compute.grammar import TokenGrammar
from shared.compute.selectors import Budget, PreparationMissing, default_prep_dir
from shared.dataplane import DataPlaneError
from shared.runtime.profiles import NUM_BLOCKS
from shared.runtime import tracing
from shared.runtime.rpc import RequestRefused, endpoint, subscriber
from shared.runtime.worker import ModelWorkerService
from services.decode.batcher import StepBatcher
from services.decode.admission import Admission
from services.decode.config import DecodeConfig
from services.decode.gateway_watch import GatewayWatch
from services.decode.direct_reads import DirectReads, direct_reads_for
from services.decode.kv_loader import KvLoader, TransferError
from services.decode.remote import RemoteReadError
from services.decode.remote_lifecycle import RELEASE_TIMEOUT_S, RemoteKvLifecycle
from services.decode.request import DecodeRequest, Phase, selection_stats

log = structlog.get_logger()


LOCAL_MODES = modes_where(is_disaggregated=False)  # colocated: the prefill runs here, at `generate`
NUM_ABORTS_REMEMBERED = 256  # an abort can overtake its request's open or generate
NUM_STREAMS_REMEMBERED = 256  # finished streams whose tokens `resend` can still give (the gateway may have lost some)


class DecodeService(Admission, ModelWorkerService):
    """The handlers and each request's task; `open` and the admission every request passes are in admission.py."""

    role = "decode"
    config: DecodeConfig

    def __init__(self, config: DecodeConfig):
        super().__init__(config)
        self.engine: DecodeEngine | None = None
        self.batcher: StepBatcher | None = None  # continuous batching: every running request's steps go together
        self.remote_kv: RemoteKvLifecycle | None = None  # paths 2-3 and the lease (remote_lifecycle.py)
        self.loader: KvLoader | None = None  # the cache on what landed, and the remote view (kv_loader.py)
        self.direct_reads: DirectReads | None = None  # the torch thread's own links to prefill workers
        self.gateway_watch: GatewayWatch | None = None  # aborts requests whose gateway died (gateway_watch.py)
        self.active: dict[str, DecodeRequest] = {}
        self.streaming: set[str] = set()  # requests whose stream's last event is not out yet
        self.aborted: deque[str] = deque(maxlen=NUM_ABORTS_REMEMBERED)  # aborts of requests not (yet) here
        # per request, the completion tokens sent so far (the list _run appends to) and the stream's last event once
        # sent; kept NUM_STREAMS_REMEMBERED requests past their end, for `resend`
        self.sent: OrderedDict[str, tuple[list[int], list[TokenEvent]]] = OrderedDict()
        self.recomputes = self.metrics.counter("smartgen_kv_recomputes_total",
                                               "Requests whose prefill the decode worker recomputed (failure_policy recompute)")

    async def start(self, nc: Client, micro: MicroService) -> None:
        await super().start(nc, micro)
        assert self.runner and self.store
        self.runner.batch_invariant = self.config.batch_invariant
        prefix_cache = self.prefix_cache(self.config.decode_prefix_cache_mb, "smartgen_decode_prefix_cache",
                                         "of full-mode requests looked up in the decode side's prefix cache")
        self.engine = await self.in_torch(DecodeEngine, self.runner, self.store, default_prep_dir(self.runner.path),
                                          self.config.floor, prefix_cache)
        self.batcher = StepBatcher(self.engine, self.in_torch, self.config.max_batch)
        assert self.dataplane
        self.remote_kv = RemoteKvLifecycle(nc, self.worker_id, self.runner.name, self.store.layout, self.dataplane,
                                           self.engine.detach_remote, self.config.background_if_it_can_finish)
        self.direct_reads = direct_reads_for(self.dataplane, self.store.region, self.config)
        self.loader = KvLoader(self.engine, self.store, self.dataplane, self.remote_kv, self.config, self.in_torch,
                               self.direct_reads)
        await self.add_endpoints(micro, open=endpoint(OpenKv, self.open), generate=endpoint(Generate, self.generate),
                                 abort=endpoint(Abort, self.abort), resend=endpoint(ResendTokens, self.resend))
        await nc.subscribe(self.subject("transfer_failed"), cb=subscriber(TransferFailed, self.transfer_failed))
        self.dataplane.on_link_lost = self.link_lost
        self.gateway_watch = GatewayWatch(nc, self.config.gateway_ttl_s, self.config.heartbeat_s)
        await self.gateway_watch.start(self.active, lambda rid, why: self.abort(Abort(rid, why)))

    # --- handlers ------------------------------------------------------------------------
    async def generate(self, req: Generate) -> Accepted:
        if req.transfer_mode in LOCAL_MODES:
            if req.request_id in self.aborted:  # the client left before this generate was handled
                raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted")
            self._admit(req.request_id)
            state = self.active[req.request_id] = DecodeRequest(req.request_id, mode_of(req.transfer_mode))
        else:
            state = self.active.get(req.request_id)
            if state is None or state.phase is not Phase.RESERVED:
                raise RequestRefused(ErrorCode.NOT_FOUND, f"no open KV reservation for request {req.request_id}")
            if state.expiry:
                state.expiry.cancel()
        assert self.runner and self.store and self.engine
        if problem := state.generate_problem(req, self.runner, self.store.layout):
            await self._refuse(state, ErrorCode.BAD_REQUEST, problem)
        if state.slab is None:  # colocated: its KV goes in a slab here too, as in every mode
            try:
                self._check_fits(len(req.token_ids), req.max_tokens, 0)
                state.slab = self._allocate(req.request_id, len(req.token_ids) + req.max_tokens, 0)
            except RequestRefused as exc:
                await self._refuse(state, exc.code, exc.message)
        if req.selector:
            # NOTE: claimed while we wait on the torch thread, so an abort now only flags the request (it must
            # not cancel this handler: nats runs an endpoint's handlers in one long-lived task).
            state.advance(Phase.PREPARING)
            try:
                if not self.engine.has_selector(req.selector):
                    await self.in_torch(self.engine.selector, req.selector)  # loads offline preparation once
                Budget(req.kv_budget)
            except (ValueError, PreparationMissing) as exc:
                await self._refuse(state, ErrorCode.BAD_REQUEST, str(exc))
            if state.phase is Phase.ABORTED:
                await self._refuse(state, ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted")
        try:
            state.claim(req, self.engine, self.store.layout)
        except ValueError as exc:
            await self._refuse(state, ErrorCode.BAD_REQUEST, str(exc))
        self.streaming.add(req.request_id)
        state.task = asyncio.create_task(tracing.in_span("decode.generation", self._run(state)))
        return Accepted(req.request_id, self.worker_id)

    async def _refuse(self, state: DecodeRequest, code: ErrorCode, message: str) -> NoReturn:
        """Free what the request holds, then refuse its `generate` with `code`."""
        await self._release(state)
        raise RequestRefused(code, message)

    async def abort(self, req: Abort) -> Ack:
        state = self.active.get(req.request_id)
        if state is None:  # NOTE: it may overtake the request's open or generate (handlers run concurrently)
            self.aborted.append(req.request_id)
        else:
            log.info("request_aborted", reason=req.reason, phase=state.phase.value)
            if state.phase is Phase.RUNNING:
                assert state.task is not None
                state.task.cancel()
            elif state.phase is Phase.PREPARING:
                state.advance(Phase.ABORTED)  # `generate` is mid-way; it releases the request itself
            elif state.phase is Phase.RESERVED:
                await self._release(state)
        return Ack()

    async def resend(self, req: ResendTokens) -> TokenBacklog:
        """The gateway lost token events on the way (NATS is at most once): the tokens from `from_index` on, and
        the stream's last event if it is out."""
        if req.from_index < 0:
            raise RequestRefused(ErrorCode.BAD_REQUEST, "from_index must be ≥ 0")
        sent = self.sent.get(req.request_id)
        if sent is None:
            raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} is not (or no longer) known here")
        tokens, final = sent
        return TokenBacklog(req.request_id, req.from_index, tokens[req.from_index:], final[0] if final else None)

    async def transfer_failed(self, failed: TransferFailed) -> None:
        if (state := self.active.get(failed.request_id)) is not None:
            self.remote_kv.prefill_failed(state, failed.error)

    def link_lost(self, peer: str, error: DataPlaneError) -> None:
        """A data-plane connection dropped: requests still waiting for KV pushed from that peer stop waiting, and
        a read blocked on the torch thread's own link to it fails at once."""
        if self.direct_reads is not None:
            self.direct_reads.drop(peer)
        for state in self.active.values():
            self.remote_kv.link_lost(state, peer, error)

    # --- the request's task ---------------------------------------------------------------
    async def _run(self, state: DecodeRequest) -> None:
        req = state.req
        assert req and self.engine and self.nc and self.runner
        rid, stop_ids = req.request_id, set(req.stop_token_ids)
        tokens: list[int] = []  # the completion so far: token i is tokens[i]
        finals: list[TokenEvent] = []  # the stream's last event, once sent
        self.sent[rid] = (tokens, finals)
        while len(self.sent) > NUM_STREAMS_REMEMBERED:
            self.sent.popitem(last=False)
        kv_wait_s, reason, error = 0.0, "length", ""
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                if req.sampling.grammar:  # structured output: its matcher, compiled here (cached per worker)
                    state.grammar = await self.in_torch(TokenGrammar, self.runner.path, self.runner.vocab_size,
                                                        req.sampling.end_ids, req.sampling.grammar)
                if req.resume_tokens:  # moved here from a decode worker that died: rebuild, then carry on
                    tokens.extend(req.resume_tokens)
                    await self.in_torch(self.engine.recompute, rid, state.slab, req.token_ids, tokens, req.sampling,
                                        req.selector, req.kv_budget, NUM_BLOCKS)
                    state.report.recompute_reason = f"resumed after {len(tokens)} tokens: the first decode worker died"
                elif not state.mode.is_disaggregated:
                    first = await self.in_torch(self.engine.prefill_local_scored, rid, req.token_ids, req.sampling,
                                                state.slab)
                    tokens.append(first.token)
                    await self._emit(req, TokenEvent(rid, 0, first.token, logprobs=first.logprobs,
                                                     prompt_logprobs=first.prompt_logprobs))
                else:
                    kv_wait_s = await self._receive_kv(state, tokens)
                if req.selector and rid not in self.engine.selections:
                    await self.in_torch(self.engine.use_selection, rid, req.selector, req.kv_budget, False, None, None,
                                        NUM_BLOCKS)

                def is_complete() -> bool:  # structured output: its grammar allows nothing more (it ends: `stop`)
                    return state.grammar is not None and state.grammar.is_complete(tokens)
                while tokens[-1] not in stop_ids and len(tokens) < req.max_tokens and not is_complete():
                    token, logprobs = await self._step(state, tokens)
                    tokens.append(token)
                    await self._emit(req, TokenEvent(rid, len(tokens) - 1, token, logprobs=logprobs))
                    if state.remote is not None:  # paths 2-3: progress to the broker, all-local, step times
                        await self.remote_kv.after_step(state, len(tokens) - 1)
                reason = "stop" if tokens[-1] in stop_ids or is_complete() else "length"
            except asyncio.CancelledError:
                reason = "abort"
            except Exception as exc:
                reason, error = "error", f"{type(exc).__name__}: {exc}"
                log.warning("decode_failed", error=error)
            state.advance(Phase.FINISHING)
            try:
                selection = self.engine.selections.get(rid)
                final = state.final_event(selection, len(tokens), reason, error, kv_wait_s, self.store.layout)
                self.latency.requests.inc(status=reason)
                for path, n in final.kv_bytes.items():
                    self.latency.kv_bytes.inc(n, path=path)
                if not state.report.recompute_reason and selection is not None:  # a replay would count steps twice
                    if stats := selection_stats(req, selection, self.runner):
                        asyncio.ensure_future(self.nc.publish(subjects.PROFILE_STATS, encode(stats)))
                if reason in ("length", "stop", "error"):
                    finals.append(final)  # NOTE: before it is sent, so a `resend` racing it finds it
                if reason == "error":  # the client learns at once; freeing may wait on a peer that is gone
                    await self._emit(req, final)
                # a full-mode request that finished leaves its prompt's full pages to the prefix cache. NOTE: not its
                # completion's: a decode step computes a token's KV with other arithmetic than a prefill (one position,
                # not many), and the greedy tokens of a conversation's later turn then differed (SmolLM2, turn 4 of 4)
                keep = req.token_ids if reason in ("length", "stop") and req.transfer_mode == ModeName.FULL else []
                await asyncio.shield(self._release(state, PlanState.FAILED if reason in ("error", "abort") else PlanState.RELEASED,
                                                   error or reason, keep))
                if reason in ("length", "stop"):
                    await self._emit(req, final)
            finally:
                self.streaming.discard(rid)
                self.batcher.leave(rid)
            log.info("decode_done", finish_reason=reason, tokens=len(tokens), kv_wait_s=round(kv_wait_s, 3),
                     local_share=round(final.local_share, 3), all_local_step=state.progress.all_local_step,
                     recomputed=bool(state.report.recompute_reason))

    async def _receive_kv(self, state: DecodeRequest, tokens: list[int]) -> float:
        """Disaggregated modes: wait for the pushed KV and build the cache on it (KvLoader.receive). When it cannot
        arrive, fail or, under failure_policy `recompute`, build the cache here from the prompt. Returns the time
        spent waiting for the KV."""
        started = asyncio.get_running_loop().time()
        try:
            await self.loader.receive(state, tokens)
        except (TransferError, RemoteReadError) as exc:
            if state.req.failure_policy != "recompute":
                raise
            await self._recompute(state, tokens, str(exc))
        return asyncio.get_running_loop().time() - started

    async def _recompute(self, state: DecodeRequest, tokens: list[int], why: str) -> None:
        """failure_policy `recompute` (KvLoader.recompute); token 0 goes out here if the prefill never gave it."""
        self.recomputes.inc()
        first = await self.loader.recompute(state, tokens, why)
        if not tokens:
            tokens.append(first)
            await self._emit(state.req, TokenEvent(state.request_id, 0, first))

    async def _step(self, state: DecodeRequest, tokens: list[int]) -> tuple[int, TokenLogprobs | None]:
        """One decode step: feed the last token, get the next (and its log-probabilities if asked). An on-demand read that fails mid-step fails the
        request, or under failure_policy `recompute` (once) rebuilds the cache here and takes the step again."""
        req = state.req
        assert req and self.engine
        index = len(tokens)
        try:
            if index == 1:
                token = await self._first_step(state, tokens)
            else:
                token = await self.batcher.step(req.request_id, tokens[-1], req.sampling, index, req.token_ids,
                                                tokens, state.grammar)
        except RemoteReadError as exc:
            if req.failure_policy != "recompute" or state.report.recompute_reason:
                raise
            await self._recompute(state, tokens, str(exc))
            token = await self.batcher.step(req.request_id, tokens[-1], req.sampling, index, req.token_ids, tokens,
                                            state.grammar)
        state.report.step_cpu_s.append(self.batcher.step_cpu_s.pop(req.request_id, 0.0))
        return token

    async def _first_step(self, state: DecodeRequest, tokens: list[int]) -> tuple[int, TokenLogprobs | None]:
        """Step 1, measured for `ttst_bound_s`: its all-local compute time and the bytes it needed from the link."""
        req = state.req
        assert req and self.engine and self.store
        started = asyncio.get_running_loop().time()
        token = await self.batcher.step(req.request_id, tokens[-1], req.sampling, 1, req.token_ids, tokens,
                                         state.grammar)  # (token, its logprobs)
        waited = state.remote.step_wait[-1] if state.remote is not None and state.remote.step_wait else 0.0
        state.report.step1_compute_s = max(0.0, asyncio.get_running_loop().time() - started - waited)
        state.report.step1_kv_bytes = state.step1_kv_bytes(self.store.layout, self.engine.selections.get(req.request_id))
        return token

    async def _emit(self, req: Generate, event: TokenEvent) -> None:
        assert self.nc
        await self.nc.publish(req.stream_subject, encode(event))

    # --- cleanup and reports -------------------------------------------------------------------
    def is_idle(self) -> bool:  # a drain waits for the streams' last events too
        return not self.active and not self.streaming

    async def _release(self, state: DecodeRequest, plan_state: PlanState = PlanState.FAILED, reason: str = "",
                       keep: list[int] | None = None) -> None:
        """Free everything a request holds. Idempotent. `keep`: its prompt's ids, whose KV goes to the prefix cache."""
        if self.active.get(state.request_id) is state:
            del self.active[state.request_id]
        if state.expiry:
            state.expiry.cancel()
        assert self.remote_kv and self.store
        await self.remote_kv.release(state, plan_state, reason)
        if state.grant is not None and self.dataplane is not None:
            await self.dataplane.retire(state.grant.ticket, RELEASE_TIMEOUT_S)
        if self.engine:
            # NOTE: queued behind any step still running for this request on the torch thread, so the slab is
            # never freed (and reused) under a computation that still writes into it.
            await asyncio.shield(self.in_torch(self.engine.end, state.request_id, keep or ()))
        self.store.free(state.request_id)

    def _dataplane_count(self, name: str) -> float:
        """The data plane's count, and for checksum failures also those of the torch thread's direct reads."""
        count = super()._dataplane_count(name)
        if name == "checksum_failures" and getattr(self, "direct_reads", None) is not None:
            count += self.direct_reads.num_checksum_failures
        return count

    def stats(self) -> dict[str, Any]:
        b, cfg = self.batcher, self.config
        batching = {"max_batch": cfg.max_batch, "batch_invariant": cfg.batch_invariant,
                    "batches": b.num_batches if b else 0, "mean_batch": round(b.mean_batch, 2) if b else 0.0,
                    "last_batch": b.last_batch if b else 0}
        return {**super().stats(), "floor": dataclasses.asdict(cfg.floor), "batching": batching}

    def load_info(self) -> dict[str, Any]:
        plans = [self.remote_kv.registration(state) for state in list(self.active.values())] if self.remote_kv else []
        return {**super().load_info(), "plans": [r for r in plans if r],
                "request_ids": sorted(set(self.active) | self.streaming)}

    async def stop(self) -> None:
        if self.gateway_watch is not None:
            await self.gateway_watch.close()
        for state in list(self.active.values()):
            if state.task is not None:
                state.task.cancel()
                await asyncio.gather(state.task, return_exceptions=True)
            await self._release(state)
        if self.batcher is not None:
            await self.batcher.close()
        if self.direct_reads is not None:
            await self.direct_reads.close()
        await super().stop()
