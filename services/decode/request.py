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

`generate` checks its request against the reservation once (`generate_problem`), then `claim`s it: from then on
the request holds its `Generate` (`req`) and the mode it runs as (`mode`, auto resolved), and every later step
reads them from here. What it reports at its end (`final_event`, `selection_stats`) is here too.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from schemas import (DENSE_LAYERS, FAILURE_POLICIES, Generate, KvLayout, PlanState, SelectionStats, TokenEvent,
                     TransferMode, mode_of, modes_where, plan_problem, pushed_aux_bytes, pushed_bytes, wire_entry_bytes)
from schemas.modes import Aux
from shared.compute.decode_engine import DecodeEngine
from shared.compute.grammar import TokenGrammar
from shared.compute.kvstore import Slab
from shared.compute.modeling import ModelRunner
from shared.compute.selection import Selection
from shared.compute.selectors import PreparationMissing
from shared.dataplane import Grant
from shared.runtime.profiles import NUM_BLOCKS, tokens_per_block
from services.decode.remote import RemoteKv

MODES_SERVED = modes_where(resolves_to=())


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
    bits: int = 0  # the code width of a low-bit push (mode.push_width(kv_bits)); 0: the push is exact
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
    ending: asyncio.Future[None] | None = None  # RemoteKvLifecycle.end's work, awaited by every caller (set: released)


@dataclass
class StepReport:
    """What the request's last event reports beyond its tokens (see TokenEvent)."""

    recompute_reason: str = ""  # failure_policy recompute: why the prefill was recomputed here
    step1_kv_bytes: int = 0
    step1_compute_s: float = 0.0
    kv_load_s: float = 0.0
    step_cpu_s: list[float] = field(default_factory=list)  # per decode step (token 2 on): StepBatcher.step_cpu_s


@dataclass
class DecodeRequest:
    """One request on this worker: its reservation, its `generate` (from then on), and three small parts."""

    request_id: str
    mode: TransferMode  # as opened; from `claim` on, the mode it runs as (auto: the plan's choice, mode.resolves_to)
    num_tokens: int = 0  # prompt tokens
    slab: Slab | None = None
    cached_tokens: int = 0  # of those, copied into the slab from the prefix cache at `open` (KvHandle.cached_tokens)
    grant: Grant | None = None
    phase: Phase = Phase.RESERVED
    req: Generate | None = None  # the `generate` it runs, set by `claim` (None while RESERVED)
    task: asyncio.Task[None] | None = None
    expiry: asyncio.TimerHandle | None = None
    remote: RemoteKv | None = None  # partial, smartgen: the view of the KV still on the prefill node
    push: PushProgress = field(default_factory=PushProgress)
    progress: RemoteProgress = field(default_factory=RemoteProgress)
    report: StepReport = field(default_factory=StepReport)
    grammar: TokenGrammar | None = None  # structured output (Sampling.grammar): follows the completion's tokens

    def advance(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise PhaseError(f"request {self.request_id}: {self.phase.value} → {phase.value} is not a transition")
        self.phase = phase

    def generate_problem(self, req: Generate, runner: ModelRunner, layout: KvLayout) -> str:
        """Why `generate` cannot run `req` as asked on this reservation ("" if it can): a 400."""
        if req.max_tokens < 1:
            return "max_tokens must be ≥ 1"
        if req.failure_policy not in FAILURE_POLICIES:
            return f"failure_policy {req.failure_policy!r} is not one of {', '.join(FAILURE_POLICIES)}"
        if problem := runner.token_problem(req.token_ids):
            return problem
        if req.transfer_mode not in MODES_SERVED:
            return f"decode serves transfer modes {', '.join(MODES_SERVED)}, not {req.transfer_mode!r}"
        mode = mode_of(req.transfer_mode)
        if req.resume_tokens:
            if mode.is_disaggregated or req.first_token >= 0:
                return "resume_tokens: a request resumes in colocated mode, from its prompt"
            if len(req.resume_tokens) >= req.max_tokens:
                return "resume_tokens: nothing is left to generate"
            if problem := runner.token_problem(req.resume_tokens):
                return f"resume_tokens: {problem}"
        if not mode.is_disaggregated:
            return ""
        recomputing = req.first_token < 0 and req.failure_policy == "recompute"  # the prefill failed before token 1
        if req.first_token < 0 and not recomputing:
            return f"{req.transfer_mode} mode needs the first token from the prefill"
        if not self.mode.may_run_as(req.transfer_mode):
            return f"the KV was reserved for {self.mode.name!r}, not {req.transfer_mode!r}"
        if len(req.token_ids) != self.num_tokens:
            return "the prompt does not match the reservation's token count"
        if mode.keeps_source:
            if not req.selector or req.plan is None or (req.source is None and not recomputing) \
                    or req.plan.transfer_mode != req.transfer_mode:
                return f"transfer_mode {req.transfer_mode!r} needs a selector, its plan and the prefill's KvSource"
            if problem := plan_problem(req.plan, layout.num_layers, self.num_tokens, layout.page_tokens):
                return problem
            if req.source is not None and req.source.codes_bits not in (0, req.kv_bits):
                # NOTE: read records land in the codes region the reservation sized for kv_bits
                return f"the prefill serves reads as {req.source.codes_bits}-bit codes, not kv_bits {req.kv_bits}"
        return mode.kv_bits_problem(req.kv_bits)

    def claim(self, req: Generate, engine: DecodeEngine, layout: KvLayout) -> None:
        """`generate` runs `req` (checked, its selector loaded): the request holds it and the mode it runs as, and,
        with a push to wait for, what that push fills of the aux area and delivers in all; it is RUNNING. ValueError
        saying why the reservation cannot hold it (a 400); the request is then left as it was."""
        mode = mode_of(req.transfer_mode)
        if self.grant is not None:
            self.push.aux_filled = self._aux_to_fill(req, mode, engine)
        self.req, self.mode = req, mode
        if self.grant is not None:
            push = self.push
            push.bits = mode.push_width(req.kv_bits)
            push.expected_bytes = pushed_bytes(mode, req.plan, layout, self.num_tokens, push.aux_filled,
                                               req.query_entries, push.bits, self.cached_tokens)
            self.check_landed()
        self.advance(Phase.RUNNING)

    def _aux_to_fill(self, req: Generate, mode: TransferMode, engine: DecodeEngine) -> int:
        """The part of the slab's aux area the prefill fills for the mode that runs: all of it, but for `auto`,
        which reserved room for each of its choices (metadata and a low-bit push's codes, or quantized codes)."""
        assert self.slab is not None
        try:
            needed = engine.aux_bytes(mode.aux, self.num_tokens, req.selector, req.kv_bits, mode.pushes_by_query)
        except PreparationMissing as exc:
            raise ValueError(str(exc)) from None
        if req.prefill_aux_bytes and req.prefill_aux_bytes != needed:
            raise ValueError(f"the prefill filled {req.prefill_aux_bytes} aux bytes; this decode worker expects "
                             f"{needed} for {req.transfer_mode} (different selector preparation?)")
        if needed > self.slab.aux_bytes:
            raise ValueError(f"{req.transfer_mode} with kv_bits {req.kv_bits} needs {needed} aux bytes; the "
                             f"reservation for {self.mode.name} has {self.slab.aux_bytes}")
        return needed

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

    # --- what it reports at its end -------------------------------------------------------------------
    def _metadata_bytes(self, layout: KvLayout) -> int:
        """What of the slab's aux area the prefill filled whole (geometry.pushed_aux_bytes)."""
        return pushed_aux_bytes(layout, self.num_tokens, self.push.aux_filled, self.push.bits)

    def step1_kv_bytes(self, layout: KvLayout, selection: Selection | None) -> int:
        """What decode step 1 needed from the link, on the wire: nothing (colocated, or recomputed here), the
        metadata, the dense layers and step 1's own selection (selective modes; `selection` after step 1), or
        everything the mode pushes (full, quantized)."""
        mode = self.mode
        if not mode.is_disaggregated or self.report.recompute_reason:
            return 0
        if mode.keeps_source and selection is not None:
            entry_bytes = wire_entry_bytes(layout, self.push.bits)  # exact, or a low-bit push's record
            dense_entries = DENSE_LAYERS * self.num_tokens * layout.num_kv_heads
            return self._metadata_bytes(layout) + (dense_entries + selection.num_selected) * entry_bytes
        return self.push.expected_bytes

    def final_event(self, selection: Selection | None, index: int, reason: str, error: str, kv_wait_s: float,
                    layout: KvLayout) -> TokenEvent:
        """The stream's last event: how it ended (`reason`, `error`) and what moved on which path."""
        landed = self.grant.bytes_landed if self.grant else 0
        mode, remote, report = self.mode, self.remote, self.report
        if mode.keeps_source:
            aux = self._metadata_bytes(layout)
            kv_bytes = {mode.aux_path: min(aux, landed), mode.rows_path: max(0, landed - aux),
                        "on_demand": remote.bytes_on_demand + remote.bytes_direct if remote else 0,
                        "background": remote.bytes_background if remote else 0}
        elif mode.is_disaggregated:  # everything was pushed: as codes, or row by row
            kv_bytes = {mode.aux_path if mode.aux is Aux.CODES else mode.rows_path: landed}
        else:
            kv_bytes = {}
        share = selection.selected_share if selection and selection.selected_share is not None else 1.0
        return TokenEvent(self.request_id, index, -1, reason, error, kv_bytes, kv_wait_s, share,
                          local_share=remote.local_share if remote else 1.0,
                          on_demand_wait_s=sum(remote.step_wait) if remote else 0.0,
                          step_local_share=[round(x, 4) for x in remote.step_local_share] if remote else [],
                          step_wait_s=[round(x, 6) for x in remote.step_wait] if remote else [],
                          step_cpu_s=[round(x, 6) for x in report.step_cpu_s],
                          all_local_step=self.progress.all_local_step,
                          background_declined=self.progress.background_declined,
                          recompute_reason=report.recompute_reason, step1_kv_bytes=report.step1_kv_bytes,
                          step1_compute_s=round(report.step1_compute_s, 6), kv_load_s=round(report.kv_load_s, 6),
                          started_while_pushing=self.push.on_layer_landed is not None and remote is not None,
                          push_landing_wait_s=round(remote.landing_wait_s, 6) if remote else 0.0,
                          fetch_reads=remote.num_fetch_reads if remote else 0,
                          speculative_reads=remote.num_speculative_reads if remote else 0,
                          ranked_reads=remote.num_ranked_reads if remote else 0,
                          ranked_bytes=remote.bytes_ranked if remote else 0,
                          behind_reads=remote.behind.num_reads if remote and remote.behind else 0,
                          substituted=remote.behind.num_substituted if remote and remote.behind else 0,
                          direct_reads=remote.num_direct_reads if remote else 0)


def selection_stats(req: Generate, selection: Selection, runner: ModelRunner | None) -> SelectionStats | None:
    """Online profiling: what this request selected, per layer and relative block of its prompt, over the steps
    that selected (None when none did: a context under the floor's dense threshold says nothing about importance)."""
    if selection.block_counts is None or not selection.num_sparse_steps or runner is None:
        return None
    n = len(req.token_ids)
    offered = tokens_per_block(n, NUM_BLOCKS) * selection.num_sparse_steps * runner.num_kv_heads
    return SelectionStats(runner.name, req.selector, n, runner.num_layers, NUM_BLOCKS,
                          selection.block_counts.astype(np.float32).tobytes(), offered.astype(np.float32).tobytes())
