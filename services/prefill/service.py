"""Prefill worker: runs prompts and pushes their KV to the decode node while it computes.

Life of a request here:
  1. `prefill` arrives with the prompt, the decode node's KvHandle (where its slab is) and the broker's
     TransferPlan. A slab is allocated in the local store; the prompt runs on the torch thread, layer by layer.
  2. As each layer lands in the local slab, its pushes start (layer-wise overlap), by mode:
       full       the layer's K/V, one segment per (K|V, head), straight into the decode slab's rows;
       quantized  the layer's low-bit codes (computed on the torch thread), into the decode slab's aux area;
       partial,   the layer's selector metadata for every token, then the plan's blocks of this layer
       smartgen   (path 1: layers 0–1 and the most important profile blocks); smartgen first sends the
                  entries the layer's own last-position query selects (query-aware push), with their bitmap
                  inside the metadata. With the plan's `exact_push`, a layer whose push would leave only after
                  the prefill's end anyway (by the link's backlog) is held back, and every later one: once the
                  prefill is done, step 1 runs here and they push its exact selection (`Transfer.holds_back`,
                  `_push_step_one_selection`).
  3. The first token is sampled and returned (after step 1, where it ran here); the last layers' pushes may
     still be in flight. Once the reply is on its way, the prompt's new full pages go into the prefix cache
     (`_keep_prefix`, on the torch thread): copying them is not on TTFT's path.
  4. full, quantized: when every push is acked, the local slab is freed.
     partial, smartgen (lease.py): the slab stays, readable under a ticket (KvSource) and held by a lease, from when the
     last push has left, that the decode node extends (`keep`); it is freed on `release` (every entry is
     local, or the request ended), on `abort`, or when the lease expires (the decode node is told).
  5. A failed push is reported to the decode node (`transfer_failed`) so the waiting side learns at once.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import (Abort, Ack, ErrorCode, KeepLease, KvHandle, Prefill, PrefillDone, Release, Sampling,
                     TransferFailed, TransferMode, entry_region_bytes, mode_of, pushed_pages, pushed_runs, subjects)
from schemas.modes import Aux
from shared.dataplane import DataPlaneError, Lane, Segment
from shared.compute.kvstore import OutOfPages
from shared.runtime.prefill_rate import PrefillTimes, tokens_per_s
from shared.runtime import tracing
from shared.runtime.rpc import RequestRefused, endpoint, publish, subscriber
from shared.compute.selectors import DENSE_LAYERS, PreparationMissing, default_prep_dir
from shared.runtime.worker import ModelWorkerService
from services.prefill.checks import prefill_problem, reads_codes
from services.prefill.config import PrefillConfig
from services.prefill.lease import Lease
from services.prefill.pushes import Transfer, layer_pushes
from shared.compute.prefill_engine import LayerEncoder, PrefillEngine, QueryPush
from shared.compute.sampling import FirstToken

log = structlog.get_logger()
RELEASE_TIMEOUT_S = 30.0
NUM_ABORTS_REMEMBERED = 256  # an abort can overtake its request (a paused worker gets both at once)


class PrefillService(Lease, ModelWorkerService):
    """The handlers, the prefill and its pushes; the slab kept for reads under a lease (step 4) is in lease.py."""

    role = "prefill"
    config: PrefillConfig

    def __init__(self, config: PrefillConfig):
        super().__init__(config)
        self.engine: PrefillEngine | None = None
        self.active: dict[str, Transfer] = {}
        self.last_prompt_tokens = 0  # admin stats: the rate at this length
        self.prefill_times = PrefillTimes()  # by prompt length, warm-up included: what the broker plans with
        self.aborted: deque[str] = deque(maxlen=NUM_ABORTS_REMEMBERED)
        self._freeing: set[asyncio.Task] = set()  # frees run by abort and release, which reply at once
        # request id → the prefix cache insertion its prefill left for after its reply (PrefillEngine.run_then_keep)
        self._prefixes_to_keep: dict[str, Callable[[], int]] = {}
        self.leases_expired = self.metrics.counter("smartgen_kv_leases_expired_total",
                                                   "Prefill-held KV freed because its lease ran out")

    async def start(self, nc: Client, micro: MicroService) -> None:
        await super().start(nc, micro)
        assert self.runner and self.store
        prefix_cache = self.prefix_cache(self.config.prefix_cache_mb, "smartgen_prefix_cache",
                                         "looked up in the prefix cache")
        self.engine = PrefillEngine(self.runner, self.store, default_prep_dir(self.runner.path), prefix_cache)
        await self._warm_up()
        await self.add_endpoints(micro, prefill=endpoint(Prefill, self.prefill, concurrent=True,
                                                                   after_reply=self._keep_prefix),
                                 abort=endpoint(Abort, self.abort),
                                 release=endpoint(Release, self.release))
        await nc.subscribe(self.subject("keep"), cb=subscriber(KeepLease, self.keep))

    async def _warm_up(self) -> None:
        """Before taking requests: a short prefill warms the kernels, then one of `warmup_tokens` measures this
        worker's prompt rate, so the broker's first plan uses it rather than a default (which, 3× too fast on
        the development CPU, halved the first smartgen request's push budget)."""
        assert self.engine and self.store and self.runner
        num_tokens = min(self.config.warmup_tokens, self.runner.max_positions)
        if num_tokens <= 0:
            return
        ids = [(7919 * i) % self.runner.vocab_size for i in range(num_tokens)]  # any tokens: only time matters

        def run() -> float:  # torch thread: seconds of the measured prefill
            seconds = 0.0
            for n in (min(32, num_tokens), num_tokens):
                slab = self.store.allocate("warm-up", n)
                try:
                    started = time.perf_counter()
                    self.engine.run(slab, ids[:n], Sampling(), lambda _layer: None)
                    seconds = time.perf_counter() - started
                finally:
                    self.store.free("warm-up")
            return seconds

        try:
            seconds = await self.in_torch(run)
        except OutOfPages:
            log.warning("warm_up_skipped", reason="the KV store has no room for it", tokens=num_tokens)
            return
        self.prefill_times.observe(num_tokens, seconds)
        log.info("warmed_up", tokens=num_tokens, prefill_s=round(seconds, 3), tokens_per_s=round(num_tokens / seconds, 1))

    # --- handlers ------------------------------------------------------------------------
    async def prefill(self, req: Prefill) -> PrefillDone:
        assert self.engine and self.store and self.runner
        arrived = time.perf_counter()
        mode = self._check(req)
        n = len(req.token_ids)
        aux_bytes = req.handle.aux_bytes if mode.aux is not Aux.NONE else 0  # auto → full leaves decode's unused
        exact = req.plan is not None and req.plan.exact_push and mode.pushes_by_query
        # smartgen with kv_bits: reads move codes too, from a region after the decode node's reservation (every
        # entry's record at a fixed place: shared/compute/entry_codes.py), which stays here under the lease
        read_codes = entry_region_bytes(self.store.layout, n, req.kv_bits) if reads_codes(mode, req) else 0
        try:
            # NOTE: step 1 run here for the exact push appends the first token's entry: room for one more
            slab = self.store.allocate(req.request_id, n + 1 if exact else n, aux_bytes + read_codes)
        except OutOfPages as exc:
            raise RequestRefused(ErrorCode.OVERLOADED, str(exc)) from None
        transfer = self.active[req.request_id] = Transfer(req.handle, slab, mode, req.plan,
                                                          row_runs=pushed_runs(mode, req.plan, self.store.layout, n,
                                                                              req.handle.cached_tokens),
                                                          layer_push_bytes=[0] * self.store.layout.num_layers,
                                                          exact=exact)
        try:
            encode_layer = await self._encoder(req, transfer)
        except BaseException:
            await self._finish(req.request_id, cancel=True)
            raise
        loop = asyncio.get_running_loop()

        def on_layer_stored(layer: int) -> None:  # torch thread
            loop.call_soon_threadsafe(self._start_push, transfer, layer)

        by_query = transfer.query_push is not None and transfer.query_push.tokens > 0

        def run() -> tuple[FirstToken, float]:  # torch thread: the first token, and the prefill's own time in seconds
            # NOTE: prefills wait their turn on the torch thread; one aborted meanwhile is skipped, not computed
            if self.active.get(req.request_id) is not transfer:
                raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted before its prefill")
            started = transfer.prefill_started = time.perf_counter()
            first, keep = self.engine.run_then_keep(slab, req.token_ids, req.sampling, on_layer_stored, encode_layer,
                                                    by_query, reuse_prefix=True)
            self._prefixes_to_keep[req.request_id] = keep  # NOTE: kept even if the request fails now: its KV is right
            return first, time.perf_counter() - started

        if self.dataplane is not None and self.dataplane.faults.prefill_delay_s:  # fault injection (tests)
            await asyncio.sleep(self.dataplane.faults.prefill_delay_s)
        try:
            first, prefill_s = await self.in_torch(run)
        except BaseException:
            await self._finish(req.request_id, cancel=True)
            raise
        if self.active.get(req.request_id) is not transfer:  # aborted meanwhile: its slab is already freed
            raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted during its prefill")
        link = transfer.link_during_prefill(prefill_s)
        if transfer.held:
            await self._push_step_one_selection(req, transfer, first.token)
        rate = (n - first.num_cached_tokens) / prefill_s  # the tokens it computed (a prefix cache hit skips the rest)
        # NOTE: a prefix cache hit computed only part of the prompt: its time says nothing of the rate at n tokens
        if not first.num_cached_tokens and self.prefill_times.observe(n, prefill_s):  # a length not measured before
            await self.publish_heartbeat()  # tell the broker now
        self.last_prompt_tokens = n
        log.info("prefill_done", tokens=n, cached_tokens=first.num_cached_tokens, prefill_s=round(prefill_s, 3),
                 waited_s=round(transfer.prefill_started - arrived, 4),  # here, before its prefill began
                 tokens_per_s=round(rate, 1), mode=req.transfer_mode, **link)
        source = self._keep_for_reads(transfer) if mode.keeps_source else None
        asyncio.create_task(tracing.in_span("prefill.pushes", self._await_pushes(req.request_id)))
        query_entries = transfer.query_push.num_entries if transfer.query_push else 0
        return PrefillDone(req.request_id, first.token, self.worker_id, n, prefill_s, source, query_entries,
                           first.logprobs, first.prompt_logprobs, transfer.aux_filled, transfer.layer_push_bytes,
                           transfer.exact_from_layer, transfer.step_one_s, first.num_cached_tokens)

    async def _keep_prefix(self, req: Prefill) -> None:
        """After `prefill`'s reply (token 1) has left: the prompt's new full pages into the prefix cache, on the
        torch thread. NOTE: FIFO there, so a prefill queued after this one finds them. A concurrent lookup never
        sees a page half copied: PrefixCache.insert publishes each page once its copy is whole, in chain order."""
        keep = self._prefixes_to_keep.pop(req.request_id, None)
        if keep is None:  # refused before its prefill ran
            return
        delay_s = self.dataplane.faults.prefix_insert_delay_s if self.dataplane is not None else 0.0

        def run() -> tuple[int, float]:  # torch thread: pages added, seconds
            started = time.perf_counter()
            if delay_s:  # fault injection (tests): a slow insertion
                time.sleep(delay_s)
            return keep(), time.perf_counter() - started

        num_pages, seconds = await self.in_torch(run)
        log.info("prefix_kept", pages=num_pages, keep_s=round(seconds, 4))

    async def _push_step_one_selection(self, req: Prefill, transfer: Transfer, first: int) -> None:
        """The layers held back (`Transfer.holds_back`): run step 1 here, give each of them step 1's exact selection as its
        picks, then push them in layer order behind those already queued (which keep the link busy meanwhile).
        PrefillDone waits for this: it says what each layer pushes. Should step 1 fail here, they go with the last
        prompt query's picks, computed as they were stored."""
        assert self.engine and self.store and transfer.query_push and transfer.query_push.pick_exact
        query_push, n, held = transfer.query_push, len(req.token_ids), list(transfer.held)

        def run() -> None:  # torch thread
            started = time.perf_counter()
            picks = self.engine.step_one_selection(transfer.slab, n, first, req.selector, req.kv_budget,
                                                   req.handle.floor)
            for layer in held:
                query_push.pick_exact(layer, picks[layer])
            transfer.step_one_s = time.perf_counter() - started

        try:
            await self.in_torch(run)
        except Exception as exc:  # noqa: BLE001 (see the docstring)
            log.warning("step_one_selection_failed", error=repr(exc))
        if self.active.get(req.request_id) is not transfer:
            raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted during its prefill")
        transfer.held, transfer.exact, transfer.exact_from_layer = [], False, held[0]  # nothing more to hold back
        for layer in held:
            self._start_push(transfer, layer)
        log.info("step_one_selection_pushed", from_layer=held[0], step_s=round(transfer.step_one_s, 4),
                 entries=int(sum(query_push.picked[layer].sum() for layer in held)))

    async def abort(self, req: Abort) -> Ack:
        self.aborted.append(req.request_id)
        # NOTE: freed in its own task: freeing waits for the torch thread, which may have prefills queued
        self._background(self._finish(req.request_id, cancel=True))
        return Ack()

    def _background(self, freeing: Coroutine[Any, Any, None]) -> None:
        self._freeing.add(task := asyncio.create_task(freeing))
        task.add_done_callback(self._freed)

    def _freed(self, task: asyncio.Task[None]) -> None:
        self._freeing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # its pages stay held: the leak check shows them
            log.error("kv_not_freed", error=repr(task.exception()))

    # --- internals -------------------------------------------------------------------------
    def _check(self, req: Prefill) -> TransferMode:
        """The request's (resolved, disaggregated) mode, or RequestRefused saying why it cannot run here."""
        assert self.store and self.runner
        if req.request_id in self.active:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"request {req.request_id} is already being prefilled here")
        if req.request_id in self.aborted:
            raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} was aborted")
        if self.draining:
            raise RequestRefused(ErrorCode.OVERLOADED, "draining: this prefill worker is stopping; ask another")
        if problem := prefill_problem(req, self.runner, self.store.layout):
            raise RequestRefused(ErrorCode.BAD_REQUEST, problem)
        if len(self.active) >= self.config.max_active_requests:
            raise RequestRefused(ErrorCode.AT_CAPACITY, f"at capacity: {len(self.active)} requests in progress")
        return mode_of(req.transfer_mode)

    async def _encoder(self, req: Prefill, transfer: Transfer) -> LayerEncoder | None:
        """What the torch thread computes per layer besides storing it, and where that lands in the aux area."""
        assert self.engine and self.store
        n, layers = len(req.token_ids), self.store.layout.num_layers
        if transfer.mode.aux is Aux.CODES:
            layout, encode_layer = await self.in_torch(self.engine.quantizer, transfer.slab, req.kv_bits, n)
            ranges = [layout.layer_range(layer) for layer in range(layers)]
        elif transfer.mode.aux is Aux.METADATA:
            if transfer.mode.pushes_by_query:
                assert req.plan is not None
                transfer.query_push = QueryPush(req.plan.query_tokens, pushed_pages(req.plan, layers),
                                                self.store.layout.page_tokens, req.handle.floor,
                                                req.plan.query_stop_layer, req.plan.query_tail_tokens)
            try:
                read_codes_at = req.handle.aux_bytes if reads_codes(transfer.mode, req) else -1
                layout, encode_layer = await self.in_torch(self.engine.metadata_encoder, transfer.slab, req.selector, n,
                                                           transfer.query_push, req.kv_bits, read_codes_at)
            except (ValueError, PreparationMissing) as exc:
                raise RequestRefused(ErrorCode.BAD_REQUEST, str(exc)) from None
            ranges = [layout.layer_range(layer) if layer >= DENSE_LAYERS else (0, 0) for layer in range(layers)]
        else:
            return None
        needed = layout.nbytes + entry_region_bytes(self.store.layout, n, req.kv_bits if transfer.query_push else 0)
        # NOTE: an `auto` reservation has room for each of its choices; the decode worker checks the part filled
        # (PrefillDone.aux_bytes) against its own reckoning
        if needed > req.handle.aux_bytes:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"the decode node reserved {req.handle.aux_bytes} aux bytes; this "
                                                f"request needs {needed} (different selector preparation?)")
        transfer.aux_filled = needed
        transfer.aux_ranges = ranges
        return encode_layer

    def _start_push(self, transfer: Transfer, layer: int) -> None:
        if self.active.get(transfer.handle.request_id) is not transfer:
            return  # aborted while the torch thread was still on it: nothing may push from a freed slab
        # held back, so every later layer is too (layer order)
        if transfer.held or transfer.holds_back(layer, self.config.exact_from_share):
            transfer.held.append(layer)
            return
        # NOTE: queued in layer order on one lane of one link, so they land in that order (PrefillDone.layer_push_bytes)
        assert self.store
        pushes = layer_pushes(self.store, transfer, layer)
        transfer.queue(layer, sum(s.length for _, segments in pushes for s in segments))
        for path, segments in pushes:
            transfer.pushes.append(asyncio.create_task(self._push(transfer, segments, path)))

    async def _push(self, transfer: Transfer, segments: list[Segment], path: str) -> None:
        assert self.dataplane
        handle = transfer.handle
        # NOTE: the PUSH lane: above background transfer (step 1's layer l waits for layer l's pushed bytes),
        # below on-demand reads (another request's decode step is waiting on those right now)
        await asyncio.wait_for(self.dataplane.push(handle.dataplane_addr, handle.ticket, segments, Lane.PUSH),
                               self.config.push_timeout_s)
        n = sum(s.length for s in segments)
        transfer.num_bytes += n
        self.latency.kv_bytes.inc(n, path=path)

    async def _await_pushes(self, request_id: str) -> None:
        transfer = self.active.get(request_id)
        if transfer is None:
            return
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                # NOTE: every layer's push task exists by now: prefill returned after the last layer.
                await asyncio.gather(*transfer.pushes)
                log.info("kv_pushed", kv_bytes=transfer.num_bytes, mode=transfer.mode.name)
                self.latency.requests.inc(status="ok")
            except (DataPlaneError, asyncio.TimeoutError, OSError) as exc:
                log.warning("kv_push_failed", error=str(exc))
                self.latency.requests.inc(status="transfer_failed")
                await self._report_failure(transfer.handle, f"KV push failed: {exc}")
                await self._finish(request_id, cancel=True)
                return
            except asyncio.CancelledError:
                return
            if transfer.read_grant is None:  # full, quantized: everything has left
                await self._finish(request_id, cancel=False)
            else:  # the rest stays readable, as long as the decode node keeps the lease
                self._arm_lease(transfer)

    async def _report_failure(self, handle: KvHandle, error: str) -> None:
        if self.nc is not None:
            subject = subjects.worker("decode", handle.decode_worker_id, "transfer_failed")
            await publish(self.nc, subject, TransferFailed(handle.request_id, error))

    async def _finish(self, request_id: str, cancel: bool) -> None:
        transfer = self.active.pop(request_id, None)
        if transfer is None:
            return
        if transfer.lease is not None:
            transfer.lease.cancel()
        if cancel:
            for task in transfer.pushes:
                task.cancel()
        # NOTE: the slab is only reused once no push or read is still touching it and the torch thread is done
        # with it (an abort can arrive mid-prefill; the barrier job queues behind that prefill).
        await asyncio.gather(*transfer.pushes, return_exceptions=True)
        if transfer.read_grant is not None and self.dataplane is not None:
            await self.dataplane.retire(transfer.read_grant.ticket, RELEASE_TIMEOUT_S)
        await asyncio.shield(self.torch_thread.barrier())
        assert self.store
        self.store.free(request_id)

    def load_info(self) -> dict[str, Any]:
        return {**super().load_info(), "prefill_rates": self.prefill_times.report(),
                "prefix_cache_mb": self.config.prefix_cache_mb}

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats["leases_open"] = len(self.active)  # a prefill holds KV for a request until its pushes or reads finish
        rates = self.prefill_times.report()
        # the rate the broker plans the last prompt's length with (its length bucket's moving average)
        stats["prefill_tokens_per_s"] = round(tokens_per_s(rates, self.last_prompt_tokens), 2)
        stats["prefill_rates"] = [[r.tokens, r.tokens_per_s] for r in rates]
        stats["leases_expired"] = self.leases_expired.value()
        return stats

    async def stop(self) -> None:
        for request_id in list(self.active):
            await self._finish(request_id, cancel=True)
        await super().stop()

