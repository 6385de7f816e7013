"""The transfer plan's life between decode, prefill and broker: the prefill's lease on the KV it keeps (keep,
release), and the broker's plan (open, per-step progress and the background blocks it answers with, plan events,
the live plans a decode repeats in its heartbeats)."""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.constants import DEFAULT_FLOOR, DEFAULT_KV_BUDGET, BudgetFloor, PlanState
from schemas.messages.kv import KvLayout, TransferPlan


@dataclass(frozen=True, slots=True)
class Release:
    """Decode → prefill (`prefill.<id>.release`): every entry is local, or the request is over: free its KV."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class KeepLease:
    """Decode → prefill (`prefill.<id>.keep`, published): still reading this request's KV; extend its lease."""

    request_id: str


@dataclass(frozen=True, slots=True)
class OpenPlan:
    """Gateway → broker (`broker.<id>.open`): plan a request's transfer. Reply: TransferPlan."""

    request_id: str
    transfer_mode: str  # as asked (auto allowed)
    model: str
    selector: str
    num_tokens: int  # prompt tokens
    layout: KvLayout
    aux_bytes: int  # the decode node's aux area: metadata (selective modes) or codes (quantized)
    prefill_worker_id: str
    decode_worker_id: str
    ablate: list[str] = field(default_factory=list)  # SMARTGEN_PATHS switched off
    kv_budget: float | None = None  # the request's (None: DEFAULT_KV_BUDGET): sizes smartgen's query-aware push
    floor: BudgetFloor = DEFAULT_FLOOR  # the decode worker's (KvHandle.floor), likewise
    kv_bits: int = 0  # smartgen: the low-bit proactive push (PUSH_KV_BITS) sizes its budget in code bytes
    # the prompt tokens the gateway expects the prefill worker to find in its prefix cache (an estimate:
    # services/gateway/routing.py): its prefill computes only the rest, so the push has that much less time
    prefill_cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Progress:
    """Decode → broker (`broker.<id>.progress`) after each decode step. Reply: BackgroundBatch."""

    request_id: str
    step: int
    backlog_blocks: int  # blocks the broker sent earlier that are not local yet
    num_missing: int  # (layer, KV head, token) entries still remote
    wants_background: bool = True  # False: no background batch now (the rest cannot move before the request ends)


@dataclass(frozen=True, slots=True)
class BackgroundBatch:
    """Broker → decode: the next blocks to move on the background lane (flat layer·num_pages + page), most
    important first; empty when the speculative queue is empty or the decode node is still busy."""

    request_id: str
    blocks: list[int]
    remaining: int  # blocks left in the speculative queue after this batch


@dataclass(frozen=True, slots=True)
class PlanEvent:
    """Decode or gateway → broker (`broker.<id>.event`, published): a plan moved to `state`."""

    request_id: str
    state: PlanState
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PlanRegistration:
    """Inside decode heartbeats: a live plan and what is local, so a restarted broker rebuilds its state."""

    plan: TransferPlan
    state: PlanState
    model: str
    selector: str
    prefill_worker_id: str
    decode_worker_id: str
    num_tokens: int
    num_layers: int
    page_tokens: int
    local_blocks: bytes  # bitmap like TransferPlan.push_blocks: blocks wholly on the decode node
