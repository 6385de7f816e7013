"""Prefill worker: runs prompts and pushes their KV to the decode node while it computes.

Life of a request here:
  1. `prefill` arrives with the prompt and the decode node's KvHandle (where its slab is).
  2. A slab is allocated in the local store; the prompt runs on the torch thread, layer by layer.
  3. As each layer lands in the local slab, its push to the decode node starts (layer-wise overlap, `full`
     mode): one segment per (K|V, head), straight into the decode slab's rows.
  4. The first token is sampled and returned at once; the last layers' pushes may still be in flight.
  5. When every push is acked, the local slab is freed. A failed push is reported to the decode node
     (`transfer_failed`) so the waiting side learns at once; `abort` cancels pushes and frees the slab.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import Abort, Ack, KvHandle, Prefill, PrefillDone, TransferFailed, encode, subjects
from shared.dataplane import DataPlaneError, Lane, Segment
from shared.kvstore import OutOfPages, Slab, slab_rows
from shared.rpc import RequestRefused, endpoint
from shared.worker import ModelWorkerService
from services.prefill.config import PrefillConfig
from services.prefill.engine import PrefillEngine

log = structlog.get_logger()


@dataclass
class Transfer:
    """One request's KV on its way out: the local slab, where it goes, and the pushes in flight."""

    handle: KvHandle
    slab: Slab
    pushes: list[asyncio.Task[None]] = field(default_factory=list)
    num_bytes: int = 0


class PrefillService(ModelWorkerService):
    role = "prefill"
    config: PrefillConfig

    def __init__(self, config: PrefillConfig):
        super().__init__(config)
        self.engine: PrefillEngine | None = None
        self.active: dict[str, Transfer] = {}

    async def start(self, nc: Client, micro: MicroService) -> None:
        await super().start(nc, micro)
        assert self.runner and self.store
        self.engine = PrefillEngine(self.runner, self.store)
        await self.add_endpoints(micro, prefill=endpoint(Prefill, self.prefill), abort=endpoint(Abort, self.abort))

    # --- handlers ------------------------------------------------------------------------
    async def prefill(self, req: Prefill) -> PrefillDone:
        assert self.engine and self.store and self.runner
        self._check(req)
        try:
            slab = self.store.allocate(req.request_id, len(req.token_ids))
        except OutOfPages as exc:
            raise RequestRefused("overloaded", str(exc)) from None
        transfer = self.active[req.request_id] = Transfer(req.handle, slab)
        loop = asyncio.get_running_loop()

        def on_layer_stored(layer: int) -> None:  # torch thread
            loop.call_soon_threadsafe(self._start_push, transfer, layer)

        started = loop.time()
        try:
            first = await self.in_torch(self.engine.run, slab, req.token_ids, req.sampling, on_layer_stored)
        except BaseException:
            await self._finish(req.request_id, cancel=True)
            raise
        prefill_s = loop.time() - started
        log.info("prefill_done", tokens=len(req.token_ids), prefill_s=round(prefill_s, 3),
                 tokens_per_s=round(len(req.token_ids) / prefill_s, 1))
        asyncio.create_task(self._await_pushes(req.request_id))
        return PrefillDone(req.request_id, first, self.worker_id, len(req.token_ids), prefill_s)

    async def abort(self, req: Abort) -> Ack:
        await self._finish(req.request_id, cancel=True)
        return Ack()

    # --- internals -------------------------------------------------------------------------
    def _check(self, req: Prefill) -> None:
        assert self.store and self.runner
        if req.transfer_mode != "full":
            raise RequestRefused("bad_request", f"prefill serves transfer_mode 'full', not {req.transfer_mode!r}")
        if req.request_id in self.active:
            raise RequestRefused("bad_request", f"request {req.request_id} is already being prefilled here")
        if not req.token_ids or len(req.token_ids) != req.handle.num_tokens:
            raise RequestRefused("bad_request", "the prompt is empty or does not match the KV handle's token count")
        if len(req.token_ids) > self.runner.max_positions:
            raise RequestRefused("bad_request", f"prompt of {len(req.token_ids)} tokens exceeds the model's {self.runner.max_positions}")
        if req.handle.layout != self.store.layout:
            raise RequestRefused("bad_request", f"KV layout mismatch: decode has {req.handle.layout}, prefill has {self.store.layout}")
        if req.handle.capacity < len(req.token_ids) or req.handle.offset < 0:
            raise RequestRefused("bad_request", "the KV handle's slab does not fit the prompt")
        if len(self.active) >= self.config.max_active_requests:
            raise RequestRefused("overloaded", f"{len(self.active)} requests in progress")

    def _start_push(self, transfer: Transfer, layer: int) -> None:
        if self.active.get(transfer.handle.request_id) is not transfer:
            return  # aborted while the torch thread was still on it: nothing may push from a freed slab
        assert self.store
        handle = transfer.handle
        src = self.store.rows(transfer.slab, layer, 0, handle.num_tokens)
        dst = slab_rows(handle.layout, handle.offset, handle.capacity, layer, 0, handle.num_tokens)
        segments = [Segment(s, d, length) for (s, length), (d, _) in zip(src, dst)]
        transfer.pushes.append(asyncio.create_task(self._push(transfer, segments)))

    async def _push(self, transfer: Transfer, segments: list) -> None:
        assert self.dataplane
        handle = transfer.handle
        # full mode: the decode node waits for every byte, so these go on the ON_DEMAND lane
        await asyncio.wait_for(self.dataplane.push(handle.dataplane_addr, handle.ticket, segments, Lane.ON_DEMAND),
                               self.config.push_timeout_s)
        n = sum(s.length for s in segments)
        transfer.num_bytes += n
        self.latency.kv_bytes.inc(n, path="full")

    async def _await_pushes(self, request_id: str) -> None:
        transfer = self.active.get(request_id)
        if transfer is None:
            return
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                # NOTE: every layer's push task exists by now: prefill returned after the last layer.
                await asyncio.gather(*transfer.pushes)
                log.info("kv_pushed", kv_bytes=transfer.num_bytes)
                self.latency.requests.inc(status="ok")
            except (DataPlaneError, asyncio.TimeoutError, OSError) as exc:
                log.warning("kv_push_failed", error=str(exc))
                self.latency.requests.inc(status="transfer_failed")
                await self._report_failure(transfer.handle, f"KV push failed: {exc}")
            except asyncio.CancelledError:
                pass
            await self._finish(request_id, cancel=True)

    async def _report_failure(self, handle: KvHandle, error: str) -> None:
        if self.nc is not None:
            subject = subjects.worker("decode", handle.decode_worker_id, "transfer_failed")
            await self.nc.publish(subject, encode(TransferFailed(handle.request_id, error)))

    async def _finish(self, request_id: str, cancel: bool) -> None:
        transfer = self.active.pop(request_id, None)
        if transfer is None:
            return
        if cancel:
            for task in transfer.pushes:
                task.cancel()
        # NOTE: the slab is only reused once no push is still reading it and the torch thread is done with it
        # (an abort can arrive mid-prefill; the barrier job queues behind that prefill).
        await asyncio.gather(*transfer.pushes, return_exceptions=True)
        await asyncio.shield(self.in_torch(lambda: None))
        assert self.store
        self.store.free(request_id)

    def stats(self) -> dict[str, Any]:
        stats = super().stats()
        stats["leases_open"] = len(self.active)  # a prefill holds KV for a request until its pushes finish
        return stats

    async def stop(self) -> None:
        for request_id in list(self.active):
            await self._finish(request_id, cancel=True)
        await super().stop()
