"""The decode worker's side of a partial or smartgen request's KV that is still on the prefill node (paths 2
and 3, and the lease), as a mixin of DecodeService:

  - after each step, `_after_step` tells the broker (`progress`) and queues the background batch it answers
    with; `_read_background` reads those blocks on the background lane, one batch after another;
  - `_keep_lease` extends the prefill's lease while anything is still read from there;
  - when every entry is local, `_all_local` stops remote reads and releases the lease (`_end_remote`, which
    the end of the request, an abort or a recompute also call: it runs once);
  - `_plan_event` tells the broker each plan state; `_registration` repeats the live plan in every heartbeat,
    so a restarted broker rebuilds it.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np
import structlog

from schemas import Ack, BackgroundBatch, KeepLease, PlanEvent, PlanRegistration, Progress, Release, encode, subjects
from shared.profiles import pack_bits
from shared.rpc import RemoteError, call

if TYPE_CHECKING:
    from services.decode.service import DecodeRequest

log = structlog.get_logger()
RELEASE_TIMEOUT_S = 30.0  # a frame still landing under a revoked ticket gets this long before we give up on it
CONTROL_TIMEOUT_S = 5.0  # release, progress: bookkeeping calls
BACKGROUND_READ_S = 0.004  # a background read is sized to occupy the link about this long


class RemoteKvLifecycle:
    """Mixin: needs the DecodeService's `nc`, `engine`, `runner`, `store` and `worker_id`."""

    async def _after_step(self, state: DecodeRequest, step: int) -> None:
        remote = state.remote
        if remote is None or state.is_released:
            return
        if remote.is_all_local:
            await self._all_local(state, step)
        elif state.progress_call is None or state.progress_call.done():
            state.progress_call = asyncio.create_task(self._progress(state, step))

    async def _progress(self, state: DecodeRequest, step: int) -> None:
        """Tell the broker a step is done; queue the background batch it answers with."""
        assert self.nc and state.req and state.req.plan and state.remote
        plan = state.req.plan
        try:
            batch = await call(self.nc, subjects.worker("broker", plan.broker_worker_id, "progress"),
                               Progress(state.request_id, step, state.backlog, state.remote.num_missing),
                               BackgroundBatch, CONTROL_TIMEOUT_S)
        except RemoteError as exc:
            log.warning("broker_progress_failed", error=exc.message)
            return
        if batch.blocks and not state.is_released:
            state.backlog += len(batch.blocks)
            state.background.put_nowait(batch.blocks)

    async def _read_background(self, state: DecodeRequest) -> None:
        assert state.remote is not None
        while True:
            blocks = await state.background.get()
            try:
                await state.remote.read_blocks(blocks)
            except Exception as exc:  # the on-demand path still serves every step; the failure shows there if real
                log.warning("background_read_failed", error=str(exc))
                return
            finally:
                state.backlog -= len(blocks)

    async def _keep_lease(self, state: DecodeRequest) -> None:
        assert self.nc and state.req and state.req.source
        source = state.req.source
        while not state.is_released:
            await self.nc.publish(subjects.worker("prefill", source.prefill_worker_id, "keep"),
                                  encode(KeepLease(state.request_id)))
            await asyncio.sleep(source.lease_s / 3)

    async def _all_local(self, state: DecodeRequest, step: int) -> None:
        """Every entry is on this node: stop remote reads and end the prefill's lease."""
        sel = self.engine.selections.get(state.request_id) if self.engine else None
        if sel is not None:
            sel.remote = None  # NOTE: between steps, so no attention call is using it
        state.all_local_step = step
        log.info("kv_all_local", step=step)
        await asyncio.shield(self._end_remote(state, "all_local"))
        self._plan_event(state, "all_local")

    def _end_remote(self, state: DecodeRequest, reason: str) -> asyncio.Future[None]:
        """Stop reading, wait for reads in flight, release the prefill's lease. Idempotent: every call gets the
        same task (await it shielded)."""
        if state.ending_remote is None:
            state.is_released = True
            state.ending_remote = asyncio.ensure_future(self._release_remote(state, reason))
        return state.ending_remote

    async def _release_remote(self, state: DecodeRequest, reason: str) -> None:
        for task in state.helpers:
            task.cancel()
        await asyncio.gather(*state.helpers, return_exceptions=True)
        if state.remote is not None:
            await state.remote.close(RELEASE_TIMEOUT_S)
        source = state.req.source if state.req else None
        if source is not None and self.nc is not None:
            try:
                await call(self.nc, subjects.worker("prefill", source.prefill_worker_id, "release"),
                           Release(state.request_id, reason), Ack, CONTROL_TIMEOUT_S)
            except RemoteError as exc:
                log.warning("release_failed", prefill_worker_id=source.prefill_worker_id, error=exc.message)

    def _plan_event(self, state: DecodeRequest, plan_state: str, reason: str = "") -> None:
        state.plan_state = plan_state
        plan = state.req.plan if state.req else None
        if plan is not None and self.nc is not None:
            event = PlanEvent(state.request_id, plan_state, reason)
            asyncio.ensure_future(self.nc.publish(subjects.worker("broker", plan.broker_worker_id, "event"), encode(event)))

    def _registration(self, state: DecodeRequest) -> PlanRegistration | None:
        """A live plan as the broker should know it (repeated in every heartbeat)."""
        req = state.req
        if req is None or req.plan is None or not self.runner or not self.store or state.plan_state in ("released", "failed"):
            return None
        lay = self.store.layout
        if state.remote is not None:
            local = state.remote.local_blocks()
        else:
            local = np.full((lay.num_layers, req.plan.num_pages), state.plan_state == "all_local")
        return PlanRegistration(req.plan, state.plan_state, self.runner.name, req.selector, req.prefill_worker_id,
                                self.worker_id, state.num_tokens, lay.num_layers, lay.page_tokens, pack_bits(local))


def background_read_bytes(link_gbps: float) -> int:
    """Background reads occupy the link ~BACKGROUND_READ_S each, so an on-demand read waits at most that long."""
    if link_gbps <= 0:
        return 256 << 10
    return int(min(256 << 10, max(8 << 10, link_gbps * 1e9 / 8 * BACKGROUND_READ_S)))
