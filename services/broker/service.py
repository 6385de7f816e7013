"""Transfer broker: one transfer plan per request, its state, its speculative queue, and the lane policy.
It decides; prefill and decode move the bytes. It never touches KV.

Life of a plan here:
  1. `open` (gateway, after decode reserved the slab): resolve `auto`, size the proactive push from the
     measured link rate and prefill rate (prefill heartbeats), order the blocks by the profile for
     (model, selector, length bucket) — positional when none is stored — and keep the rest as the
     speculative queue. State `opening`.
  2. `progress` (decode, after every step): `transferring`; the reply carries the next background batch
     (see plans.py for the lane policy).
  3. `event` (decode): `all_local` when every entry is on the decode node (the prefill's lease ends),
     `released` when the request is over; `failed` from either side. Untouched plans expire.
  4. Decode heartbeats repeat every live plan with what is local, so a restarted broker rebuilds its table.
  5. A plan whose decode worker is gone (its heartbeats stop, or a new process took its id) fails: the worker can
     die after the answer's last token but before its `released` event, where nobody else ends the plan.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import structlog
from aiohttp import web
from nats.aio.client import Client
from nats.micro.service import Service as MicroService

from schemas import (PLAN_STATES, SMARTGEN_PATHS, ErrorCode, PlanState, BackgroundBatch, entry_region_bytes, mode_of, modes_where, unpack_bits, ListQuery, OpenPlan, PlanEvent, PlanRegistration,
                     Progress, TransferPlan, WorkerInfo, WorkerList)
from shared.runtime.prefill_rate import tokens_per_s
from shared.runtime.registry import WorkerRegistry
from shared.runtime.rpc import RequestRefused, endpoint, subscriber
from shared.runtime.service import Service
from services.broker.config import BrokerConfig
from services.broker.planner import LinkEstimate, choose_mode, plan_transfer, smartgen_order
from services.broker.plans import Plan, PlanBook, PlanStateError
from services.broker.profiles import ProfileCache

log = structlog.get_logger()
EXPIRY_CHECK_S = 1.0
# NOTE: what a plan may cover (layers × pages): bounds what one request, or one heartbeat, makes the broker
# allocate. A 128K-token prompt of an 80-layer model in 16-token pages is 655,360 blocks.
MAX_PLAN_BLOCKS = 1 << 22


class BrokerService(Service):
    role = "broker"
    config: BrokerConfig

    def __init__(self, config: BrokerConfig):
        super().__init__(config)
        self.registry = WorkerRegistry(config.worker_ttl_s)
        self.book = PlanBook(config.speculative_ratio, config.plan_ttl_s)
        self.profiles = ProfileCache(self.registry, config.profile_ttl_s)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.decode_processes: dict[str, tuple[str, int, float]] = {}  # decode worker id → (host, pid, started_unix)
        self.plans_opened = self.metrics.counter("smartgen_transfer_plans_total", "Transfer plans opened", ["mode"])
        self.plans_restored = self.metrics.counter("smartgen_transfer_plans_restored_total",
                                                   "Plans rebuilt from decode heartbeats")
        self.metrics.gauge("smartgen_transfer_plans_live", "Live transfer plans", lambda: len(self.book.live))

    async def start(self, nc: Client, micro: MicroService) -> None:
        await self.add_endpoints(micro, open=endpoint(OpenPlan, self.open), progress=endpoint(Progress, self.progress),
                                 workers=endpoint(ListQuery, self.workers))
        await nc.subscribe(self.subject("event"), cb=subscriber(PlanEvent, self.event))
        await self.profiles.follow(nc)
        await self.registry.follow(nc, self.worker_id, on_info=self._on_heartbeat)
        self._spawn(self._expire_loop())

    # --- handlers ------------------------------------------------------------------------
    async def open(self, req: OpenPlan) -> TransferPlan:
        self._check(req)
        link = self._link_estimate(req.prefill_worker_id, req.num_tokens)
        # NOTE: the one place a mode is resolved; the plan carries the mode and selector to everyone after
        mode, reason = (req.transfer_mode, "") if mode_of(req.transfer_mode).is_resolved else choose_mode(req, link)
        # auto's default selector serves its selective choice only: chosen full, the request attends densely
        selector = req.selector if mode == req.transfer_mode or mode_of(mode).needs_selector else ""
        profile = None
        if mode_of(mode).orders_by_profile:
            profile = await self.profiles.get(req.model, req.selector, req.num_tokens, req.layout.num_layers)
        planned = plan_transfer(req, mode, profile.importance if profile else None, link, self.worker_id,
                                profile.label if profile else ("", 0, ""), reason, selector)
        if self.book.has_ended(req.request_id):  # its gateway gave up while the profile was fetched
            raise RequestRefused(ErrorCode.NOT_FOUND, f"request {req.request_id} ended before its plan was opened")
        self.book.add(Plan(planned.plan, req.prefill_worker_id, req.decode_worker_id, req.num_tokens,
                           deque(planned.queue)))
        self.plans_opened.inc(mode=mode)
        log.info("plan_opened", mode=mode, asked=req.transfer_mode, push_blocks=planned.plan.num_push_blocks,
                 queue=len(planned.queue), link_gbps=round(link.gbps, 4), link_source=link.source,
                 profile=planned.plan.profile_source or None)
        return planned.plan

    async def progress(self, req: Progress) -> BackgroundBatch:
        blocks, remaining = self.book.next_batch(req.request_id, req.backlog_blocks, req.wants_background)
        return BackgroundBatch(req.request_id, blocks, remaining)

    async def event(self, ev: PlanEvent) -> None:
        try:
            plan = self.book.advance(ev.request_id, ev.state, ev.reason)
        except PlanStateError as exc:
            log.warning("bad_plan_event", request_id=ev.request_id, error=str(exc))
            return
        if plan is None and PlanState(ev.state).is_final:
            self.book.end(ev.request_id)
        if plan is not None:
            log.info("plan_state", request_id=ev.request_id, state=ev.state, reason=ev.reason or None)

    async def workers(self, query: ListQuery) -> WorkerList:
        return WorkerList([w for w in self.registry.alive() if w.worker_id.startswith(query.prefix)])

    # --- internals -------------------------------------------------------------------------
    def _check(self, req: OpenPlan) -> None:
        if req.transfer_mode not in modes_where(is_disaggregated=True):
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"the broker plans disaggregated modes, not {req.transfer_mode!r}")
        if req.num_tokens < 1 or req.layout.num_layers < 1 or req.layout.page_tokens < 1 or req.aux_bytes < 0:
            raise RequestRefused(ErrorCode.BAD_REQUEST, "a plan needs a prompt, a layout and a non-negative aux area")
        num_blocks = req.layout.num_layers * -(-req.num_tokens // req.layout.page_tokens)
        if num_blocks > MAX_PLAN_BLOCKS:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"a plan of {num_blocks} blocks exceeds the limit of {MAX_PLAN_BLOCKS}")
        if mode_of(req.transfer_mode).needs_selector and not req.selector:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"transfer_mode {req.transfer_mode!r} needs a selector")
        if problem := mode_of(req.transfer_mode).kv_bits_problem(req.kv_bits):
            raise RequestRefused(ErrorCode.BAD_REQUEST, problem)
        if mode_of(req.transfer_mode).push_bits and req.aux_bytes < entry_region_bytes(req.layout, req.num_tokens, req.kv_bits):
            raise RequestRefused(ErrorCode.BAD_REQUEST, "the aux area has no room for the low-bit push's codes")
        if not set(req.ablate) <= set(SMARTGEN_PATHS):
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"ablate names paths from {', '.join(SMARTGEN_PATHS)} only")
        if self.book.get(req.request_id) is not None:
            raise RequestRefused(ErrorCode.BAD_REQUEST, f"request {req.request_id} already has a plan")

    def _link_estimate(self, prefill_worker_id: str, num_tokens: int) -> LinkEstimate:
        """The prefill worker's measured send rate where it has measured it (before that, the pacing it reports,
        then this broker's setting, then the default), and its measured prompt rate for `num_tokens`."""
        info = self.registry.get(prefill_worker_id)
        rate = tokens_per_s(info.prefill_rates, num_tokens) if info else 0.0
        rate = rate or self.config.default_prefill_tokens_per_s
        if info and info.send_rate_gbps > 0:
            # NOTE: a paced link cannot beat its pacing: the measured rate over- or under-shoots it by the
            # pacer's slack and the writer's idle gaps (measured +20% on paced loopback), which oversized the push
            measured = min(info.send_rate_gbps, info.link_gbps) if info.link_gbps > 0 else info.send_rate_gbps
            return LinkEstimate(measured, rate, "measured")
        if info and info.link_gbps > 0:
            return LinkEstimate(info.link_gbps, rate, "paced")
        if self.config.link_gbps:
            return LinkEstimate(self.config.link_gbps, rate, "configured")
        return LinkEstimate(self.config.default_link_gbps, rate, "default")

    def _on_heartbeat(self, info: WorkerInfo) -> None:
        if info.role == "decode":
            process = (info.host, info.pid, info.started_unix)
            if self.decode_processes.setdefault(info.worker_id, process) != process:
                self.decode_processes[info.worker_id] = process
                self._fail_plans_of(info.worker_id, "its decode worker restarted")
        for reg in info.plans:
            plan = self.book.get(reg.plan.request_id)
            if plan is not None:
                plan.touched = time.monotonic()  # a plan its decode node still registers does not expire
            elif not reg.state.is_final and not self.book.has_ended(reg.plan.request_id):
                problem = _registration_problem(reg)
                if problem:
                    log.warning("bad_plan_registration", worker_id=info.worker_id, error=problem)
                    continue
                self._spawn(self._restore(reg))

    async def _restore(self, reg: PlanRegistration) -> None:
        """Rebuild a plan this broker does not know (it restarted): its queue is the profile order minus what
        the decode node already holds."""
        p = reg.plan
        if self.book.get(p.request_id) is not None or self.book.has_ended(p.request_id):
            return
        queue: list[int] = []
        if p.background:
            profile = await self.profiles.get(reg.model, reg.selector, reg.num_tokens, reg.num_layers)
            order = smartgen_order(profile.importance, reg.num_tokens, reg.page_tokens)
            local = unpack_bits(reg.local_blocks, (reg.num_layers * p.num_pages,))
            queue = [int(b) for b in order if not local[b]]
        if self.book.get(p.request_id) is not None or self.book.has_ended(p.request_id):  # while the profile came
            return
        plan = self.book.add(Plan(p, reg.prefill_worker_id, reg.decode_worker_id, reg.num_tokens, deque(queue),
                                  state=reg.state))
        plan.reason = "restored from a decode heartbeat"
        self.plans_restored.inc()
        log.info("plan_restored", request_id=p.request_id, state=reg.state, queue=len(queue))

    def _fail_plans_of(self, decode_worker_id: str, why: str) -> None:
        for plan in self.book.of_decode(decode_worker_id):
            self.book.advance(plan.request_id, PlanState.FAILED, why)
            log.warning("plan_failed", request_id=plan.request_id, decode_worker_id=decode_worker_id, error=why)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            for rid in self.book.expire():
                log.warning("plan_expired", request_id=rid)
            now = time.monotonic()
            # NOTE: a plan younger than the heartbeat TTL may name a decode worker this broker has not heard yet
            # (it has just started); the worker reserved the request's slab, so it was alive then
            gone = {p.decode_worker_id for p in self.book.live.values()
                    if now - p.created > self.config.worker_ttl_s and not self.registry.is_alive(p.decode_worker_id)}
            for worker_id in gone:
                self._fail_plans_of(worker_id, f"its decode worker sent no heartbeat for {self.config.worker_ttl_s:g} s")
                self.decode_processes.pop(worker_id, None)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- admin -----------------------------------------------------------------------------
    def admin_routes(self) -> list[web.RouteDef]:
        async def transfers(_: web.Request) -> web.Response:
            return web.json_response({"live": [p.summary() for p in self.book.live.values()],
                                      "recent": list(self.book.history)})

        return [web.get("/transfers", transfers)]

    def stats(self) -> dict[str, Any]:
        alive = self.registry.alive()
        live = list(self.book.live.values())
        return {"workers": {role: sum(w.role == role for w in alive) for role in ("gateway", "prefill", "decode", "kvprofile")},
                "transfers_open": len(live),
                "transfers_by_state": {s: sum(p.state == s for p in live) for s in PlanState if not s.is_final},
                "transfers_finished": dict(self.book.num_by_final_state),
                "profile_fallbacks": self.profiles.num_fallbacks,
                "speculative_ratio": self.config.speculative_ratio,
                # the pacing each prefill worker's last heartbeat reported (10⁹ bit/s; 0 = unpaced): what plans use
                "prefill_link_gbps": {w.worker_id: w.link_gbps for w in alive if w.role == "prefill"}}


def _registration_problem(reg: PlanRegistration) -> str:
    """Why a plan registration from a heartbeat cannot be restored ("" when it can): checked before anything
    it announces is allocated."""
    if reg.state not in PLAN_STATES:
        return f"unknown plan state {reg.state!r}"
    if min(reg.num_tokens, reg.num_layers, reg.page_tokens) < 1:
        return "a plan needs tokens, layers and pages"
    num_pages = -(-reg.num_tokens // reg.page_tokens)
    if reg.plan.num_pages != num_pages or reg.num_layers * num_pages > MAX_PLAN_BLOCKS:
        return f"{reg.plan.num_pages} pages of {reg.num_layers} layers do not describe {reg.num_tokens} tokens"
    if len(reg.local_blocks) != -(-reg.num_layers * num_pages // 8):
        return "the bitmap of local blocks does not cover the plan"
    return ""
