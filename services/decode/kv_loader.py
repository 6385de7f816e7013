"""Building a request's cache on the KV that landed in its slab, and its view of the KV still on the prefill node:
the decode service's `_receive_kv` calls `load` once the push has landed, or `load_while_pushing` (no global
push barrier) when `starts_while_pushing` says step 1 may start before it has. Torch work goes to the torch
thread (`in_torch`); the remote reads and the lease are RemoteKv's and RemoteKvLifecycle's."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from schemas import DENSE_LAYERS, Generate, PlanState, mode_of, pushed_pages
from schemas.modes import Aux
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.dataplane import DataPlane
from shared.runtime.profiles import NUM_BLOCKS
from services.decode.config import DecodeConfig
from services.decode.remote import RemoteKv
from services.decode.remote_lifecycle import RemoteKvLifecycle, background_read_bytes
from services.decode.request import DecodeRequest


class KvLoader:
    def __init__(self, engine: DecodeEngine, store: KvStore, dataplane: DataPlane, remote_kv: RemoteKvLifecycle,
                 config: DecodeConfig, in_torch: Callable[..., Awaitable[Any]]):
        self.engine, self.store, self.dataplane, self.remote_kv = engine, store, dataplane, remote_kv
        self.config, self.in_torch = config, in_torch

    async def load(self, state: DecodeRequest, req: Generate) -> None:
        """The pushed KV has landed: make the cache, and for selective modes the selection over what is remote."""
        assert state.slab is not None
        rid, n, mode = req.request_id, len(req.token_ids), mode_of(req.transfer_mode)
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
        state.remote = self._remote_kv(state, req, pushed, by_query)
        remote = None if state.remote.is_all_local else state.remote
        await self.in_torch(self.engine.use_selection, rid, req.selector, req.kv_budget, False, state.slab, remote,
                            NUM_BLOCKS, mode.pushes_by_query)
        state.plan_state = PlanState.TRANSFERRING
        if remote is None:
            await self.remote_kv.all_local(state, 0)
            return
        self.remote_kv.start(state)

    def _remote_kv(self, state: DecodeRequest, req: Generate, pushed: np.ndarray, by_query: np.ndarray | None) -> RemoteKv:
        """The request's view of its KV still on the prefill node: `pushed` (num_layers, num_pages) the plan's
        blocks, `by_query` (num_layers, num_kv_heads, N) the entries pushed by query (None: none, or not known yet)."""
        assert state.slab is not None and req.plan is not None and req.source is not None
        return RemoteKv(self.dataplane, asyncio.get_running_loop(), req.source, self.store.layout,
                        self.store.offset(state.slab), state.slab.capacity, len(req.token_ids), pushed, req.plan.parallel,
                        self.config.kv_timeout_s, background_read_bytes(req.plan.link_gbps), by_query,
                        self.config.gather_reads, speculative=req.plan.read_ahead and self._speculates(req),
                        ranked=req.plan.background)

    def starts_while_pushing(self, state: DecodeRequest, req: Generate) -> bool:
        """No global push barrier: step 1 may start before the push has landed, each layer waiting for its own
        bytes only, where the KV left on the prefill node is read anyway (partial, smartgen), the prefill said
        what each layer pushes (and it adds up), and attention reads the slab itself (CPU: no copy to a device
        that would be taken before the bytes land)."""
        mode = mode_of(req.transfer_mode)
        return (mode.keeps_source and req.plan is not None and req.plan.early_start and req.source is not None
                and len(req.layer_push_bytes) == self.store.layout.num_layers
                and sum(req.layer_push_bytes) == state.expected_bytes and self.engine.decodes_in_the_slab
                and not state.landed.is_set())

    async def load_while_pushing(self, state: DecodeRequest, req: Generate) -> None:
        """`load` without waiting for the push: the cache and the selection are set up over a slab whose layers
        land one after another (in layer order: PrefillDone.layer_push_bytes), and step 1's layer l waits for
        layer l (`RemoteKv.ready`). Each layer's metadata is read as it lands: the selector's state when its
        attention first runs, the entries the prompt's last query pushed (present once landed)."""
        assert state.slab is not None
        assert req.plan is not None and req.source is not None
        rid, n, mode, lay = req.request_id, len(req.token_ids), mode_of(req.transfer_mode), self.store.layout
        pushed = pushed_pages(req.plan, lay.num_layers)
        await self.in_torch(self.engine.load_from_store, rid, state.slab, n)
        remote = state.remote = self._remote_kv(state, req, pushed, None)
        bitmap = self.engine.query_bitmaps(state.slab, req.selector, n) if mode.pushes_by_query else None
        prepare = None
        if req.kv_bits:  # smartgen's low-bit push: a layer's codes into its rows once they have landed
            load_codes = self.engine.pushed_codes_loader(state.slab, req.selector, n, req.kv_bits, pushed)

            def prepare(layer: int) -> None:  # torch thread, once a layer, after it landed
                load_codes(layer, bitmap(layer) if bitmap is not None and layer >= DENSE_LAYERS else None)
        remote.await_pushes(prepare)

        def layer_landed(layer: int) -> None:  # event loop, in landing order
            remote.push_landed(layer, bitmap(layer) if bitmap is not None and layer >= DENSE_LAYERS else None)

        state.layer_ends = list(itertools.accumulate(req.layer_push_bytes))
        state.on_layer_landed = layer_landed
        state.check_landed()  # the layers already here
        await self.in_torch(self.engine.use_selection, rid, req.selector, req.kv_budget, False, state.slab, remote,
                            NUM_BLOCKS, mode.pushes_by_query, True)
        state.plan_state = PlanState.TRANSFERRING
        self.remote_kv.start(state)

    def _speculates(self, req: Generate) -> bool:
        """Whether this request's layers read their predicted selection a layer early (services/decode/remote.py
        SPECULATE_WHEN_READING): only for selectors whose selection is the speculated query's (InfiniGen), where
        a prediction misses at most the step's own, local, token. Quest's and the others' guesses were measured to
        cost more selection time than the round trips they saved on this CPU (docs/results, "Speculation")."""
        # NOTE: has_selector first: on the event loop, never build (load) a selector, only look it up (sizing the
        # aux area at `open` built it already)
        return bool(req.selector) and self.engine.has_selector(req.selector) and \
            getattr(self.engine.selector(req.selector), "speculates", False)
