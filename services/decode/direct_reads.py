"""On-demand reads the torch thread issues and receives itself, on a link of its own to each prefill worker
(shared/dataplane/direct_reader.py), instead of through the event loop: path 2's reads without the two GIL
hand-offs and the loop's work per read. Only plain TCP has them (not TLS, RDMA, the transfer agent or the
in-process plane); a request whose plan ablates "direct" reads through the loop as before, and so does any read
while its peer's reader is not open yet, or broken.

The rule between the threads (services/decode/remote.py's, extended):
  - the event loop opens a peer's reader when a request starts reading from it (`open`), and drops it when the
    link to that peer is lost (`drop`, which wakes a torch thread blocked in it); a broken one is opened again;
  - the torch thread alone uses a reader: `fetch` starts a read (its frames leave at once, the step gathers its
    local entries meanwhile), `DirectPending.wait` lands it, and `settle` (every step's end) waits for any read
    a failed step left, so no reply can land in a slab once its request has moved on.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog
import torch

from services.decode.presence import Entries
from services.decode.reads import Pending, RemoteReadError
from shared.dataplane import DataPlaneError
from shared.dataplane.direct_reader import DirectRead, DirectReader

if TYPE_CHECKING:
    from services.decode.config import DecodeConfig

    from services.decode.remote import RemoteKv
    from shared.dataplane.tcp import TcpDataPlane

log = structlog.get_logger()
REOPEN_AFTER_S = 5.0  # a peer whose reader could not be opened is tried again after this long


class DirectPending:
    """An on-demand read on a DirectReader, as `Pending` is one on the loop: `wait` lands it (records into rows,
    entries marked present) or raises RemoteReadError."""

    def __init__(self, remote: RemoteKv, reader: DirectReader, read: DirectRead, entries: Entries,
                 landed: Callable[[], None] | None, mask: torch.Tensor | None):
        self.owner, self.reader, self.read, self.entries, self.landed = remote, reader, read, entries, landed
        self.remote = mask  # (H_kv, k) bool: which selected entries it brings (None: a whole layer)
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        owner = self.owner
        started = time.perf_counter()
        try:
            self.reader.wait(self.read)
        except DataPlaneError as exc:
            owner.check_readable()  # the request's remote KV failed (its prefill node is lost) or ended: say that
            if not self.reader.is_broken:
                raise RemoteReadError(f"on-demand read failed: {exc}") from exc
            # the reader broke (its link was cut or timed out), not this read: read it again through the loop,
            # which fails at once if the peer is gone (RemoteKv.fail)
            log.info("direct_read_fell_back", peer=self.reader.peer, error=str(exc))
            Pending(owner.start_read(self.entries), None, owner.read_timeout_s, owner).wait()
            return
        finally:
            owner.step_wait_s += time.perf_counter() - started
            owner.direct.pending.discard(self)  # type: ignore[union-attr]
        if self.landed is not None:
            self.landed()
        owner.presence.mark(self.entries)
        owner.bytes_direct += self.read.num_bytes


class DirectReads:
    """A decode worker's readers, one per prefill peer."""

    def __init__(self, dataplane: TcpDataPlane, region: memoryview, checksums: bool, timeout_s: float):
        self.dataplane, self.region, self.checksums, self.timeout_s = dataplane, region, checksums, timeout_s
        self.readers: dict[str, DirectReader] = {}
        self.pending: set[DirectPending] = set()  # started and not waited for (torch thread)
        self._opening: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}
        self._dropped_checksum_failures = 0  # of readers replaced or dropped

    @property
    def num_checksum_failures(self) -> int:
        """Replies whose crc32c did not match, on every reader this worker has had (the data plane's own count leaves
        these out: they never pass through its links)."""
        return self._dropped_checksum_failures + sum(r.num_checksum_failures for r in list(self.readers.values()))

    # --- the event loop ----------------------------------------------------------------------------
    def open(self, peer: str) -> None:
        """A request reads from `peer`: open its reader in the background unless one works (or failed lately)."""
        reader = self.readers.get(peer)
        if (reader is not None and not reader.is_broken) or peer in self._opening or \
                time.monotonic() - self._failed_at.get(peer, -REOPEN_AFTER_S) < REOPEN_AFTER_S:
            return
        task = self._opening[peer] = asyncio.create_task(self._open(peer))
        task.add_done_callback(lambda _: self._opening.pop(peer, None))

    async def _open(self, peer: str) -> None:
        try:
            sock = await self.dataplane.dial_reads_only(peer)
        except DataPlaneError as exc:
            self._failed_at[peer] = time.monotonic()
            log.warning("direct_reads_unavailable", peer=peer, error=str(exc))
            return
        old, self.readers[peer] = self.readers.get(peer), DirectReader(sock, self.region, peer, self.checksums,
                                                                       self.timeout_s)
        if old is not None:
            self._dropped_checksum_failures += old.num_checksum_failures
            old.close()

    def drop(self, peer: str) -> None:
        """The link to `peer` is lost: break its reader now (a read blocked in it fails at once)."""
        reader = self.readers.pop(peer, None)
        if reader is not None:
            self._dropped_checksum_failures += reader.num_checksum_failures
            reader.close()

    async def close(self) -> None:
        for task in list(self._opening.values()):
            task.cancel()
        await asyncio.gather(*self._opening.values(), return_exceptions=True)
        for peer in list(self.readers):
            self.drop(peer)

    # --- the torch thread --------------------------------------------------------------------------
    def fetch(self, remote: RemoteKv, entries: Entries, mask: torch.Tensor | None) -> DirectPending | None:
        """Start reading these entries (of one layer) on the peer's reader; None where there is none that works (the
        caller reads through the loop)."""
        reader = self.readers.get(remote.source.dataplane_addr)
        if reader is None or reader.is_broken:
            return None
        gather, landed = remote.gather_of(entries)
        try:
            read = reader.start(remote.source.ticket, gather)
        except DataPlaneError:
            return None  # broken: this read goes through the loop, and a later request opens a new reader
        remote.num_direct_reads += 1
        pending = DirectPending(remote, reader, read, entries, landed, mask)
        self.pending.add(pending)
        return pending

    def settle(self) -> None:
        """Wait for every read started and not waited for (a step that failed half-way): their replies land
        now, while their slabs are still theirs. Errors are the failed step's, already reported."""
        for pending in list(self.pending):
            try:
                pending.wait()
            except RemoteReadError:
                pass


def direct_reads_for(dataplane: object, region: memoryview, config: DecodeConfig) -> DirectReads | None:
    """The worker's direct reads, where its data plane can have them: plain TCP in this process, turned on."""
    from shared.dataplane.tcp import TcpDataPlane

    if not config.direct_reads or type(dataplane) is not TcpDataPlane or dataplane.tls is not None:
        return None
    return DirectReads(dataplane, region, dataplane.use_checksums, config.kv_timeout_s)
