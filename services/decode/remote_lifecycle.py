"""The decode worker's side of a partial or smartgen request's KV that is still on the prefill node (paths 2
and 3, and the lease): a collaborator of DecodeService, which hands it what it needs when it builds it.

  - `start` (once the pushed KV has landed and the RemoteKv exists): keep the prefill's lease alive, and in
    smartgen run path 3: the remote view's ranked reads (the entries the latest query makes likely, every step)
    and the background batches the broker hands out (the rest, in profile order), one batch after another
    (`read_ranked`, `read_blocks`, at the end of this file);
  - `after_step` tells the broker a step is done (`progress`) and queues the background batch it answers with;
  - when every entry is local, `all_local` stops remote reads and releases the lease (`end`, which the end of
    the request, an abort or a recompute also call: it runs once);
  - `plan_event` tells the broker each plan state (`release`, at the request's end, the last one);
    `registration` repeats the live plan in every heartbeat, so a restarted broker rebuilds it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import structlog
from nats.aio.client import Client

from schemas import (Ack, BackgroundBatch, ErrorCode, KeepLease, KvLayout, PlanEvent, PlanRegistration, PlanState, Progress, Release,
                     pack_bits, subjects)
from shared.dataplane import DataPlane, DataPlaneError, Lane
from shared.runtime.rpc import Backoff, RemoteError, call, publish
from services.decode.presence import Entries
from services.decode.remote import RemoteKv
from services.decode.request import DecodeRequest

log = structlog.get_logger()
RELEASE_TIMEOUT_S = 30.0  # a frame still landing under a revoked ticket gets this long before we give up on it
RELEASE_RETRY_S = 15.0  # a `release` nobody answered (its prefill worker is between NATS servers) is asked again this long
CONTROL_TIMEOUT_S = 5.0  # release, progress: bookkeeping calls
BACKGROUND_RETRY_S = (0.05, 1.0)  # a failed background batch is read again after this long, doubling up to the cap
STEP_TIME_WEIGHT = 0.25  # each step's weight in the running step time


def is_released(state: DecodeRequest) -> bool:
    """The prefill node's lease is ended, or ending (there may never have been one)."""
    return state.progress.ending is not None


def background_can_finish(missing_bytes: int, link_gbps: float, steps_left: int, step_s: float) -> bool:
    """Whether path 3 can make a request all-local before it ends: the KV still remote, at the link's rate, must
    fit in the steps left at the step time. Otherwise its reads only compete with decoding (for the link and the
    decode process) for entries the request may never need. Unknown rates (0) do not decline."""
    if link_gbps <= 0 or step_s <= 0:
        return True
    return missing_bytes * 8 / (link_gbps * 1e9) <= steps_left * step_s


class RemoteKvLifecycle:
    def __init__(self, nc: Client, worker_id: str, model_name: str, layout: KvLayout, dataplane: DataPlane,
                 detach_remote: Callable[[str], None], background_if_it_can_finish: bool = False):
        """`detach_remote(request_id)` tells the engine that a request's attention reads no remote KV any more
        (called between steps); `background_if_it_can_finish`: DecodeConfig's setting of that name."""
        self.nc, self.worker_id, self.model_name, self.layout = nc, worker_id, model_name, layout
        self.dataplane = dataplane
        self.detach_remote = detach_remote
        self.background_if_it_can_finish = background_if_it_can_finish
        self._releasing: set[asyncio.Future[None]] = set()  # `release`s asked again in the background

    def prefill_failed(self, state: DecodeRequest, error: str) -> None:
        """The prefill side of a request failed (`transfer_failed`): a push still landing stops being waited for;
        mid-decode, the prefill node holding the rest of the KV is gone (the gateway saw its heartbeats stop), so
        this request's reads fail now rather than after the read timeout. A frozen peer never answers, so the link
        to it is cut too, which fails the reads in flight (they are every request's reads from that peer: all of
        them need it). The step that needed them fails, or under `recompute` recomputes."""
        if not state.push.landed.is_set():
            state.push_failed(error)
            return
        remote = state.remote
        if remote is None or remote.is_closed:
            return
        remote.fail(f"on-demand read impossible: {error}")
        try:
            cut = self.dataplane.cut_links(f"cut: {error}", peer=remote.source.dataplane_addr)
        except NotImplementedError:  # RDMA: a dead peer's queue pair errors by itself
            cut = 0
        log.warning("prefill_lost_mid_decode", error=error, links_cut=cut)

    @staticmethod
    def link_lost(state: DecodeRequest, peer: str, error: DataPlaneError) -> None:
        """A data-plane connection to `peer` dropped: if the request still waits for KV pushed from it, it stops."""
        req = state.req
        if req is not None and req.prefill_dataplane_addr == peer and not state.push.landed.is_set():
            state.push_failed(f"the data-plane link to prefill worker {req.prefill_worker_id} dropped: {error}")

    def start(self, state: DecodeRequest) -> None:
        """The request decodes with part of its KV remote: keep the lease, and read the background batches."""
        assert state.req is not None and state.req.plan is not None
        state.progress.helpers.append(asyncio.create_task(self._keep_lease(state)))
        if state.req.plan.background:
            state.progress.helpers.append(asyncio.create_task(self._read_background(state)))
            if state.remote is not None and state.remote.ranked:
                state.progress.helpers.append(asyncio.create_task(read_ranked(state.remote)))

    async def after_step(self, state: DecodeRequest, step: int) -> None:
        now = asyncio.get_running_loop().time()
        if state.progress.last_step_at:
            took = now - state.progress.last_step_at
            state.progress.step_s = took if not state.progress.step_s else (1 - STEP_TIME_WEIGHT) * state.progress.step_s + STEP_TIME_WEIGHT * took
        state.progress.last_step_at = now
        remote = state.remote
        if remote is None or is_released(state):
            return
        if remote.is_all_local:
            await self.all_local(state, step)
        elif state.progress.progress_call is None or state.progress.progress_call.done():
            state.progress.progress_call = asyncio.create_task(self._progress(state, step))

    async def _progress(self, state: DecodeRequest, step: int) -> None:
        """Tell the broker a step is done; queue the background batch it answers with."""
        assert state.req and state.req.plan and state.remote
        plan = state.req.plan
        wants = self._wants_background(state, step)
        try:
            batch = await call(self.nc, subjects.worker("broker", plan.broker_worker_id, "progress"),
                               Progress(state.request_id, step, state.progress.backlog, state.remote.num_missing, wants),
                               BackgroundBatch, CONTROL_TIMEOUT_S)
        except RemoteError as exc:
            log.warning("broker_progress_failed", error=exc.message)
            return
        if batch.blocks and not is_released(state):
            state.progress.backlog += len(batch.blocks)
            state.progress.background.put_nowait(batch.blocks)

    def _wants_background(self, state: DecodeRequest, step: int) -> bool:
        """Path 3 now, unless the setting is on and the rest of the KV cannot arrive before the request ends (until
        a step time is measured, after step 1, it waits)."""
        assert state.req and state.req.plan and state.remote
        if not state.req.plan.background or not self.background_if_it_can_finish:
            return True
        if not state.progress.step_s:
            return False
        remote = state.remote
        can = background_can_finish(remote.num_missing * remote.entry_bytes, state.req.plan.link_gbps,
                                    state.req.max_tokens - 1 - step, state.progress.step_s)
        if not can and not state.progress.background_declined:
            state.progress.background_declined = True
            log.info("background_declined", step=step, missing_entries=remote.num_missing,
                     link_gbps=state.req.plan.link_gbps, step_s=round(state.progress.step_s, 4))
        return can

    async def _read_background(self, state: DecodeRequest) -> None:
        """Read the broker's batches one after another. A batch that fails is read again after a backoff (the
        broker handed it out once: dropped, those entries would stay remote and the lease held for good), until
        the remote KV is closed or its prefill is lost; every step's on-demand reads go on meanwhile."""
        remote = state.remote
        assert remote is not None
        retry_s = BACKGROUND_RETRY_S[0]
        while True:
            blocks = await state.progress.background.get()
            while True:
                try:
                    await read_blocks(remote, blocks)
                    retry_s = BACKGROUND_RETRY_S[0]
                    break
                except Exception as exc:
                    if remote.is_closed or remote.failure:
                        state.progress.backlog -= len(blocks)
                        return
                    log.warning("background_read_failed", error=str(exc), retry_s=retry_s)
                    await asyncio.sleep(retry_s)
                    retry_s = min(2 * retry_s, BACKGROUND_RETRY_S[1])
            state.progress.backlog -= len(blocks)

    async def _keep_lease(self, state: DecodeRequest) -> None:
        assert state.req and state.req.source
        source = state.req.source
        while not is_released(state):
            await publish(self.nc, subjects.worker("prefill", source.prefill_worker_id, "keep"),
                          KeepLease(state.request_id))
            await asyncio.sleep(source.lease_s / 3)

    async def all_local(self, state: DecodeRequest, step: int) -> None:
        """Every entry is on this node: stop remote reads and end the prefill's lease."""
        self.detach_remote(state.request_id)  # NOTE: between steps, so no attention call is using it
        state.progress.all_local_step = step
        log.info("kv_all_local", step=step)
        await asyncio.shield(self.end(state, PlanState.ALL_LOCAL))
        self.plan_event(state, PlanState.ALL_LOCAL)

    async def release(self, state: DecodeRequest, plan_state: PlanState, reason: str) -> None:
        """The request ends, or was refused: `end` the remote KV, then tell the broker the plan's last state
        (unless it has one already)."""
        await asyncio.shield(self.end(state, reason or plan_state))
        if not state.progress.plan_state.is_final:
            self.plan_event(state, plan_state, reason)

    def end(self, state: DecodeRequest, reason: str) -> asyncio.Future[None]:
        """Stop reading, wait for reads in flight, release the prefill's lease. Idempotent: every call gets the
        same task (await it shielded)."""
        if state.progress.ending is None:
            state.progress.ending = asyncio.ensure_future(self._release_remote(state, reason))
        return state.progress.ending

    async def _release_remote(self, state: DecodeRequest, reason: str) -> None:
        for task in state.progress.helpers:
            task.cancel()
        await asyncio.gather(*state.progress.helpers, return_exceptions=True)
        if state.remote is not None:
            await state.remote.close(RELEASE_TIMEOUT_S)
        source = state.req.source if state.req else None
        if source is not None and not await self._release_lease(source.prefill_worker_id, state.request_id, reason):
            # NOTE: nobody answered: a prefill worker whose NATS server died answers again once it has reconnected
            # to another (seconds). Asked again in the background, so the request's end does not wait; given up
            # on, its lease frees the KV only lease_s later
            task = asyncio.ensure_future(self._release_again(source.prefill_worker_id, state.request_id, reason))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _release_lease(self, prefill_worker_id: str, request_id: str, reason: str) -> bool:
        """Tell the prefill worker to free the request's KV: True once it has (or refused for good), False while
        nobody answers."""
        try:
            await call(self.nc, subjects.worker("prefill", prefill_worker_id, "release"), Release(request_id, reason),
                       Ack, CONTROL_TIMEOUT_S)
        except RemoteError as exc:
            if exc.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT):
                log.info("release_unanswered", prefill_worker_id=prefill_worker_id, error=exc.message)
                return False
            log.warning("release_failed", prefill_worker_id=prefill_worker_id, error=exc.message)
        return True

    async def _release_again(self, prefill_worker_id: str, request_id: str, reason: str) -> None:
        backoff = Backoff(RELEASE_RETRY_S)
        while backoff.left:
            await backoff.wait()
            if await self._release_lease(prefill_worker_id, request_id, reason):
                return
        log.warning("release_failed", prefill_worker_id=prefill_worker_id, request_id=request_id,
                    error=f"no answer within {RELEASE_RETRY_S:g} s: its lease frees the KV")

    def plan_event(self, state: DecodeRequest, plan_state: PlanState, reason: str = "") -> None:
        """The plan moved to `plan_state`: tell its broker."""
        state.progress.plan_state = plan_state
        plan = state.req.plan if state.req else None
        if plan is not None:
            event = PlanEvent(state.request_id, plan_state, reason)
            asyncio.ensure_future(publish(self.nc, subjects.worker("broker", plan.broker_worker_id, "event"), event))

    def registration(self, state: DecodeRequest) -> PlanRegistration | None:
        """A live plan as the broker should know it (repeated in every heartbeat)."""
        req = state.req
        if req is None or req.plan is None or state.progress.plan_state.is_final:
            return None
        lay = self.layout
        if state.remote is not None:
            local = state.remote.local_blocks()
        else:
            local = np.full((lay.num_layers, req.plan.num_pages), state.progress.plan_state is PlanState.ALL_LOCAL)
        return PlanRegistration(req.plan, state.progress.plan_state, self.model_name, req.selector, req.prefill_worker_id,
                                self.worker_id, state.num_tokens, lay.num_layers, lay.page_tokens, pack_bits(local))


# --- path 3's reads --------------------------------------------------------------------------------------
# The rest of a request's KV, read on the background lane while it decodes (docs/architecture.md, "The three
# transfer paths"). Two sources of work, both run as event-loop tasks started by `start`: the broker's blocks in
# profile order (`read_blocks`) and, where path 3 is ranked, each layer's selection under a wider budget for the
# latest query (`read_ranked`, queued by RemoteKv.rank from the torch thread). Neither ever puts a chunk on the
# wire while an on-demand read of the same request waits (RemoteKv.wait_on_demand_idle), and one chunk of a
# request is on the wire at a time.

async def read_blocks(remote: RemoteKv, blocks: list[int]) -> None:
    """Path 3: move these (layer, page) blocks' entries that are not here yet on the background lane, one small
    read at a time (`background_read_bytes`, entries of any layers), never while an on-demand read of this
    request is waiting."""
    wanted = remote.presence.missing_in_blocks(blocks)
    per_read = remote.entries_per_background_read
    for at in range(0, wanted.size, per_read):
        async with remote.background_turn:  # one background chunk of this request on the wire at a time
            await remote.wait_on_demand_idle()
            if remote.is_closed:
                return
            chunk = remote.presence.missing(wanted[at: at + per_read])  # on-demand reads may have brought some
            num_bytes = await remote.read_entries(chunk, Lane.BACKGROUND) if chunk.size else 0
        remote.bytes_background += num_bytes


async def read_ranked(remote: RemoteKv) -> None:
    """(event loop task, while the request has remote KV) Read the queued rankings' remote parts, oldest first,
    in background-lane chunks, never while an on-demand read of this request is waiting. One chunk may span
    several layers' rankings; each round takes from the queue only as many rankings as fill one chunk, so the others
    can still be replaced by newer ones. What is remote is decided at read time, so entries an on-demand read
    brought meanwhile are not read twice. A chunk that fails is dropped (these reads only save later on-demand
    ones); a failed or closed remote view ends the task."""
    per_read = remote.entries_per_background_read
    while not remote.is_closed:
        if not remote.ranked_queue:
            remote.ranked_queued.clear()
            await remote.ranked_queued.wait()
            continue
        await remote.wait_on_demand_idle()
        parts: list[Entries] = []
        taken = 0  # entries in `parts`
        while remote.ranked_queue and taken < per_read:
            layer = next(iter(remote.ranked_queue))
            _, heads = remote.presence.remote_part(layer, remote.ranked_queue.pop(layer))
            parts.append(Entries.of_layer(layer, heads))
            taken += parts[-1].size
        wanted = Entries.concat(parts)
        for at in range(0, wanted.size, per_read):  # one chunk, or a few where the last ranking was large
            async with remote.background_turn:
                await remote.wait_on_demand_idle()
                if remote.is_closed or remote.failure:
                    return
                chunk = remote.presence.missing(wanted[at: at + per_read])
                try:
                    num_bytes = await remote.read_entries(chunk, Lane.BACKGROUND) if chunk.size else 0
                except Exception as exc:  # noqa: BLE001 (see the docstring)
                    if remote.is_closed or remote.failure:
                        return
                    log.warning("ranked_read_failed", layers=chunk.layers(), error=str(exc))
                    break
            remote.bytes_background += num_bytes
            remote.bytes_ranked += num_bytes
            remote.num_ranked_reads += 1 if num_bytes else 0
