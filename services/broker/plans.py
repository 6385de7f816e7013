"""The broker's state: one live plan per request, its explicit ordered state, and its speculative queue.

    opening ──▶ transferring ──▶ all_local ──▶ released        (forward only)
       └───────────┴─────────────────┴────────▶ failed | expired

The speculative queue holds the blocks that were not pushed, most important first. The lane policy lives
in `next_batch`: per decode iteration it hands out at most `ratio` of the blocks that remained when
decoding began (10% by default, so ~10 iterations move everything, as in the paper), and nothing while the
decode node still has an earlier batch in hand; the data plane's strict lane priority keeps those bytes
behind every on-demand read. Finished plans leave the live table for a short history.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from schemas import PLAN_STATES, PlanState, TransferPlan

HISTORY = 100  # finished plans kept for /transfers
# request ids that ended (their plan, or a final event before any plan): a heartbeat built before the end, or an open
# still fetching its profile when the gateway gave up, must not make them live again
NUM_ENDED_REMEMBERED = 4096


class PlanStateError(ValueError):
    """A state change that the order above does not allow."""


@dataclass
class Plan:
    plan: TransferPlan
    prefill_worker_id: str
    decode_worker_id: str
    num_tokens: int
    queue: deque[int]  # speculative queue, most important first
    state: PlanState = PlanState.OPENING
    batch_size: int = 0  # blocks per iteration; fixed when decoding begins
    num_batches: int = 0
    num_blocks_sent: int = 0
    reason: str = ""
    created: float = field(default_factory=time.monotonic)
    touched: float = field(default_factory=time.monotonic)
    transitions: list[tuple[PlanState, float]] = field(default_factory=list)  # (state, seconds since created)

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    def summary(self) -> dict[str, Any]:
        p = self.plan
        return {"request_id": p.request_id, "mode": p.transfer_mode, "state": self.state, "reason": self.reason or p.reason,
                "prefill_worker_id": self.prefill_worker_id, "decode_worker_id": self.decode_worker_id,
                "num_tokens": self.num_tokens, "num_pages": p.num_pages, "num_push_blocks": p.num_push_blocks,
                "profile": p.profile, "profile_version": p.profile_version, "profile_source": p.profile_source,
                "link_gbps": p.link_gbps, "prefill_tokens_per_s": p.prefill_tokens_per_s,
                "speculative_queue": len(self.queue), "batch_size": self.batch_size, "batches_sent": self.num_batches,
                "blocks_sent": self.num_blocks_sent, "age_s": round(time.monotonic() - self.created, 3),
                "transitions": [{"state": s, "at_s": round(t, 4)} for s, t in self.transitions]}


class PlanBook:
    def __init__(self, ratio: float = 0.1, ttl_s: float = 60.0):
        if not 0 < ratio <= 1:
            raise ValueError("the speculative ratio must be in (0, 1]")
        self.ratio, self.ttl_s = ratio, ttl_s
        self.live: dict[str, Plan] = {}
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._ended: dict[str, None] = {}  # the latest NUM_ENDED_REMEMBERED ended request ids, oldest first
        self.num_by_final_state = {s: 0 for s in PlanState if s.is_final}

    def add(self, plan: Plan) -> Plan:
        if plan.request_id in self.live:
            raise PlanStateError(f"request {plan.request_id} already has a live plan")
        plan.transitions.append((plan.state, 0.0))
        self.live[plan.request_id] = plan
        return plan

    def get(self, request_id: str) -> Plan | None:
        return self.live.get(request_id)

    def has_ended(self, request_id: str) -> bool:
        """Whether the request ended here lately (its plan is never live again)."""
        return request_id in self._ended

    def end(self, request_id: str) -> None:
        """Remember that the request ended (its plan did, or a final event came before any plan)."""
        self._ended[request_id] = None
        if len(self._ended) > NUM_ENDED_REMEMBERED:
            del self._ended[next(iter(self._ended))]

    def of_decode(self, decode_worker_id: str) -> list[Plan]:
        return [p for p in self.live.values() if p.decode_worker_id == decode_worker_id]

    def advance(self, request_id: str, state: PlanState, reason: str = "") -> Plan | None:
        """Move a plan to `state`. Unknown requests are ignored (None); going backwards raises PlanStateError;
        repeating the current state is a no-op."""
        plan = self.live.get(request_id)
        if plan is None:
            return None
        if state not in PLAN_STATES:
            raise PlanStateError(f"unknown plan state {state!r}")
        state = PlanState(state)
        if state == plan.state:
            return plan
        may_jump = state in (PlanState.FAILED, PlanState.EXPIRED)  # from any state before RELEASED
        if not may_jump and PLAN_STATES.index(state) < PLAN_STATES.index(plan.state):
            raise PlanStateError(f"plan {request_id} cannot go from {plan.state} back to {state}")
        plan.state, plan.touched = state, time.monotonic()
        plan.transitions.append((state, plan.touched - plan.created))
        if reason:
            plan.reason = reason
        if state.is_final:
            del self.live[request_id]
            self.end(request_id)
            self.num_by_final_state[state] += 1
            self.history.append(plan.summary())
        return plan

    def next_batch(self, request_id: str, backlog_blocks: int, wanted: bool = True) -> tuple[list[int], int]:
        """The blocks to send on the background lane after one decode iteration: (blocks, remaining); none when
        the decode node does not want any now (`wanted` False)."""
        plan = self.live.get(request_id)
        if plan is None:
            return [], 0
        plan.touched = time.monotonic()
        if plan.state is PlanState.OPENING:
            self.advance(request_id, PlanState.TRANSFERRING)
        if not plan.plan.background or not wanted:
            return [], len(plan.queue)
        if plan.batch_size == 0:
            plan.batch_size = max(1, math.ceil(self.ratio * len(plan.queue)))
        if backlog_blocks >= plan.batch_size or not plan.queue:
            return [], len(plan.queue)
        batch = [plan.queue.popleft() for _ in range(min(plan.batch_size, len(plan.queue)))]
        plan.num_batches += 1
        plan.num_blocks_sent += len(batch)
        return batch, len(plan.queue)

    def expire(self, now: float | None = None) -> list[str]:
        """Plans nobody has touched for ttl_s: expired. Returns their request ids."""
        now = time.monotonic() if now is None else now
        stale = [rid for rid, p in self.live.items() if now - p.touched > self.ttl_s]
        for rid in stale:
            self.advance(rid, PlanState.EXPIRED, f"no progress for {self.ttl_s:g} s")
        return stale
