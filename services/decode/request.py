"""One request on a decode worker: what it holds and where it is in its life.

Phases and the only transitions there are (anything else is a bug, and `advance` says so):

    RESERVED ──generate──▶ PREPARING ──▶ RUNNING ──▶ FINISHING
        │                     │            ▲
        │                     └─abort─▶ ABORTED (generate sees it, frees the request and refuses)
        └──────generate (no selector to load)──┘

  RESERVED   `open` reserved a slab and granted a ticket; the prefill may push into it. Unclaimed, it expires.
  PREPARING  `generate` claimed it and waits on the torch thread (loading a selector): an abort now only
             flags it, because nats runs an endpoint's handlers in one long-lived task that must not be cancelled.
  ABORTED    an abort arrived while PREPARING.
  RUNNING    its task decodes; an abort cancels the task.
  FINISHING  the task is sending the last event and freeing; an abort no longer cancels it.

colocated requests are created at `generate`, already claimed.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from schemas import Generate, KvLayout, PlanState, TransferMode, mode_of, pushed_bytes
from shared.compute.grammar import TokenGrammar
from shared.compute.kvstore import Slab
from shared.dataplane import Grant
from services.decode.remote import RemoteKv


class Phase(Enum):
    RESERVED = "reserved"
    PREPARING = "preparing"
    ABORTED = "aborted"
    RUNNING = "running"
    FINISHING = "finishing"


TRANSITIONS: dict[Phase, tuple[Phase, ...]] = {
    Phase.RESERVED: (Phase.PREPARING, Phase.RUNNING),
    Phase.PREPARING: (Phase.RUNNING, Phase.ABORTED),
    Phase.ABORTED: (),
    Phase.RUNNING: (Phase.FINISHING,),
    Phase.FINISHING: (),
}


class PhaseError(RuntimeError):
    """A transition the life cycle above does not have."""


@dataclass
class PushProgress:
    """What the prefill's push has delivered into the slab (disaggregated modes): counted from the data plane's
    landed bytes, waited on by the request's task."""

    expected_bytes: int = 0  # what the plan pushes; known from `generate` on
    aux_filled: int = 0  # bytes of the slab's aux area the running mode fills (≤ slab.aux_bytes; auto reserves more)
    landed: asyncio.Event = field(default_factory=asyncio.Event)  # set when all pushed KV is here, or on failure
    # No global push barrier (set by `generate` when the prefill said what each layer pushes): the landed-byte
    # count at which each layer's pushes are all here (they land in layer order), how many layers are, and who
    # hears of each as it lands (the remote KV, so step 1's layer l waits for layer l only)
    layer_ends: list[int] = field(default_factory=list)
    layers_landed: int = 0
    on_layer_landed: Callable[[int], None] | None = None
    # set once at most `nearly_landed_at` bytes are still to land: step 1 may start then (service.py `_wait_until_nearly_landed`)
    nearly_landed: asyncio.Event = field(default_factory=asyncio.Event)
    nearly_landed_at: int = 0
    failure: str = ""


@dataclass
class RemoteProgress:
    """Paths 2 and 3 and the prefill's lease, while part of the KV is still on the prefill node (partial, smartgen):
    what services/decode/remote_lifecycle.py keeps per request."""

    plan_state: PlanState = PlanState.OPENING  # as the broker knows it
    all_local_step: int = -1
    backlog: int = 0  # background blocks handed out by the broker and not read yet
    helpers: list[asyncio.Task[Any]] = field(default_factory=list)  # lease keeper, background reader
    # NOTE: unbounded, but bounded by construction: one progress call at a time, and the broker hands out no
    # batch while the blocks it already gave (`backlog`) are a batch or more (services/broker/plans.py).
    background: asyncio.Queue[list[int]] = field(default_factory=asyncio.Queue)
    progress_call: asyncio.Task[None] | None = None
    last_step_at: float = 0.0  # loop time of the latest finished step (RemoteKvLifecycle times steps with it)
    step_s: float = 0.0  # the recent decode step time, seconds (an average over the last steps; 0 = unknown)
    background_declined: bool = False  # path 3 was declined at least once: the rest could not arrive in time
    ending: asyncio.Future[None] | None = None  # RemoteKvLifecycle.end's work, awaited by every caller


@dataclass
class StepReport:
    """What the request's last event reports beyond its tokens (see TokenEvent)."""

    recompute_reason: str = ""  # failure_policy recompute: why the prefill was recomputed here
    step1_kv_bytes: int = 0
    step1_compute_s: float = 0.0
    kv_load_s: float = 0.0


@dataclass
class DecodeRequest:
    """One request on this worker: its reservation, its `generate` (from then on), and three small parts."""

    request_id: str
    mode: TransferMode  # as opened; `generate` may run auto as one of its choices (mode.resolves_to)
    num_tokens: int = 0  # prompt tokens
    slab: Slab | None = None
    cached_tokens: int = 0  # of those, copied into the slab from the prefix cache at `open` (KvHandle.cached_tokens)
    grant: Grant | None = None
    phase: Phase = Phase.RESERVED
    req: Generate | None = None  # the `generate` it runs, set once generate has checked it
    task: asyncio.Task[None] | None = None
    expiry: asyncio.TimerHandle | None = None
    remote: RemoteKv | None = None  # partial, smartgen: the view of the KV still on the prefill node
    push: PushProgress = field(default_factory=PushProgress)
    progress: RemoteProgress = field(default_factory=RemoteProgress)
    report: StepReport = field(default_factory=StepReport)
    grammar: TokenGrammar | None = None  # structured output (Sampling.grammar): follows the completion's tokens

    def is_complete(self, completion: list[int]) -> bool:
        """Structured output: the request's grammar allows nothing more after `completion` (it ends: `stop`)."""
        return self.grammar is not None and self.grammar.is_complete(completion)

    def advance(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise PhaseError(f"request {self.request_id}: {self.phase.value} → {phase.value} is not a transition")
        self.phase = phase

    @property
    def generate(self) -> Generate:
        """The `generate` this request runs (only once it was claimed)."""
        assert self.req is not None, f"request {self.request_id} has no generate yet"
        return self.req

    @property
    def running_mode(self) -> TransferMode:
        """The mode it runs as: the plan's resolution of `auto`, else the mode it was opened in."""
        return mode_of(self.generate.transfer_mode)

    def pushed_bytes(self, layout: KvLayout) -> int:
        """What the plan has the prefill push, in bytes: decoding starts once it has all landed."""
        req, mode = self.generate, self.running_mode
        return pushed_bytes(mode, req.plan, layout, self.num_tokens, self.push.aux_filled, req.query_entries,
                            mode.push_width(req.kv_bits), self.cached_tokens)

    @property
    def is_released(self) -> bool:
        """The prefill node's lease is ended, or ending (there may never have been one)."""
        return self.progress.ending is not None

    def on_landed(self, num_bytes: int) -> None:
        """Data plane: bytes of a push landed in the slab."""
        if self.expiry is not None:  # the prefill is delivering: the reservation is in use
            self.expiry.cancel()
        self.check_landed()

    def push_failed(self, reason: str) -> None:
        """The push will not complete (the prefill said so, or its link dropped): whoever waits for it stops now,
        the first step's layers too (services/decode/remote.py `ready`)."""
        self.push.failure = reason
        self.push.landed.set()
        self.push.nearly_landed.set()
        if self.remote is not None and self.push.on_layer_landed is not None:
            self.remote.fail(f"the KV push did not complete: {reason}")

    def check_landed(self) -> None:
        push = self.push
        if self.grant is None:
            return
        if push.expected_bytes and self.grant.bytes_landed >= push.expected_bytes:
            push.landed.set()
        if push.nearly_landed_at and self.grant.bytes_landed >= push.nearly_landed_at:
            push.nearly_landed.set()
        if push.on_layer_landed is not None:
            while push.layers_landed < len(push.layer_ends) and self.grant.bytes_landed >= push.layer_ends[push.layers_landed]:
                push.layers_landed += 1
                push.on_layer_landed(push.layers_landed - 1)
