"""Decode worker: receives a request's KV over the data plane and streams tokens.
(Over 400 lines because the handlers and the request's task share one life cycle, told below; the request's
state is in request.py, the remote KV in remote.py and remote_lifecycle.py, what it reports in report.py, the
torch work in shared/compute/decode_engine.py.)

Life of a request here:
  1. `open`: reserve a slab for the prompt's KV and the completion, plus an aux area for what travels ahead
     of or instead of the KV (selector metadata, quantized codes); grant a fresh ticket over exactly those
     bytes; reply with the KvHandle the prefill node pushes to. Unclaimed reservations expire.
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
     revoke the ticket, wait out any frame still landing, free the slab and drop the cache. The last
     stream event says how it ended and what moved on which path.
"""
from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict, deque
from typing import Any

import structlog
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import (ErrorCode, PlanState, Abort, Accepted, Ack, Generate, KvHandle, OpenKv, ResendTokens, TokenBacklog,
                     TokenEvent, TokenLogprobs, TransferFailed, encode, mode_of, modes_where, pushed_bytes, subjects)
from schemas.modes import Aux
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import OutOfPages, Slab
from shared.compute.selectors import Budget, PreparationMissing, default_prep_dir
from shared.dataplane import DataPlaneError, Grant
from shared.runtime.profiles import NUM_BLOCKS
from shared.runtime.rpc import RequestRefused, endpoint, subscriber
from shared.runtime.worker import ModelWorkerService
from services.decode.batcher import StepBatcher
from services.decode.checks import generate_problem
from services.decode.config import DecodeConfig
from services.decode.kv_loader import KvLoader
from services.decode.remote import RemoteKv, RemoteReadError
from services.decode.remote_lifecycle import RELEASE_TIMEOUT_S, RemoteKvLifecycle
from services.decode.report import final_event, selection_stats, step1_kv_bytes
from services.decode.request import DecodeRequest, Phase

log = structlog.get_logger()


# colocated, and every disaggregated mode as the broker resolves it (auto reaches decode only at `open`)
LOCAL_MODES = modes_where(is_disaggregated=False)  # colocated: the prefill runs here, at `generate`


NUM_ABORTS_REMEMBERED = 256  # an abort can overtake its request's open or generate
NUM_STREAMS_REMEMBERED = 256  # finished streams whose tokens `resend` can still give (the gateway may have lost some)
# No global push barrier: step 1 starts once the rest of the push would land within this long at the plan's link
# rate (a step at 2K here is ~0.06 s): its layers then wait for their own bytes inside the step, which holds up
# the requests batched with it by about this much at most (`_wait_until_nearly_landed`)
EARLY_START_S = 0.1


class TransferError(RuntimeError):
    """The KV for a request did not arrive (push failed, or timed out)."""


class DecodeService(ModelWorkerService):
    role = "decode"
    config: DecodeConfig

    def __init__(self, config: DecodeConfig):
        super().__init__(config)
        self.engine: DecodeEngine | None = None
        self.batcher: StepBatcher | None = None  # continuous batching: every running request's steps go together
        self.remote_kv: RemoteKvLifecycle | None = None  # paths 2-3 and the lease (remote_lifecycle.py)
        self.loader: KvLoader | None = None  # the cache on what landed, and the remote view (kv_loader.py)
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
        self.engine = await self.in_torch(DecodeEngine, self.runner, self.store, default_prep_dir(self.runner.path),
                                          self.config.floor)
        self.batcher = StepBatcher(self.engine, self.in_torch, self.config.max_batch)
        self.remote_kv = RemoteKvLifecycle(nc, self.worker_id, self.runner.name, self.store.layout,
                                           self.engine.detach_remote, self.config.background_if_it_can_finish)
        assert self.dataplane
        self.loader = KvLoader(self.engine, self.store, self.dataplane, self.remote_kv, self.config, self.in_torch)
        await self.add_endpoints(micro, open=endpoint(OpenKv, self.open), generate=endpoint(Generate, self.generate),
                                 abort=endpoint(Abort, self.abort), resend=endpoint(ResendTokens, self.resend))
        await nc.subscribe(self.subject("transfer_failed"), cb=subscriber(TransferFailed, self.transfer_failed))
        self.dataplane.on_link_lost = self.link_lost

    # --- handlers ------------------------------------------------------------------------
    async def open(self, req: OpenKv) -> KvHandle:
        assert self.store and self.dataplane and self.runner
        if req.transfer_mode not in modes_where(is_disaggregated=True):
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"open is for disaggregated transfer modes, not {req.transfer_mode!r}")
        if not 0 < req.num_tokens or req.max_tokens < 1 or req.num_tokens + req.max_tokens > self.runner.max_positions:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"{req.num_tokens} prompt + {req.max_tokens} completion tokens do not "
                                                f"fit 1..{self.runner.max_positions}")
        aux_bytes = await self._aux_bytes(req)
        if req.request_id in self.aborted:  # NOTE: the abort overtook this open while it sized the aux area
            raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted")
        self._check_fits(req.num_tokens, req.max_tokens, aux_bytes)
        self._admit(req.request_id)
        slab = self._allocate(req.request_id, req.num_tokens + req.max_tokens, aux_bytes)
        rows = [r for layer in range(self.store.layout.num_layers) for r in self.store.rows(slab, layer, 0, req.num_tokens)]
        aux_at = self.store.aux_offset(slab)
        ranges = [(off, off + n) for off, n in rows] + ([(aux_at, aux_at + aux_bytes)] if aux_bytes else [])
        state = DecodeRequest(req.request_id, mode_of(req.transfer_mode), req.num_tokens, slab)
        state.grant = Grant(secrets.randbits(63), ranges, state.on_landed)
        self.dataplane.grant(state.grant)
        state.expiry = asyncio.get_running_loop().call_later(
            self.config.open_timeout_s, lambda: asyncio.ensure_future(self._expire(req.request_id)))
        self.active[req.request_id] = state
        return KvHandle(req.request_id, self.worker_id, self.dataplane.address, state.grant.ticket, self.store.layout,
                        req.num_tokens, self.store.offset(slab), slab.capacity, aux_at, aux_bytes, self.config.floor)

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
        assert self.runner and self.store
        problem = generate_problem(req, state, self.runner, self.store.layout)
        if problem:
            await self._release(state)
            raise RequestRefused(ErrorCode.BAD_REQUEST, problem)
        if state.slab is None:  # colocated: its KV goes in a slab here too, as in every mode
            try:
                self._check_fits(len(req.token_ids), req.max_tokens, 0)
                state.slab = self._allocate(req.request_id, len(req.token_ids) + req.max_tokens, 0)
            except RequestRefused:
                await self._release(state)
                raise
        if req.selector:
            # NOTE: claimed while we wait on the torch thread, so an abort now only flags the request (it must
            # not cancel this handler: nats runs an endpoint's handlers in one long-lived task).
            state.advance(Phase.PREPARING)
            try:
                if not self.engine.has_selector(req.selector):
                    await self.in_torch(self.engine.selector, req.selector)  # loads offline preparation once
                Budget(req.kv_budget)
            except (ValueError, PreparationMissing) as exc:
                await self._release(state)
                raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from None
            if state.phase is Phase.ABORTED:
                await self._release(state)
                raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted")
        if state.grant is not None:
            try:
                state.aux_filled = self._aux_filled(state, req)
            except RequestRefused:
                await self._release(state)
                raise
        state.req = req
        if state.grant is not None:
            state.expected_bytes = self._pushed_bytes(state, req)
            state.check_landed()
        self.streaming.add(req.request_id)
        state.advance(Phase.RUNNING)
        state.task = asyncio.create_task(self._run(state, req))
        return Accepted(req.request_id, self.worker_id)

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
        state = self.active.get(failed.request_id)
        if state is None:
            return
        if not state.landed.is_set():
            state.push_failed(failed.error)
        elif state.remote is not None and not state.remote.is_closed:
            self._lose_prefill(state.remote, failed.error)

    def _lose_prefill(self, remote: RemoteKv, error: str) -> None:
        """Mid-decode, the prefill node holding the rest of the KV is gone (the gateway saw its heartbeats stop):
        fail this request's reads now rather than after the read timeout. A frozen peer never answers, so the
        link to it is cut too, which fails the reads in flight (they are every request's reads from that peer:
        all of them need it). The step that needed them fails, or under `recompute` recomputes."""
        remote.fail(f"on-demand read impossible: {error}")
        assert self.dataplane
        try:
            cut = self.dataplane.cut_links(f"cut: {error}", peer=remote.source.dataplane_addr)
        except NotImplementedError:  # RDMA: a dead peer's queue pair errors by itself
            cut = 0
        log.warning("prefill_lost_mid_decode", error=error, links_cut=cut)

    def link_lost(self, peer: str, error: DataPlaneError) -> None:
        """A data-plane connection dropped: requests still waiting for KV pushed from that peer stop waiting."""
        for state in self.active.values():
            req = state.req
            if req is not None and req.prefill_dataplane_addr == peer and not state.landed.is_set():
                state.push_failed(f"the data-plane link to prefill worker {req.prefill_worker_id} dropped: {error}")

    # --- the request's task ---------------------------------------------------------------
    async def _run(self, state: DecodeRequest, req: Generate) -> None:
        assert self.engine and self.nc
        rid, stop_ids = req.request_id, set(req.stop_token_ids)
        tokens: list[int] = []  # the completion so far: token i is tokens[i]
        finals: list[TokenEvent] = []  # the stream's last event, once sent
        self.sent[rid] = (tokens, finals)
        while len(self.sent) > NUM_STREAMS_REMEMBERED:
            self.sent.popitem(last=False)
        kv_wait_s, reason, error = 0.0, "length", ""
        with structlog.contextvars.bound_contextvars(request_id=rid):
            try:
                if req.resume_tokens:  # moved here from a decode worker that died: rebuild, then carry on
                    tokens.extend(req.resume_tokens)
                    await self.in_torch(self.engine.recompute, rid, state.slab, req.token_ids, tokens, req.sampling,
                                        req.selector, req.kv_budget, NUM_BLOCKS)
                    state.recompute_reason = f"resumed after {len(tokens)} tokens: the first decode worker died"
                elif not state.mode.is_disaggregated:
                    first = await self.in_torch(self.engine.prefill_local_scored, rid, req.token_ids, req.sampling,
                                                state.slab)
                    tokens.append(first.token)
                    await self._emit(req, TokenEvent(rid, 0, first.token, logprobs=first.logprobs,
                                                     prompt_logprobs=first.prompt_logprobs))
                else:
                    kv_wait_s = await self._receive_kv(state, req, tokens)
                if req.selector and rid not in self.engine.selections:
                    await self.in_torch(self.engine.use_selection, rid, req.selector, req.kv_budget, False, None, None,
                                        NUM_BLOCKS)
                while tokens[-1] not in stop_ids and len(tokens) < req.max_tokens:
                    token, logprobs = await self._step(state, req, tokens)
                    tokens.append(token)
                    await self._emit(req, TokenEvent(rid, len(tokens) - 1, token, logprobs=logprobs))
                    await self.remote_kv.after_step(state, len(tokens) - 1)
                reason = "stop" if tokens[-1] in stop_ids else "length"
            except asyncio.CancelledError:
                reason = "abort"
            except Exception as exc:
                reason, error = "error", f"{type(exc).__name__}: {exc}"
                log.warning("decode_failed", error=error)
            state.advance(Phase.FINISHING)
            try:
                selection = self.engine.selections.get(rid)
                final = final_event(state, req, selection, len(tokens), reason, error, kv_wait_s,
                                    self.store.layout)
                self.latency.requests.inc(status=reason)
                for path, n in final.kv_bytes.items():
                    self.latency.kv_bytes.inc(n, path=path)
                if not state.recompute_reason and selection is not None:  # a replay would count steps twice
                    if stats := selection_stats(req, selection, self.runner):
                        asyncio.ensure_future(self.nc.publish(subjects.PROFILE_STATS, encode(stats)))
                if reason in ("length", "stop", "error"):
                    finals.append(final)  # NOTE: before it is sent, so a `resend` racing it finds it
                if reason == "error":  # the client learns at once; freeing may wait on a peer that is gone
                    await self._emit(req, final)
                await asyncio.shield(self._release(state, PlanState.FAILED if reason in ("error", "abort") else PlanState.RELEASED,
                                                   error or reason))
                if reason in ("length", "stop"):
                    await self._emit(req, final)
            finally:
                self.streaming.discard(rid)
                self.batcher.leave(rid)
            log.info("decode_done", finish_reason=reason, tokens=len(tokens), kv_wait_s=round(kv_wait_s, 3),
                     local_share=round(final.local_share, 3), all_local_step=state.all_local_step,
                     recomputed=bool(state.recompute_reason))

    async def _receive_kv(self, state: DecodeRequest, req: Generate, tokens: list[int]) -> float:
        """Disaggregated modes: wait for the pushed KV and build the cache on it. When it cannot arrive, fail
        (TransferError) or, under failure_policy `recompute`, build the cache here from the prompt. Returns the
        time spent waiting for the KV."""
        if req.first_token >= 0:
            tokens.append(req.first_token)
        started = asyncio.get_running_loop().time()
        try:
            if req.first_token < 0:  # only under `recompute` (see generate_problem): the prefill gave no first token
                raise TransferError(f"prefill worker {req.prefill_worker_id or '?'} returned no first token")
            if self.loader.starts_while_pushing(state, req):
                await self._wait_until_nearly_landed(state, req)
                await self.loader.load_while_pushing(state, req)
                state.kv_load_s = asyncio.get_running_loop().time() - started
            else:
                await self._wait_for_kv(state)
                landed = asyncio.get_running_loop().time()
                await self.loader.load(state, req)
                state.kv_load_s = asyncio.get_running_loop().time() - landed
        except (TransferError, RemoteReadError) as exc:
            if req.failure_policy != "recompute":
                raise
            await self._recompute(state, req, tokens, str(exc))
        return asyncio.get_running_loop().time() - started

    async def _step(self, state: DecodeRequest, req: Generate, tokens: list[int]) -> tuple[int, TokenLogprobs | None]:
        """One decode step: feed the last token, get the next (and its log-probabilities if asked). An on-demand read that fails mid-step fails the
        request, or under failure_policy `recompute` (once) rebuilds the cache here and takes the step again."""
        assert self.engine
        index = len(tokens)
        try:
            if index == 1:
                return await self._first_step(state, req, tokens)
            return await self.batcher.step(req.request_id, tokens[-1], req.sampling, index, req.token_ids, tokens)
        except RemoteReadError as exc:
            if req.failure_policy != "recompute" or state.recompute_reason:
                raise
            await self._recompute(state, req, tokens, str(exc))
            return await self.batcher.step(req.request_id, tokens[-1], req.sampling, index, req.token_ids, tokens)

    async def _first_step(self, state: DecodeRequest, req: Generate, tokens: list[int]) -> tuple[int, TokenLogprobs | None]:
        """Step 1, measured for `ttst_bound_s`: its all-local compute time and the bytes it needed from the link."""
        assert self.engine and self.store
        started = asyncio.get_running_loop().time()
        token = await self.batcher.step(req.request_id, tokens[-1], req.sampling, 1, req.token_ids, tokens)  # (token, its logprobs)
        waited = state.remote.step_wait[-1] if state.remote is not None and state.remote.step_wait else 0.0
        state.step1_compute_s = max(0.0, asyncio.get_running_loop().time() - started - waited)
        state.step1_kv_bytes = step1_kv_bytes(state, req, self.store.layout, self.engine.selections.get(req.request_id))
        return token

    async def _recompute(self, state: DecodeRequest, req: Generate, tokens: list[int], why: str) -> None:
        """failure_policy `recompute`: the prefill node cannot provide this request's KV, so build its cache here
        from the prompt as colocated mode does, replaying the completion so far. The computation is colocated
        mode's, so greedy tokens are the ones it gives. Token 0 goes out here if the prefill never gave it."""
        assert self.engine
        rid = req.request_id
        log.warning("kv_recompute", reason=why, tokens_so_far=len(tokens))
        state.recompute_reason = why
        self.recomputes.inc()
        if req.plan is not None:
            self.remote_kv.plan_event(state, PlanState.FAILED, f"recomputed on the decode node: {why}")
        # NOTE: stops the remote reads in the background (one may wait on a peer that is gone); the slab keeps
        # its pages until _release, which waits for that, so nothing still landing can hit reused memory.
        self.remote_kv.end(state, "recompute")
        if state.grant is not None and self.dataplane is not None:  # NOTE: no late push may land on recomputed KV
            await self.dataplane.retire(state.grant.ticket, RELEASE_TIMEOUT_S)
        first = await self.in_torch(self.engine.recompute, rid, state.slab, req.token_ids, tokens, req.sampling,
                                    req.selector,
                                    req.kv_budget, NUM_BLOCKS)
        if not tokens:
            tokens.append(first)
            await self._emit(req, TokenEvent(rid, 0, first))

    async def _wait_until_nearly_landed(self, state: DecodeRequest, req: Generate) -> None:
        """Step 1 starts while the push lands, but only once the rest of it would land, at the plan's link rate,
        within EARLY_START_S: a layer waiting for its bytes holds the torch thread, and with it every request
        stepping in the same batch, so the wait it may cause is bounded by about one decode step."""
        assert req.plan is not None
        rest = int(req.plan.link_gbps * 1e9 / 8 * EARLY_START_S) if req.plan.link_gbps > 0 else state.expected_bytes
        state.nearly_landed_at = max(1, state.expected_bytes - rest)
        state.check_landed()
        await self._wait_for_kv(state, state.nearly_landed)

    async def _wait_for_kv(self, state: DecodeRequest, until: asyncio.Event | None = None) -> float:
        """Until the whole push has landed (or `until`, which a failure sets too); TransferError if it cannot."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        source = f"prefill worker {state.req.prefill_worker_id}" if state.req and state.req.prefill_worker_id else "the prefill"
        try:
            await asyncio.wait_for((until or state.landed).wait(), self.config.kv_timeout_s)
        except asyncio.TimeoutError:
            raise TransferError(f"the KV from {source} did not arrive within {self.config.kv_timeout_s:g} s") from None
        if state.failure:
            raise TransferError(f"the KV from {source} did not arrive: {state.failure}")
        return loop.time() - started

    async def _emit(self, req: Generate, event: TokenEvent) -> None:
        assert self.nc
        await self.nc.publish(req.stream_subject, encode(event))

    # --- sizes ------------------------------------------------------------------------------
    async def _aux_bytes(self, req: OpenKv) -> int:
        """The aux area a mode needs: selector metadata (selective modes and auto) or low-bit codes."""
        assert self.engine
        mode = mode_of(req.transfer_mode)
        if mode.aux is Aux.NONE:
            return 0
        if mode.aux is Aux.METADATA and not req.selector:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"transfer_mode {req.transfer_mode!r} needs a selector")
        try:
            args = (mode.aux, req.num_tokens, req.selector, req.kv_bits, mode.pushes_by_query)
            if self.engine.has_selector(req.selector):  # sizes only: no need to queue behind the model's steps
                aux_bytes = self.engine.aux_bytes(*args)
            else:
                aux_bytes = await self.in_torch(self.engine.aux_bytes, *args)  # loads the selector's preparation once
            if req.kv_bits and Aux.CODES in (mode_of(m).aux for m in mode.resolves_to):  # auto may choose quantized
                aux_bytes = max(aux_bytes, self.engine.aux_bytes(Aux.CODES, req.num_tokens, "", req.kv_bits))
            return aux_bytes
        except (ValueError, PreparationMissing) as exc:
            raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from None

    def _aux_filled(self, state: DecodeRequest, req: Generate) -> int:
        """The part of the slab's aux area the prefill fills for the mode that runs: all of it, but for `auto`,
        which reserved room for each of its choices (metadata and a low-bit push's codes, or quantized codes)."""
        assert self.engine and state.slab is not None
        mode = mode_of(req.transfer_mode)
        try:
            needed = self.engine.aux_bytes(mode.aux, state.num_tokens, req.selector, req.kv_bits, mode.pushes_by_query)
        except (ValueError, PreparationMissing) as exc:
            raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from None
        if req.prefill_aux_bytes and req.prefill_aux_bytes != needed:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"the prefill filled {req.prefill_aux_bytes} aux bytes; this decode worker "
                                                f"expects {needed} for {req.transfer_mode} (different selector preparation?)")
        if needed > state.slab.aux_bytes:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"{req.transfer_mode} with kv_bits {req.kv_bits} needs {needed} aux bytes; "
                                                f"the reservation for {state.mode.name} has {state.slab.aux_bytes}")
        return needed

    def _pushed_bytes(self, state: DecodeRequest, req: Generate) -> int:
        """What the plan has the prefill push, in bytes: decoding starts once it has all landed."""
        assert self.store and state.slab is not None
        mode = mode_of(req.transfer_mode)
        return pushed_bytes(mode, req.plan, self.store.layout, state.num_tokens, state.aux_filled,
                            req.query_entries, mode.push_width(req.kv_bits))

    # --- cleanup ----------------------------------------------------------------------------
    def _check_fits(self, num_tokens: int, max_tokens: int, aux_bytes: int) -> None:
        """A request bigger than this worker's whole store can never run here: a 400, not a 429."""
        assert self.store
        if self.store.pages_needed(num_tokens + max_tokens, aux_bytes) > self.store.num_pages_total:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"{num_tokens} + {max_tokens} tokens of KV exceed this worker's "
                                                f"whole store ({self.store.num_pages_total * self.store.layout.page_tokens} "
                                                "tokens): ask for fewer tokens or raise kv_cache_mb")

    def _allocate(self, request_id: str, capacity: int, aux_bytes: int) -> Slab:
        """A slab for the request, or `overloaded` while the store is full."""
        assert self.store
        try:
            return self.store.allocate(request_id, capacity, aux_bytes)
        except OutOfPages as exc:
            raise RequestRefused(ErrorCode.OVERLOADED, str(exc)) from None

    def _admit(self, request_id: str) -> None:
        if request_id in self.active:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"request {request_id} is already here")
        if len(self.active) >= self.config.max_active_requests:
            raise RequestRefused(ErrorCode.AT_CAPACITY, f"at capacity: {len(self.active)} requests in progress")

    async def _expire(self, request_id: str) -> None:
        state = self.active.get(request_id)
        if state is not None and state.phase is Phase.RESERVED:
            log.warning("reservation_expired", request_id=request_id)
            await self._release(state)

    async def _release(self, state: DecodeRequest, plan_state: PlanState = PlanState.FAILED, reason: str = "") -> None:
        """Free everything a request holds. Idempotent."""
        if self.active.get(state.request_id) is state:
            del self.active[state.request_id]
        if state.expiry:
            state.expiry.cancel()
        assert self.remote_kv
        await asyncio.shield(self.remote_kv.end(state, reason or plan_state))
        if not state.plan_state.is_final:
            self.remote_kv.plan_event(state, plan_state, reason)
        if state.grant is not None and self.dataplane is not None:
            await self.dataplane.retire(state.grant.ticket, RELEASE_TIMEOUT_S)
        if self.engine:
            # NOTE: queued behind any step still running for this request on the torch thread, so the slab is
            # never freed (and reused) under a computation that still writes into it.
            await asyncio.shield(self.in_torch(self.engine.end, state.request_id))
        if self.store:
            self.store.free(state.request_id)

    def stats(self) -> dict[str, Any]:
        batcher = self.batcher
        return {**super().stats(), "batching": {"max_batch": self.config.max_batch,
                                                "batch_invariant": self.config.batch_invariant,
                                                "batches": batcher.num_batches if batcher else 0,
                                                "mean_batch": round(batcher.mean_batch, 2) if batcher else 0.0,
                                                "last_batch": batcher.last_batch if batcher else 0}}

    def load_info(self) -> dict[str, Any]:
        plans = [self.remote_kv.registration(state) for state in list(self.active.values())] if self.remote_kv else []
        return {**super().load_info(), "plans": [r for r in plans if r],
                "request_ids": sorted(set(self.active) | self.streaming)}

    async def stop(self) -> None:
        for state in list(self.active.values()):
            if state.task is not None:
                state.task.cancel()
                await asyncio.gather(state.task, return_exceptions=True)
            await self._release(state)
        if self.batcher is not None:
            await self.batcher.close()
        await super().stop()
