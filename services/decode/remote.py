"""The part of one request's KV that is still on the prefill node, and the reads that bring it over (path 2 here,
path 3 in remote_lifecycle.py; docs/architecture.md, "The three transfer paths"); what is here is `Presence`'s
(presence.py). The decode node owns this picture; the broker only schedules. The rule between the two threads:
  - the torch thread calls `fetch`, `speculate`, `rank` and `ready` inside attention and waits on the returned
    `Pending` (a concurrent future), never on the loop; it never awaits and touches asyncio only through
    `run_coroutine_threadsafe` / `call_soon_threadsafe`. A read on a direct link it runs itself (direct_reads.py);
  - the event loop runs every other read, marks presence once its bytes have landed, and runs path 3,
    `push_landed`, `fail` and `close`.

A read moves a set of entries of any layers (presence.py `Entries`): as one gather (one index per entry), or as
segments where its runs of consecutive tokens are long (reads.py GATHER_BELOW_RUN); where the prefill serves codes
(KvSource.codes_bits), the entries' records instead of their rows, dequantized into the rows before they count as
present (read_codes.py). A layer's codes region first holds its pushed records, so no read of it lands before those
were dequantized (`ready`; path 3 waits: `check_codes_room`).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from schemas import DENSE_LAYERS, KvLayout, KvSource
from shared.dataplane import DataPlane, Gather, Lane, Segment
from services.decode.direct_reads import DirectPending, DirectReads
from services.decode.presence import Entries, Presence
from services.decode.read_behind import ReadBehind
from services.decode.read_codes import ReadCodes
from services.decode.reads import (GATHER_BELOW_RUN, RANK_WHEN_WAITING_BELOW, SPECULATE_WHEN_READING,
                                   WAIT_SHARE_WEIGHT, Pending, RemoteReadError, settled)

log = structlog.get_logger()


@dataclass
class RemoteKv:
    dataplane: DataPlane
    loop: asyncio.AbstractEventLoop
    source: KvSource
    layout: KvLayout
    dst_offset: int  # the decode slab's byte offset in this process's region
    dst_capacity: int  # tokens
    num_tokens: int  # prompt tokens (the only ones that can be remote)
    pushed: np.ndarray  # (num_layers, num_pages) bool: blocks pushed during prefill (already landed)
    parallel: bool = True  # gather local entries while the remote read is in flight
    read_timeout_s: float = 30.0
    background_read_bytes: int = 64 << 10  # one background read; small, so an on-demand read never waits long
    pushed_entries: np.ndarray | None = None  # (num_layers, num_kv_heads, num_tokens) bool: pushed one by one, landed
    gather_reads: bool = True  # on-demand reads of short runs as one gather (module docstring); False: segments
    speculative: bool = True  # read a layer's predicted selection while the layer before it runs (`speculate`)
    ranked: bool = False  # path 3 by the latest query (`rank`, `read_ranked`)
    stalls: bool = True  # after step 1 a step waits for its selected entries that are not here (False: `read_behind`)
    codes_at: int = -1  # reads as codes (source.codes_bits): where the slab's codes region starts in `region`
    region: memoryview | None = None
    bytes_on_demand: int = 0
    bytes_background: int = 0  # path 3: ranked reads and the broker's blocks
    bytes_ranked: int = 0  # of bytes_background, the ranked reads
    num_ranked_reads: int = 0
    read_wait_share: float = 0.0  # running share of a step spent waiting on reads, not on the push (torch thread)
    step_local_share: list[float] = field(default_factory=list)
    step_wait: list[float] = field(default_factory=list)
    step_wait_s: float = 0.0  # this step so far (torch thread)
    landing_wait_s: float = 0.0  # step 1's layers waiting for their pushed bytes (`ready`), part of step_wait
    num_read_local: int = 0  # entries attention read that were local, all steps
    num_read_remote: int = 0
    num_fetch_reads: int = 0  # reads a layer issued when it attended (what was not local nor read speculatively)
    num_speculative_reads: int = 0  # reads of a predicted selection, issued a layer early (`speculate`)
    direct: DirectReads | None = None  # the torch thread's own links (direct_reads.py); None: reads via the loop
    num_direct_reads: int = 0  # of num_fetch_reads, those issued on a direct link (torch thread)
    bytes_direct: int = 0  # their bytes, on demand too (torch thread; bytes_on_demand is the loop's)
    is_closed: bool = False
    failure: str = ""  # set when the prefill node is lost: every later read fails at once with it

    def __post_init__(self) -> None:
        self.presence = Presence(self.layout, self.source, self.dst_offset, self.dst_capacity, self.num_tokens,
                                 self.pushed, self.pushed_entries)
        self.codes: ReadCodes | None = None
        if self.source.codes_bits:
            if self.codes_at < 0 or self.region is None:
                raise ValueError("the prefill serves reads as codes: the remote view needs the slab's codes region")
            self.codes = ReadCodes(self.layout, self.source, self.num_tokens, self.codes_at, self.region,
                                   self.presence.dst_rows, self.presence.token_bytes)
        self.behind = None if self.stalls else ReadBehind(self)
        self._step_local = self._step_remote = 0
        self._in_flight: set[asyncio.Future[None]] = set()  # data-plane transfers not settled yet (`read`)
        # NOTE: counted when issued (torch thread), not when the loop starts it: no background read slips in between
        self._on_demand_pending = 0
        self._pending_lock = threading.Lock()
        self._on_demand_idle = asyncio.Event()
        self._on_demand_idle.set()
        self._ahead: dict[int, Pending | DirectPending] = {}  # layer → its read (`speculate`)
        # No global push barrier (`await_pushes`): per layer, set once its pushes have landed; None when every
        # layer has landed and been prepared (or decoding waited for the whole push before it started)
        self._landed: list[threading.Event] | None = None
        self._prepared: list[bool] = []
        self._prepare: Callable[[int], None] | None = None
        self._step_read_layers: set[int] = set()  # layers that issued a read this step (torch thread)
        self._speculating = self.speculative  # this step: see SPECULATE_WHEN_READING
        self._ranking = self.ranked  # this step: see RANK_WHEN_WAITING_BELOW
        self._step_started, self._landing_before_step = time.perf_counter(), 0.0
        self._step_rankings: list[tuple[int, torch.Tensor]] = []  # this step's, handed over by `end_step` (torch thread)
        self.ranked_queue: dict[int, torch.Tensor] = {}  # layer → its latest wider selection (H_kv, k'), oldest first
        self.ranked_queued = asyncio.Event()
        self.background_turn = asyncio.Lock()  # ranked reads and `read_blocks` put one chunk on the wire at a time

    # === called on the torch thread (inside attention, between layers); never awaits, never touches asyncio ===
    def begin_step(self) -> None:
        self._step_local = self._step_remote = 0
        self.step_wait_s = 0.0
        self._step_read_layers.clear()
        self._step_started = time.perf_counter()
        self._landing_before_step = self.landing_wait_s

    def end_step(self) -> None:
        if self.direct is not None:
            self.direct.settle()  # no direct read may outlive its step (direct_reads.py)
        self.num_read_local += self._step_local
        self.num_read_remote += self._step_remote
        total = self._step_local + self._step_remote
        self.step_local_share.append(self._step_local / total if total else 1.0)
        self.step_wait.append(self.step_wait_s)
        selective = self.layout.num_layers - DENSE_LAYERS
        self._speculating = self.speculative and len(self._step_read_layers) >= SPECULATE_WHEN_READING * selective
        # ranked reads only while the link has room: waiting on reads (not on the push) is a small part of a step
        step_s = time.perf_counter() - self._step_started
        read_wait_s = self.step_wait_s - (self.landing_wait_s - self._landing_before_step)
        share = read_wait_s / step_s if step_s > 0 else 0.0
        self.read_wait_share = share if len(self.step_wait) == 1 else \
            (1 - WAIT_SHARE_WEIGHT) * self.read_wait_share + WAIT_SHARE_WEIGHT * share
        self._ranking = self.ranked and self.read_wait_share <= RANK_WHEN_WAITING_BELOW
        if self._step_rankings:
            self.loop.call_soon_threadsafe(self._queue_rankings, self._step_rankings)
            self._step_rankings = []

    def is_ready(self, layer: int) -> bool:
        return (landed := self._landed) is None or landed[layer].is_set()

    def ready(self, layer: int) -> None:
        """(torch thread) Block until `layer`'s pushed KV has landed; prepare it the first time."""
        landed = self._landed
        if landed is None or self._prepared[layer]:
            return
        if not landed[layer].is_set():
            started = time.perf_counter()
            arrived = landed[layer].wait(self.read_timeout_s)
            waited = time.perf_counter() - started
            self.step_wait_s, self.landing_wait_s = self.step_wait_s + waited, self.landing_wait_s + waited
            if not arrived:
                raise RemoteReadError(f"layer {layer}'s pushed KV did not land within {self.read_timeout_s:g} s")
        self.check_readable()  # a push that failed sets every event
        if self._prepare is not None:
            self._prepare(layer)
        self._prepared[layer] = True
        if all(self._prepared):
            self._landed = None

    def fetch(self, layer: int, idx: torch.Tensor | None) -> Pending | DirectPending | None:
        """Start reading the entries of `layer` that attention needs and are not here: `idx` (H_kv, k)
        selected token indices, or None for every token (dense layers). None if all are local."""
        self.check_readable()
        if self.codes is not None and not self.has_codes_room(layer):
            self.ready(layer)  # its pushed records first (attention has called it already: a no-op then)
        ahead = self._ahead.pop(layer, None)
        if ahead is not None:  # what was read speculatively for this layer lands first; then only what it missed
            try:
                ahead.wait()
            except RemoteReadError as exc:
                self.check_readable()  # the prefill node is lost, or the view closed: no fetch could do better
                log.info("speculative_read_failed", layer=layer, error=str(exc))  # what it missed is fetched below
        remote, heads = self.presence.remote_part(layer, idx)
        if idx is not None:  # NOTE: the local share counts selected entries; dense layers read everything anyway
            num_remote = int(remote.sum())
            self._step_remote += num_remote
            self._step_local += idx.numel() - num_remote
        if not heads:
            return None
        self.num_fetch_reads += 1
        self._step_read_layers.add(layer)
        return self._start(Entries.of_layer(layer, heads), torch.from_numpy(remote) if idx is not None else None)

    def wants_speculation(self, layer: int) -> bool:
        """Speculating is on, the step stalls on misses (one that does not has nothing to wait less for), and `layer`
        still has remote entries."""
        return self._speculating and self.behind is None and layer < len(self.presence.missing_per_layer) \
            and bool(self.presence.missing_per_layer[layer]) and layer not in self._ahead

    def speculate(self, layer: int, idx: torch.Tensor) -> None:
        """The speculative part of path 2, each step: start reading the remote part of `idx`, a prediction of
        `layer`'s selection made while the layer before it runs (shared/compute/selective.py); `fetch(layer, …)`
        waits for it first. On the on-demand lane, direct where fetches are: the step waits for it a layer from now."""
        self.check_readable()
        if self.codes is not None and not self.has_codes_room(layer):
            if not self.is_ready(layer):
                return  # its push is still landing: `fetch` reads what it needs once it has
            self.ready(layer)  # landed: dequantize its pushed records now (never waits), then read into their place
        _, heads = self.presence.remote_part(layer, idx)
        if heads:
            self.num_speculative_reads += 1
            self._step_read_layers.add(layer)
            self._ahead[layer] = self._start(Entries.of_layer(layer, heads), None)

    def _start(self, entries: Entries, mask: torch.Tensor | None) -> Pending | DirectPending:
        """Read `entries` on demand: on the torch thread's direct link where it has one, else through the loop."""
        if self.direct is not None and (direct := self.direct.fetch(self, entries, mask)) is not None:
            return direct
        return Pending(self.start_read(entries), mask, self.read_timeout_s, self)

    def start_read(self, entries: Entries) -> concurrent.futures.Future[None]:
        """Issue one on-demand read of these entries on the event loop (from any thread); counted as pending at
        once, so a background read cannot slip in before it starts."""
        with self._pending_lock:
            self._on_demand_pending += 1
        return asyncio.run_coroutine_threadsafe(self._read_on_demand(entries), self.loop)

    def read_behind(self, layer: int, idx: torch.Tensor) -> torch.Tensor | None:
        """(torch thread) See RemoteEntries.read_behind and read_behind.py; None where the request stalls."""
        return self.behind.absent_if_missed(layer, idx) if self.behind is not None else None

    def wants_ranking(self, layer: int) -> bool:
        """(torch thread) Rank `layer` again when path 3 is on, it read this step and it still has remote
        entries (where a step had to read, the query is moving to entries the push did not bring), and the steps
        so far waited on reads for less than RANK_WHEN_WAITING_BELOW of their time (`read_wait_share`)."""
        return self._ranking and not self.is_closed and layer in self._step_read_layers \
            and bool(self.presence.missing_per_layer[layer])

    def rank(self, layer: int, idx: torch.Tensor) -> None:
        """(torch thread) `idx` (H_kv, k'): `layer`'s selection under a wider budget; `read_ranked` reads its
        remote part. The step's rankings reach the event loop together when it ends (`end_step`: one wake-up of
        the loop a step, not one a layer); a layer ranked again replaces its older ranking and goes to the back of
        the queue."""
        self._step_rankings.append((layer, idx.cpu()))

    def _queue_rankings(self, rankings: list[tuple[int, torch.Tensor]]) -> None:
        for layer, ranking in rankings:
            self.ranked_queue.pop(layer, None)
            self.ranked_queue[layer] = ranking
        self.ranked_queued.set()

    # === run on the event loop: the reads themselves, marking presence, the push landing, closing ===
    def await_pushes(self, prepare: Callable[[int], None] | None) -> None:
        """Decoding starts before the prefill's push has landed. Until `push_landed(l)`, layer l's pushed blocks
        count as present (the plan says they come) but attention must not read them: each layer waits in
        `ready`, then runs `prepare(l)` on the torch thread once (dequantizing a low-bit push). Entries the
        prompt's last query picked are known per layer as it lands (`push_landed`)."""
        self._landed = [threading.Event() for _ in range(self.layout.num_layers)]
        self._prepared = [False] * self.layout.num_layers
        self._prepare = prepare

    def push_landed(self, layer: int, picked: np.ndarray | None) -> None:
        """(event loop) Every byte `layer` pushes is here. `picked` (num_kv_heads, num_tokens) bool: the entries its
        last-position query picked, pushed with it (present now)."""
        assert self._landed is not None
        if picked is not None:
            self.presence.mark_entries(layer, picked)
        self._landed[layer].set()

    async def _read_on_demand(self, entries: Entries) -> None:
        try:
            # NOTE: not `self.bytes_on_demand += await …`, which reads the counter before the await: a read landing
            # meanwhile (a speculative one and a fetch are in flight together) would be lost from the count
            num_bytes = await self.read_entries(entries, Lane.ON_DEMAND)
            self.bytes_on_demand += num_bytes
        finally:
            with self._pending_lock:
                self._on_demand_pending -= 1
                is_idle = not self._on_demand_pending
            if is_idle:
                self._on_demand_idle.set()

    async def read_entries(self, entries: Entries, lane: Lane) -> int:
        """Read these entries (of any layers) on `lane`, as one gather or, where their runs are long, as segments
        (module docstring), and mark them present once landed (as codes: once dequantized). Returns the bytes read."""
        if self.codes is not None:
            for layer in entries.layers():
                self.check_codes_room(layer)
        gather, landed = self.gather_of(entries)
        as_gather = self.gather_reads and entries.mean_run() < GATHER_BELOW_RUN
        await self.read(gather if as_gather else gather.segments(), lane, landed)
        self.presence.mark(entries)
        return gather.num_bytes

    def gather_of(self, entries: Entries) -> tuple[Gather, Callable[[], None] | None]:
        """Where these entries lie there and land here, and what makes rows of them once landed (codes only)."""
        if self.codes is None:
            return self.presence.gather(entries), None
        codes = self.codes
        return codes.gather(entries), lambda: codes.land(entries)

    @property
    def is_on_demand_busy(self) -> bool:
        """An on-demand read of this request is issued and not settled yet."""
        with self._pending_lock:
            return self._on_demand_pending > 0

    async def wait_on_demand_idle(self) -> None:
        """Until no on-demand read of this request is pending (event loop only)."""
        while self.is_on_demand_busy:
            self._on_demand_idle.clear()  # NOTE: no await between the check and the clear: a settle cannot slip in
            await self._on_demand_idle.wait()

    def has_codes_room(self, layer: int) -> bool:
        """Records read for `layer` may land in its codes region: its pushed records there were dequantized."""
        return self._landed is None or self._prepared[layer]

    def check_codes_room(self, layer: int) -> None:
        """RemoteReadError unless reads of `layer` may land now (see `has_codes_room`); exact reads always may.
        Path 3 runs after step 1, which prepares every layer: one that asks earlier is retried or dropped."""
        if self.codes is not None and not self.has_codes_room(layer):
            raise RemoteReadError(f"layer {layer}'s pushed codes are not dequantized yet")

    @property
    def entry_bytes(self) -> int:
        """What reading one (layer, KV head, token) entry moves: its K and V rows, or its record of codes."""
        return self.codes.record_bytes if self.codes is not None else 2 * self.presence.token_bytes

    @property
    def entries_per_background_read(self) -> int:
        """How many entries one path-3 read moves (`background_read_bytes` of them, at least one)."""
        return max(1, self.background_read_bytes // self.entry_bytes)

    async def read(self, what: list[Segment] | Gather, lane: Lane, landed: Callable[[], None] | None = None) -> None:
        """Read `what` into the slab on `lane`, then run `landed` (records into rows). NOTE: the transfer is
        shielded: a caller cancelled mid-read (a path-3 task at the request's end) leaves it running, because its
        reply would land in the slab anyway; `close` waits for every transfer in flight, `landed` included, so the
        slab is freed only once none can write into it."""
        self.check_readable()
        transfer = asyncio.ensure_future(self._transfer(what, lane, landed))
        self._in_flight.add(transfer)
        transfer.add_done_callback(settled)
        transfer.add_done_callback(self._in_flight.discard)
        await asyncio.shield(transfer)

    async def _transfer(self, what: list[Segment] | Gather, lane: Lane, landed: Callable[[], None] | None) -> None:
        whole_frames = self.direct is not None and lane == Lane.BACKGROUND  # see kv_loader.BACKGROUND_READ_DIRECT_S
        read = self.dataplane.read_gather if isinstance(what, Gather) else self.dataplane.read
        await read(self.source.dataplane_addr, self.source.ticket, what, lane, whole_frames)  # type: ignore[arg-type]
        if landed is not None:
            landed()

    def fail(self, reason: str) -> None:
        """The prefill node is lost, or its push will not complete: reads from now on fail at once (the caller cuts
        the link, which fails the reads in flight), and so does every layer still waiting for its push."""
        self.failure = self.failure or reason
        self._wake_layers()

    def _wake_layers(self) -> None:
        """A layer waiting for its push (`ready`) stops waiting: it raises (failed or closed) instead of holding
        the torch thread, and every request batched with it, until the read timeout."""
        for event in self._landed or []:
            event.set()

    async def close(self, timeout_s: float = 30.0) -> None:
        """No new reads; return once no read can write into the slab any more: every transfer in flight has
        settled (its bytes landed, or it failed). One still unsettled after `timeout_s` has its link cut, which
        fails it at once on TCP (no reply is received after that); over RDMA a READ settles on its own, by
        completing or by the queue pair's error."""
        self.is_closed = True
        self._wake_layers()
        if not self._in_flight:
            return
        _, unsettled = await asyncio.wait(list(self._in_flight), timeout=timeout_s)
        if unsettled:
            log.warning("reads_unsettled_at_close", count=len(unsettled), timeout_s=timeout_s)
            try:
                self.dataplane.cut_links(f"reads unsettled {timeout_s:g} s after the request ended",
                                         peer=self.source.dataplane_addr)
            except NotImplementedError:
                pass
            await asyncio.wait(unsettled)

    # === either thread: read-only summaries of presence ===
    @property
    def is_all_local(self) -> bool:
        """Every entry is here, and every layer's push has landed and been prepared (see `ready`)."""
        return self.num_missing == 0 and self._landed is None

    @property
    def num_missing(self) -> int:
        return self.presence.num_missing

    def local_blocks(self) -> np.ndarray:
        """(num_layers, num_pages) bool: blocks wholly on this node."""
        return self.presence.local_blocks()

    @property
    def local_share(self) -> float:
        total = self.num_read_local + self.num_read_remote
        return self.num_read_local / total if total else 1.0

    def check_readable(self) -> None:
        if self.failure:
            raise RemoteReadError(self.failure)
        if self.is_closed:
            raise RemoteReadError("the request's remote KV was released")
