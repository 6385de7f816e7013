"""The part of one request's KV that is still on the prefill node, and the reads that bring it over
(paths 2 and 3: docs/architecture.md, "The three transfer paths"). The decode node owns this picture; the broker only schedules.

Presence is kept per (layer, KV head, prompt token): proactive pushes mark whole blocks (and, smartgen's
query-aware push, single entries) before decoding starts, on-demand reads mark exactly the entries a step
selected, background reads mark whole blocks (the broker's, in profile order) or the entries a wider selection for
the latest query adds (ranked reads, `rank`).
Tokens decoded here are always local. Threads:
  - the torch thread calls `fetch` inside attention and waits on the returned `Pending` (never on the loop);
  - the event loop runs every read, marks presence once bytes have landed, and runs `read_blocks` and `close`.
NOTE: presence only turns True after the bytes are in the slab, so a stale False costs a duplicate read,
never a wrong value.

An on-demand read names its entries one of two ways: as segments, one per run of consecutive tokens (whole
pages: dense layers, Quest's pages), or as one gather, one index per token (`gather_reads`; token-level
selectors, whose runs are a token or two long, where building and serving one segment each cost more than the
step's attention).
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


log = structlog.get_logger()
GATHER_BELOW_RUN = 64  # tokens: reads whose runs are shorter than this on average go as one gather
# Speculation costs one more selection per layer; it pays where most layers have to read. A step speculates when
# at least this share of the layers that can read had to in the step before (step 1 always), and only where the
# service turned it on (`speculative`: InfiniGen, services/decode/kv_loader.py `_speculates`). Measured at 2K, R = 2
# prefill-matched (docs/results/serve-2k-speculation-*): InfiniGen reads in ~80% of its layers every step and
# speculating cut its on-demand wait 2.49 -> 0.78 s and TBT 0.140 -> 0.126 s; Quest reads in ~20% after step 1,
# and speculating every step cost more selection time than it saved (TBT 0.073 -> 0.082 s).
SPECULATE_WHEN_READING = 0.5
# Ranked reads (path 3 by the latest query) are a prefetch: at 2K, R = 2 prefill-matched, about a quarter of what
# they bring is selected later (2.8 MB read, on-demand 1.4 -> 0.7 MB). Where the link has room that is free; where
# on-demand reads already keep it busy (R = 6.5: half of each step is spent waiting on them) they delay those
# reads. So a step ranks only while the running share of a step spent waiting on reads is below this.
RANK_WHEN_WAITING_BELOW = 0.25
WAIT_SHARE_WEIGHT = 0.25  # each step's weight in the running share of a step spent waiting on reads (misses are bursty)


def _mean_run(heads: list[tuple[int, np.ndarray]]) -> float:
    """Mean length of the runs of consecutive tokens in a read (tokens sorted per head)."""
    runs = sum(1 + int(np.count_nonzero(np.diff(tokens) != 1)) for _, tokens in heads)
    return sum(tokens.size for _, tokens in heads) / runs


def _chunks(heads: list[tuple[int, np.ndarray]], max_tokens: int) -> list[list[tuple[int, np.ndarray]]]:
    """Split (head, tokens) pairs into reads of at most `max_tokens` entries each, in order."""
    chunks: list[list[tuple[int, np.ndarray]]] = [[]]
    room = max_tokens
    for h, tokens in heads:
        while tokens.size:
            if not room:
                chunks.append([])
                room = max_tokens
            chunks[-1].append((h, tokens[:room]))
            tokens, room = tokens[room:], room - min(room, tokens.size)
    return [c for c in chunks if c]


class RemoteReadError(RuntimeError):
    """KV that decoding needs could not be read from the prefill node."""


@dataclass
class Pending:
    """An on-demand read in flight, started by `fetch`."""

    future: concurrent.futures.Future[None]
    remote: torch.Tensor | None  # (H_kv, k) bool: which selected entries it brings (None: a whole layer)
    timeout_s: float
    owner: "RemoteKv"

    def wait(self) -> None:
        started = time.perf_counter()
        try:
            self.future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise RemoteReadError(f"an on-demand read took longer than {self.timeout_s:g} s") from None
        except Exception as exc:
            raise RemoteReadError(f"on-demand read failed: {exc}") from exc
        finally:
            self.owner.step_wait_s += time.perf_counter() - started


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
    pushed_entries: np.ndarray | None = None  # (num_layers, num_kv_heads, num_tokens) bool: pushed one by one
                                              # (smartgen's query-aware push), already landed
    gather_reads: bool = True  # on-demand reads of short runs as one gather (module docstring); False: segments
    speculative: bool = True  # read a layer's predicted selection while the layer before it runs (`speculate`)
    ranked: bool = False  # path 3 by the latest query (`rank`, `read_ranked`)
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
    is_closed: bool = False
    failure: str = ""  # set when the prefill node is lost: every later read fails at once with it

    def __post_init__(self) -> None:
        lay = self.layout
        self.num_kv_heads, self.page_tokens = lay.num_kv_heads, lay.page_tokens
        self.num_pages = self.pushed.shape[1]
        item = lay.token_bytes // (2 * lay.num_layers * lay.num_kv_heads * lay.head_dim)
        self.token_bytes = lay.head_dim * item  # one token of one head's K (or V)
        rows = np.arange(lay.num_layers * 2 * lay.num_kv_heads).reshape(lay.num_layers, 2, lay.num_kv_heads)
        self.src_rows = self.source.offset + rows * self.source.capacity * self.token_bytes  # (L, K|V, H) bytes
        self.dst_rows = self.dst_offset + rows * self.dst_capacity * self.token_bytes
        padded = np.repeat(self.pushed, self.page_tokens, axis=1)[:, : self.num_tokens]  # (L, N)
        self.present = np.repeat(padded[:, None], self.num_kv_heads, axis=1)  # (L, H, N)
        if self.pushed_entries is not None:
            self.present |= self.pushed_entries
        self.missing_per_layer = (~self.present).sum(axis=(1, 2))
        self.num_missing = int(self.missing_per_layer.sum())
        self._step_local = self._step_remote = 0
        self._tasks: set[asyncio.Task] = set()
        # NOTE: counted when `fetch` issues a read (torch thread), not when the loop starts it, so a background
        # read never slips in between; the lock guards the count across the two threads.
        self._on_demand_pending = 0
        self._pending_lock = threading.Lock()
        self._on_demand_idle = asyncio.Event()
        self._on_demand_idle.set()
        self._ahead: dict[int, concurrent.futures.Future[None]] = {}  # layer → its speculative read (`speculate`)
        # No global push barrier (`await_pushes`): per layer, set once its pushes have landed; None when every
        # layer has landed and been prepared (or decoding waited for the whole push before it started)
        self._landed: list[threading.Event] | None = None
        self._prepared: list[bool] = []
        self._prepare: Callable[[int], None] | None = None
        self._step_read_layers: set[int] = set()  # layers that issued a read this step (torch thread)
        self._speculating = self.speculative  # this step: see SPECULATE_WHEN_READING
        self._ranking = self.ranked  # this step: see RANK_WHEN_WAITING_BELOW
        self._step_started, self._landing_before_step = time.perf_counter(), 0.0
        self._ranked: dict[int, torch.Tensor] = {}  # layer → its latest wider selection (H_kv, k'), oldest first
        self._ranked_queued = asyncio.Event()
        self._background_turn = asyncio.Lock()  # ranked reads and `read_blocks` put one chunk on the wire at a time

    # --- the push still landing: no global barrier (services/decode/kv_loader.py `load_while_pushing`) ---------
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
            self._mark_entries(layer, picked)
        self._landed[layer].set()

    def is_ready(self, layer: int) -> bool:
        landed = self._landed
        return landed is None or landed[layer].is_set()

    def ready(self, layer: int) -> None:
        """(torch thread) Block until `layer`'s pushed KV has landed; prepare it the first time."""
        landed = self._landed
        if landed is None or self._prepared[layer]:
            return
        if not landed[layer].is_set():
            started = time.perf_counter()
            arrived = landed[layer].wait(self.read_timeout_s)
            waited = time.perf_counter() - started
            self.step_wait_s += waited
            self.landing_wait_s += waited
            if not arrived:
                raise RemoteReadError(f"layer {layer}'s pushed KV did not land within {self.read_timeout_s:g} s")
        self._check_readable()  # a push that failed sets every event
        if self._prepare is not None:
            self._prepare(layer)
        self._prepared[layer] = True
        if all(self._prepared):
            self._landed = None

    # --- torch thread ----------------------------------------------------------------------
    def begin_step(self) -> None:
        self._step_local = self._step_remote = 0
        self.step_wait_s = 0.0
        self._step_read_layers.clear()
        self._step_started = time.perf_counter()
        self._landing_before_step = self.landing_wait_s

    def end_step(self) -> None:
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

    def fetch(self, layer: int, idx: torch.Tensor | None) -> Pending | None:
        """Start reading the entries of `layer` that attention needs and are not here: `idx` (H_kv, k)
        selected token indices, or None for every token (dense layers). None if all are local."""
        self._check_readable()
        ahead = self._ahead.pop(layer, None)
        if ahead is not None:  # what was read speculatively for this layer lands first; then only what it missed
            Pending(ahead, None, self.read_timeout_s, self).wait()
        remote, heads = self._remote_part(layer, idx)
        if idx is not None:  # NOTE: the local share counts selected entries; dense layers read everything anyway
            num_remote = int(remote.sum())
            self._step_remote += num_remote
            self._step_local += idx.numel() - num_remote
        if not heads:
            return None
        self.num_fetch_reads += 1
        self._step_read_layers.add(layer)
        future = self._start_read(layer, heads)
        return Pending(future, torch.from_numpy(remote) if idx is not None else None, self.read_timeout_s, self)

    def wants_speculation(self, layer: int) -> bool:
        return self._speculating and layer < len(self.missing_per_layer) and bool(self.missing_per_layer[layer]) \
            and layer not in self._ahead

    def speculate(self, layer: int, idx: torch.Tensor) -> None:
        """The speculative part of path 2, each step: start reading the remote part of `idx`, a prediction of
        `layer`'s selection made while the layer before it runs (shared/compute/selective.py); `fetch(layer, …)`
        waits for it first. On the on-demand lane: the step waits for it a layer from now."""
        self._check_readable()
        _, heads = self._remote_part(layer, idx)
        if heads:
            self.num_speculative_reads += 1
            self._step_read_layers.add(layer)
            self._ahead[layer] = self._start_read(layer, heads)

    def _remote_part(self, layer: int, idx: torch.Tensor | None) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """Which of the entries `idx` (H_kv, k) selects at `layer` (None: all its tokens) are not here: a bool mask
        of idx's shape (of (H_kv, N) for None), and per KV head with any, (head, its remote token indices)."""
        present = self.present[layer]
        if not self.missing_per_layer[layer]:
            return np.zeros(present.shape if idx is None else tuple(idx.shape), dtype=bool), []
        if idx is None:
            remote = ~present
        else:
            idx_np = idx.cpu().numpy()
            remote = np.zeros(idx_np.shape, dtype=bool)
            in_prompt = idx_np < self.num_tokens  # decoded tokens are local
            rows = np.broadcast_to(np.arange(idx_np.shape[0])[:, None], idx_np.shape)
            remote[in_prompt] = ~present[rows[in_prompt], idx_np[in_prompt]]
        heads = []
        for h in range(self.num_kv_heads):
            tokens = np.flatnonzero(remote[h]) if idx is None else idx_np[h][remote[h]]
            if tokens.size:
                heads.append((h, tokens))
        return remote, heads

    def _start_read(self, layer: int, heads: list[tuple[int, np.ndarray]]) -> concurrent.futures.Future[None]:
        """Issue one read of these entries of `layer` on the event loop (from any thread); counted as pending at
        once, so a background read cannot slip in before it starts."""
        with self._pending_lock:
            self._on_demand_pending += 1
        return asyncio.run_coroutine_threadsafe(self._read_on_demand(layer, heads), self.loop)

    # --- event loop ------------------------------------------------------------------------
    async def _read_on_demand(self, layer: int, heads: list[tuple[int, np.ndarray]]) -> None:
        try:
            self.bytes_on_demand += await self._read_entries(layer, heads, Lane.ON_DEMAND)
        finally:
            with self._pending_lock:
                self._on_demand_pending -= 1
                is_idle = not self._on_demand_pending
            if is_idle:
                self._on_demand_idle.set()

    async def _read_entries(self, layer: int, heads: list[tuple[int, np.ndarray]], lane: Lane) -> int:
        """Read these entries of `layer` (per KV head, sorted token indices) on `lane`, as one gather or as segments
        (module docstring), and mark them present once landed. Returns the bytes read."""
        if self.gather_reads and _mean_run(heads) < GATHER_BELOW_RUN:
            gather = self._gather(layer, heads)
            await self._read(gather, lane)
            num_bytes = gather.num_bytes
        else:
            segments = [s for h, tokens in heads for s in self._segments(layer, h, tokens)]
            await self._read(segments, lane)
            num_bytes = sum(s.length for s in segments)
        for h, tokens in heads:
            self._mark(layer, h, tokens)
        return num_bytes

    # --- path 3 by the latest query (shared/compute/selective.py, "Ranked reads") -----------
    def wants_ranking(self, layer: int) -> bool:
        """(torch thread) Rank `layer` again when path 3 is on, it read this step and it still has remote
        entries (where a step had to read, the query is moving to entries the push did not bring), and the steps
        so far waited on reads for less than RANK_WHEN_WAITING_BELOW of their time (`read_wait_share`)."""
        return self._ranking and not self.is_closed and layer in self._step_read_layers \
            and bool(self.missing_per_layer[layer])

    def rank(self, layer: int, idx: torch.Tensor) -> None:
        """(torch thread) `idx` (H_kv, k'): `layer`'s selection under a wider budget; `read_ranked` reads its
        remote part. A layer ranked again replaces its older ranking and goes to the back of the queue."""
        self.loop.call_soon_threadsafe(self._queue_ranking, layer, idx.cpu())

    def _queue_ranking(self, layer: int, ranking: torch.Tensor) -> None:
        self._ranked.pop(layer, None)
        self._ranked[layer] = ranking
        self._ranked_queued.set()

    async def read_ranked(self) -> None:
        """(event loop task, while the request has remote KV) Read each queued ranking's remote part, oldest first,
        in background-lane chunks, never while an on-demand read of this request is waiting. What is remote is
        decided at read time, so entries an on-demand read brought meanwhile are not read twice. A chunk that fails
        is dropped (these reads only save later on-demand ones); a failed or closed remote view ends the task."""
        chunk_tokens = max(1, self.background_read_bytes // (2 * self.token_bytes))  # K and V of one entry
        while not self.is_closed:
            if not self._ranked:
                self._ranked_queued.clear()
                await self._ranked_queued.wait()
                continue
            layer = next(iter(self._ranked))
            ranking = self._ranked.pop(layer)
            await self._wait_on_demand_idle()
            _, heads = self._remote_part(layer, ranking)
            for chunk in _chunks(heads, chunk_tokens):
                async with self._background_turn:
                    await self._wait_on_demand_idle()
                    if self.is_closed or self.failure:
                        return
                    try:
                        num_bytes = await self._read_entries(layer, chunk, Lane.BACKGROUND)
                    except Exception as exc:  # noqa: BLE001 (see the docstring)
                        if self.is_closed or self.failure:
                            return
                        log.warning("ranked_read_failed", layer=layer, error=str(exc))
                        break
                self.bytes_background += num_bytes
                self.bytes_ranked += num_bytes
                self.num_ranked_reads += 1

    @property
    def is_on_demand_busy(self) -> bool:
        """An on-demand read of this request is issued and not settled yet."""
        with self._pending_lock:
            return self._on_demand_pending > 0

    async def _wait_on_demand_idle(self) -> None:
        """Until no on-demand read of this request is pending (event loop only)."""
        while self.is_on_demand_busy:
            self._on_demand_idle.clear()  # NOTE: no await between the check and the clear: a settle cannot slip in
            await self._on_demand_idle.wait()

    async def read_blocks(self, blocks: list[int]) -> None:
        """Path 3: move these (layer, page) blocks on the background lane, a small read at a time, never while
        an on-demand read of this request is waiting."""
        units = []  # (layer, head, tokens, its K and V segments): marked present only once both have landed
        for block in blocks:
            layer, page = divmod(block, self.num_pages)
            tokens = np.arange(page * self.page_tokens, min(self.num_tokens, (page + 1) * self.page_tokens))
            for h in range(self.num_kv_heads):
                if not self.present[layer, h, tokens].all():
                    units.append((layer, h, tokens, self._segments(layer, h, tokens)))
        while units:
            group, size = [], 0
            while units and (not group or size + sum(s.length for s in units[0][3]) <= self.background_read_bytes):
                group.append(units.pop(0))
                size += sum(s.length for s in group[-1][3])
            async with self._background_turn:  # one background chunk of this request on the wire at a time
                await self._wait_on_demand_idle()
                if self.is_closed:
                    return
                await self._read([s for *_, segs in group for s in segs], Lane.BACKGROUND)
            for layer, h, tokens, _ in group:
                self._mark(layer, h, tokens)
            self.bytes_background += size

    async def _read(self, what: list[Segment] | Gather, lane: Lane) -> None:
        self._check_readable()
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if isinstance(what, Gather):
                await self.dataplane.read_gather(self.source.dataplane_addr, self.source.ticket, what, lane)
            else:
                await self.dataplane.read(self.source.dataplane_addr, self.source.ticket, what, lane)
        finally:
            self._tasks.discard(task)

    def _gather(self, layer: int, heads: list[tuple[int, np.ndarray]]) -> Gather:
        """One layer's entries as one gather: K rows then V rows, each (kv·H + head)·capacity + token, in units of
        one token of one head (`token_bytes`)."""
        head = np.concatenate([np.full(tokens.size, h) for h, tokens in heads])
        token = np.concatenate([tokens for _, tokens in heads])
        rows = np.concatenate([head, head + self.num_kv_heads])  # K|V × head, as in src_rows / dst_rows
        token = np.concatenate([token, token])
        return Gather(int(self.src_rows[layer, 0, 0]), int(self.dst_rows[layer, 0, 0]), self.token_bytes,
                      rows * self.source.capacity + token, rows * self.dst_capacity + token)

    def _segments(self, layer: int, head: int, tokens: np.ndarray) -> list[Segment]:
        """Runs of consecutive tokens → one K and one V segment each (slab rows are token-contiguous)."""
        breaks = np.flatnonzero(np.diff(tokens) != 1) + 1
        starts, stops = tokens[np.r_[0, breaks]], tokens[np.r_[breaks - 1, tokens.size - 1]] + 1
        tb = self.token_bytes
        return [Segment(int(self.src_rows[layer, kv, head] + a * tb), int(self.dst_rows[layer, kv, head] + a * tb),
                        int((b - a) * tb))
                for kv in (0, 1) for a, b in zip(starts.tolist(), stops.tolist())]

    def _mark_entries(self, layer: int, entries: np.ndarray) -> None:
        """`entries` (num_kv_heads, num_tokens) bool of `layer` are here."""
        row = self.present[layer]
        fresh = int((entries & ~row).sum())
        row |= entries
        self.missing_per_layer[layer] -= fresh
        self.num_missing -= fresh

    def _mark(self, layer: int, head: int, tokens: np.ndarray) -> None:
        row = self.present[layer, head]
        fresh = int((~row[tokens]).sum())
        row[tokens] = True
        self.missing_per_layer[layer] -= fresh
        self.num_missing -= fresh

    @property
    def is_all_local(self) -> bool:
        """Every entry is here, and every layer's push has landed and been prepared (see `ready`)."""
        return self.num_missing == 0 and self._landed is None

    @property
    def local_share(self) -> float:
        total = self.num_read_local + self.num_read_remote
        return self.num_read_local / total if total else 1.0

    def local_blocks(self) -> np.ndarray:
        """(num_layers, num_pages) bool: blocks wholly on this node."""
        n_pad = self.num_pages * self.page_tokens - self.num_tokens
        full = np.pad(self.present.all(axis=1), ((0, 0), (0, n_pad)), constant_values=True)
        return full.reshape(full.shape[0], self.num_pages, self.page_tokens).all(axis=2)

    def _check_readable(self) -> None:
        if self.failure:
            raise RemoteReadError(self.failure)
        if self.is_closed:
            raise RemoteReadError("the request's remote KV was released")

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
        """No new reads; wait until every read in flight has settled (their bytes land in the slab)."""
        self.is_closed = True
        self._wake_layers()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
