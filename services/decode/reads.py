"""An on-demand read as the torch thread sees it, and the measured thresholds that shape reads: `Pending`, the
handle attention waits on (never on the event loop), its error, and when reads go as one gather, when a step
speculates and when it ranks (services/decode/remote.py uses them)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.decode.remote import RemoteKv

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


def settled(transfer: asyncio.Future[None]) -> None:
    """Retrieve a transfer's outcome, so one whose caller was cancelled does not log "never retrieved"."""
    if not transfer.cancelled():
        transfer.exception()


class RemoteReadError(RuntimeError):
    """KV that decoding needs could not be read from the prefill node."""


@dataclass
class Pending:
    """An on-demand read in flight, started by `fetch`."""

    future: concurrent.futures.Future[None]
    remote: torch.Tensor | None  # (H_kv, k) bool: which selected entries it brings (None: a whole layer)
    timeout_s: float
    owner: RemoteKv  # whose step_wait_s the wait counts into

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
