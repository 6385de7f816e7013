"""Building a request's cache on the KV that landed in its slab, and its view of the KV still on the prefill node:
`receive` waits for the push and calls `load` once it has landed, or `load_while_pushing` (no global
push barrier) when `starts_while_pushing` says step 1 may start before it has. Torch work goes to the torch
thread (`in_torch`); the remote reads and the lease are RemoteKv's and RemoteKvLifecycle's."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import structlog

from schemas import DENSE_LAYERS, Generate, PlanState, pushed_pages
from schemas.modes import Aux
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.dataplane import DataPlane
from shared.runtime.profiles import NUM_BLOCKS
from services.decode.config import DecodeConfig
from services.decode.direct_reads import DirectReads
from services.decode.remote import RemoteKv
from services.decode.remote_lifecycle import RELEASE_TIMEOUT_S, RemoteKvLifecycle
from services.decode.request import DecodeRequest

log = structlog.get_logger()


# No global push barrier: step 1 starts once the rest of the push would land within this long at the plan's link
# rate (a step at 2K here is ~0.06 s): its layers then wait for their own bytes inside the step, which holds up
# the requests batched with it by about this much at most (`_wait_until_nearly_landed`)
EARLY_START_S = 0.1
BACKGROUND_READ_S = 0.004  # a background read is sized to occupy the link about this long
# … and this long where the request's on-demand reads travel on the torch thread's own link (direct_reads.py): they
# never queue behind a background reply there, and the peer's pacer lets them go first (shared/dataplane/pacing.py),
# so a background read may be larger, and path 3 costs the decode process fewer reads (each one is a round of the
# loop's work: its gather, its landing, its presence marks)
BACKGROUND_READ_DIRECT_S = 0.032


def background_read_bytes(link_gbps: float, direct: bool = False) -> int:
    """Background reads occupy the link ~BACKGROUND_READ_S each, so an on-demand read waits at most that long
    (BACKGROUND_READ_DIRECT_S where on-demand reads go direct)."""
    if link_gbps <= 0:
        return 256 << 10
    seconds = BACKGROUND_READ_DIRECT_S if direct else BACKGROUND_READ_S
    return int(min(256 << 10, max(8 << 10, link_gbps * 1e9 / 8 * seconds)))


class TransferError(RuntimeError):
    """The KV for a request did not arrive (push failed, or timed out)."""


class KvLoader:
    """Waits for a request's push and builds its cache on it; rebuilds it from the prompt under `recompute`."""

    def __init__(self, engine: DecodeEngine, store: KvStore, dataplane: DataPlane, remote_kv: RemoteKvLifecycle,
                 config: DecodeConfig, in_torch: Callable[..., Awaitable[Any]], direct_reads: DirectReads | None = None):
        self.engine, self.store, self.dataplane, self.remote_kv = engine, store, dataplane, remote_kv
        self.config, self.in_torch, self.direct_reads = config, in_torch, direct_reads

    async def receive(self, state: DecodeRequest, tokens: list[int]) -> None:
        """Disaggregated modes: wait for the pushed KV and build the cache on it (TransferError or RemoteReadError
        when it cannot arrive). The prefill's first token goes into `tokens`."""
        req = state.req
        if req.first_token >= 0:
            tokens.append(req.first_token)
        started = asyncio.get_running_loop().time()
        if req.first_token < 0:  # only under `recompute` (see generate_problem): the prefill gave no first token
            raise TransferError(f"prefill worker {req.prefill_worker_id or '?'} returned no first token")
        if self.starts_while_pushing(state):
            await self._wait_until_nearly_landed(state)
            await self.load_while_pushing(state)
            state.report.kv_load_s = asyncio.get_running_loop().time() - started
        elif self._dequantizes_as_it_lands(state):
            await self._receive_codes(state)
        else:
            await self._wait_for_kv(state)
            landed = asyncio.get_running_loop().time()
            await self.load(state)
            state.report.kv_load_s = asyncio.get_running_loop().time() - landed

    def _dequantizes_as_it_lands(self, state: DecodeRequest) -> bool:
        """quantized: each layer's codes are dequantized into the slab's rows as soon as that layer has landed
        (they land in layer order: PrefillDone.layer_push_bytes), so only the last layers wait after the push."""
        req = state.req
        return (state.mode.aux is Aux.CODES and len(req.layer_push_bytes) == self.store.layout.num_layers
                and sum(req.layer_push_bytes) == state.push.expected_bytes and not state.push.landed.is_set())

    async def _receive_codes(self, state: DecodeRequest) -> None:
        """quantized, layer by layer: dequantize each layer on the torch thread as it lands, then build the cache."""
        req = state.req
        assert state.slab is not None
        slab, n = state.slab, len(req.token_ids)
        jobs: list[asyncio.Future] = []

        def layer_landed(layer: int) -> None:  # event loop, in landing order
            jobs.append(asyncio.ensure_future(self.in_torch(self.engine.dequantize_layer, slab, n, req.kv_bits, layer)))

        state.push.layer_ends = list(itertools.accumulate(req.layer_push_bytes))
        state.push.on_layer_landed = layer_landed
        try:
            state.check_landed()  # the layers already here
            await self._wait_for_kv(state)
            ready = sum(job.done() for job in jobs)
        finally:  # NOTE: a queued dequantization writes into the slab: it must be done before anyone frees it
            await asyncio.gather(*jobs, return_exceptions=True)
        log.info("codes_dequantized_as_they_landed", request_id=req.request_id, layers_ready_at_last_byte=ready,
                 layers=len(jobs))
        landed = asyncio.get_running_loop().time()
        for job in jobs:
            job.result()  # a dequantization that failed fails the request
        await self.in_torch(self.engine.load_from_store, req.request_id, slab, n)
        self.remote_kv.plan_event(state, PlanState.ALL_LOCAL)
        state.report.kv_load_s = asyncio.get_running_loop().time() - landed

    async def recompute(self, state: DecodeRequest, tokens: list[int], why: str) -> int:
        """failure_policy `recompute`: the prefill node cannot provide this request's KV, so build its cache here
        from the prompt as colocated mode does, replaying the completion so far. The computation is colocated
        mode's, so greedy tokens are the ones it gives. Returns the first token's sample (token 0)."""
        req = state.req
        log.warning("kv_recompute", reason=why, tokens_so_far=len(tokens))
        state.report.recompute_reason = why
        if req.plan is not None:
            self.remote_kv.plan_event(state, PlanState.FAILED, f"recomputed on the decode node: {why}")
        # NOTE: stops the remote reads in the background (one may wait on a peer that is gone); the slab keeps
        # its pages until the service's _release, which waits for that, so nothing still landing can hit reused memory.
        self.remote_kv.end(state, "recompute")
        if state.grant is not None:  # NOTE: no late push may land on recomputed KV
            await self.dataplane.retire(state.grant.ticket, RELEASE_TIMEOUT_S)
        return await self.in_torch(self.engine.recompute, req.request_id, state.slab, req.token_ids, tokens,
                                   req.sampling, req.selector, req.kv_budget, NUM_BLOCKS)

    async def _wait_until_nearly_landed(self, state: DecodeRequest) -> None:
        """Step 1 starts while the push lands, but only once the rest of it would land, at the plan's link rate,
        within EARLY_START_S: a layer waiting for its bytes holds the torch thread, and with it every request
        stepping in the same batch, so the wait it may cause is bounded by about one decode step."""
        req = state.req
        assert req.plan is not None
        rest = int(req.plan.link_gbps * 1e9 / 8 * EARLY_START_S) if req.plan.link_gbps > 0 else state.push.expected_bytes
        state.push.nearly_landed_at = max(1, state.push.expected_bytes - rest)
        state.check_landed()
        await self._wait_for_kv(state, state.push.nearly_landed)

    async def _wait_for_kv(self, state: DecodeRequest, until: asyncio.Event | None = None) -> float:
        """Until the whole push has landed (or `until`, which a failure sets too); TransferError if it cannot."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        source = f"prefill worker {state.req.prefill_worker_id}" if state.req and state.req.prefill_worker_id else "the prefill"
        try:
            # NOTE: not wait_for, which on Python 3.11 returns, dropping the cancellation, when an abort lands as
            # the KV does: the aborted request then decoded on to max_tokens
            async with asyncio.timeout(self.config.kv_timeout_s):
                await (until or state.push.landed).wait()
        except TimeoutError:
            raise TransferError(f"the KV from {source} did not arrive within {self.config.kv_timeout_s:g} s") from None
        if state.push.failure:
            raise TransferError(f"the KV from {source} did not arrive: {state.push.failure}")
        return loop.time() - started

    async def load(self, state: DecodeRequest) -> None:
        """The pushed KV has landed: make the cache, and for selective modes the selection over what is remote."""
        req = state.req
        assert state.slab is not None
        rid, n, mode = req.request_id, len(req.token_ids), state.mode
        pushed = pushed_pages(req.plan, self.store.layout.num_layers) if mode.keeps_source and req.plan else None
        by_query = None  # (L, H, N) bool: pushed by the prompt's last query
        if mode.pushes_by_query:
            by_query = await self.in_torch(self.engine.picked_by_query, state.slab, req.selector, n)
        if mode.aux is Aux.CODES:
            await self.in_torch(self.engine.load_quantized, rid, state.slab, n, req.kv_bits)
        else:
            if req.kv_bits and pushed is not None:  # smartgen's low-bit push: its codes into the slab's rows first
                await self.in_torch(self.engine.load_pushed_codes, state.slab, req.selector, n, req.kv_bits, pushed,
                                    by_query)
            await self.in_torch(self.engine.load_from_store, rid, state.slab, n)
        if not mode.keeps_source:
            self.remote_kv.plan_event(state, PlanState.ALL_LOCAL)
            return
        assert pushed is not None and req.plan is not None and req.source is not None
        state.remote = self._remote_kv(state, pushed, by_query)
        remote = None if state.remote.is_all_local else state.remote
        await self.in_torch(self.engine.use_selection, rid, req.selector, req.kv_budget, False, state.slab, remote,
                            NUM_BLOCKS, mode.pushes_by_query)
        state.progress.plan_state = PlanState.TRANSFERRING
        if remote is None:
            await self.remote_kv.all_local(state, 0)
            return
        self.remote_kv.start(state)

    def _remote_kv(self, state: DecodeRequest, pushed: np.ndarray, by_query: np.ndarray | None) -> RemoteKv:
        """The request's view of its KV still on the prefill node: `pushed` (num_layers, num_pages) the plan's
        blocks, `by_query` (num_layers, num_kv_heads, N) the entries pushed by query (None: none, or not known yet)."""
        req = state.req
        assert state.slab is not None and req.plan is not None and req.source is not None
        n = len(req.token_ids)
        # reads as codes (smartgen with kv_bits): their records land in the slab's codes region, the push's, which
        # follows the metadata in the aux area (DecodeEngine.entry_codes)
        codes_at = self.store.aux_offset(state.slab) + self.engine.metadata_layout(req.selector, n, True).nbytes \
            if req.source.codes_bits else -1
        direct = self.direct_reads if req.plan.direct_reads and self.config.gather_reads else None
        if direct is not None:
            direct.open(req.source.dataplane_addr)  # in the background: until it is open, reads go via the loop
        read_bytes = background_read_bytes(req.plan.link_gbps, direct is not None)
        return RemoteKv(self.dataplane, asyncio.get_running_loop(), req.source, self.store.layout,
                        self.store.offset(state.slab), state.slab.capacity, n, pushed, req.plan.parallel,
                        self.config.kv_timeout_s, read_bytes, by_query,
                        self.config.gather_reads, speculative=req.plan.read_ahead and self._speculates(req),
                        ranked=req.plan.background, stalls=req.plan.stall, codes_at=codes_at,
                        region=self.store.region, direct=direct)

    def starts_while_pushing(self, state: DecodeRequest) -> bool:
        """No global push barrier: step 1 may start before the push has landed, each layer waiting for its own
        bytes only, where the KV left on the prefill node is read anyway (partial, smartgen), the prefill said
        what each layer pushes (and it adds up), and attention reads the slab itself (CPU: no copy to a device
        that would be taken before the bytes land)."""
        req = state.req
        return (state.mode.keeps_source and req.plan is not None and req.plan.early_start and req.source is not None
                and len(req.layer_push_bytes) == self.store.layout.num_layers
                and sum(req.layer_push_bytes) == state.push.expected_bytes and self.engine.decodes_in_the_slab
                and not state.push.landed.is_set())

    async def load_while_pushing(self, state: DecodeRequest) -> None:
        """`load` without waiting for the push: the cache and the selection are set up over a slab whose layers
        land one after another (in layer order: PrefillDone.layer_push_bytes), and step 1's layer l waits for
        layer l (`RemoteKv.ready`). Each layer's metadata is read as it lands: the selector's state when its
        attention first runs, the entries the prompt's last query pushed (present once landed)."""
        req = state.req
        assert state.slab is not None
        assert req.plan is not None and req.source is not None
        rid, n, mode, lay = req.request_id, len(req.token_ids), state.mode, self.store.layout
        pushed = pushed_pages(req.plan, lay.num_layers)
        await self.in_torch(self.engine.load_from_store, rid, state.slab, n)
        remote = state.remote = self._remote_kv(state, pushed, None)
        bitmap = self.engine.query_bitmaps(state.slab, req.selector, n) if mode.pushes_by_query else None
        prepare = None
        if req.kv_bits:  # smartgen's low-bit push: a layer's codes into its rows once they have landed
            load_codes = self.engine.pushed_codes_loader(state.slab, req.selector, n, req.kv_bits, pushed)

            def prepare(layer: int) -> None:  # torch thread, once a layer, after it landed
                load_codes(layer, bitmap(layer) if bitmap is not None and layer >= DENSE_LAYERS else None)
        remote.await_pushes(prepare)

        def layer_landed(layer: int) -> None:  # event loop, in landing order
            remote.push_landed(layer, bitmap(layer) if bitmap is not None and layer >= DENSE_LAYERS else None)

        state.push.layer_ends = list(itertools.accumulate(req.layer_push_bytes))
        state.push.on_layer_landed = layer_landed
        state.check_landed()  # the layers already here
        await self.in_torch(self.engine.use_selection, rid, req.selector, req.kv_budget, False, state.slab, remote,
                            NUM_BLOCKS, mode.pushes_by_query, True)
        state.progress.plan_state = PlanState.TRANSFERRING
        self.remote_kv.start(state)

    def _speculates(self, req: Generate) -> bool:
        """Whether this request's layers read their predicted selection a layer early (services/decode/remote.py
        SPECULATE_WHEN_READING): only for selectors whose selection is the speculated query's (InfiniGen), where
        a prediction misses at most the step's own, local, token. Quest's and the others' guesses were measured to
        cost more selection time than the round trips they saved on this CPU (docs/results/archive/NOTEBOOK-2026.md, "Speculation every step")."""
        # NOTE: has_selector first: on the event loop, never build (load) a selector, only look it up (sizing the
        # aux area at `open` built it already)
        return bool(req.selector) and self.engine.has_selector(req.selector) and \
            (getattr(self.engine.selector(req.selector), "speculates", False) or self.config.speculate_guesses)
