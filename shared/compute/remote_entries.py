"""What selective attention asks of the KV entries still on another node (the partial and smartgen modes). The decode
service implements it over its data plane (services/decode/remote.py); the compute package only asks, on the torch
thread, and never waits on anything but a `PendingRead`."""
from __future__ import annotations

from typing import Protocol

import torch


class PendingRead(Protocol):
    """A read of remote KV entries in flight; once `wait()` returns, their bytes are in the slab."""

    remote: torch.Tensor | None  # (H_kv, k) bool: which of the selected entries it brings (None: a whole layer)

    def wait(self) -> None:
        """Block the torch thread until the read has landed; raise if it failed."""


class RemoteEntries(Protocol):
    """The KV entries of one request that are still on another node, as attention sees them. The decode
    service implements it over its data plane (services/decode/remote.py); the compute package only asks."""

    parallel: bool  # gather the local entries while the remote read is in flight (path 2)

    def begin_step(self) -> None:
        """A decode step starts (per-step counters)."""

    def ready(self, layer: int) -> None:
        """Block until `layer`'s pushed KV (and its metadata) has landed: step 1 may start while the prefill's push
        is still arriving, a layer at a time. Raises if it cannot land."""

    def is_ready(self, layer: int) -> bool:
        """Whether `layer`'s pushed KV has landed (never blocks)."""

    def end_step(self) -> None:
        """The decode step is over."""

    def fetch(self, layer: int, idx: torch.Tensor | None) -> PendingRead | None:
        """Start reading the entries of `layer` that attention needs and that are not local: `idx` (H_kv, k)
        selected token indices, or None for every token. None when all are local."""

    def wants_speculation(self, layer: int) -> bool:
        """Whether predicting `layer`'s selection could save a read: speculation is on and entries are remote."""

    def speculate(self, layer: int, idx: torch.Tensor) -> None:
        """Start reading the remote part of `idx` (H_kv, k), a prediction of `layer`'s selection; `fetch(layer,
        …)` waits for it, then reads only what it missed."""

    def wants_ranking(self, layer: int) -> bool:
        """Whether to rank `layer` again under a wider budget this step (it read, and path 3 is on)."""

    def rank(self, layer: int, idx: torch.Tensor) -> None:
        """`idx` (H_kv, k'), `layer`'s selection for this step's query under a wider budget: read its remote part on
        the background lane (never blocks)."""

    def read_behind(self, layer: int, idx: torch.Tensor) -> torch.Tensor | None:
        """Where the request does not stall on misses (it ablates "stall") and some of `idx` (H_kv, k), `layer`'s
        selection, are not local: start reading them with nobody waiting, and return (H_kv, N) bool, the prompt
        entries not local, so the step picks the best local ones instead. None: fetch (and wait) as usual."""
