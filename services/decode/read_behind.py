"""Path 2 without the stall (a request that ablates "stall"): after step 1, where a layer's selection picks entries
that are not on this node, the step attends to the best local entries instead (the selector's next best, by the
same scores: shared/compute/floor.py `absent`) and the picked ones are read on the on-demand lane with nobody
waiting, so a later step finds them here. A step then never waits on the link: its time is the all-local step's,
whatever the link's rate, and the link carries what the selections want, as soon as they want it.

The trade: a step may attend to a slightly different set than an all-local run would, so its tokens may differ.
How much is measured, not assumed (docs/results/read-behind-*: KL against dense beside the latency).

Runs on the torch thread (`absent_if_missed`) and hands the reads to the event loop through RemoteKv; an entry
asked for is not asked again while its read is in flight (`asked`), and a failed read lets a later step ask again.
"""
from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING

import numpy as np
import torch

from services.decode.presence import Entries

if TYPE_CHECKING:
    from services.decode.remote import RemoteKv


class ReadBehind:
    def __init__(self, remote: RemoteKv):
        self.remote = remote
        self.asked = np.zeros_like(remote.presence.present)  # (L, H_kv, N) bool: a read behind is in flight for it
        self.num_reads = 0  # reads started
        self.num_substituted = 0  # selected entries that were not here, all steps: a local one was attended instead

    def absent_if_missed(self, layer: int, idx: torch.Tensor) -> torch.Tensor | None:
        """(torch thread) `idx` (H_kv, k): `layer`'s selection. If some of it is not here, read those entries without
        waiting and return (H_kv, N) bool, the prompt entries not here now. None when all are local, and in step 1
        (which waits as usual: the push brings its selection, and TTST is what it is for)."""
        remote = self.remote
        if not remote.step_wait or not remote.presence.missing_per_layer[layer]:
            return None
        missed, heads = remote.presence.remote_part(layer, idx)
        if not heads:
            return None
        asked = self.asked[layer]
        fresh = [(h, tokens[~asked[h, tokens]]) for h, tokens in heads]
        fresh = [(h, tokens) for h, tokens in fresh if tokens.size]
        if fresh:
            for h, tokens in fresh:
                asked[h, tokens] = True
            self.num_reads += 1
            future = remote.start_read(Entries.of_layer(layer, fresh))
            future.add_done_callback(lambda f: self._settled(f, layer, fresh))
        self.num_substituted += int(missed.sum())
        return torch.from_numpy(~remote.presence.present[layer])

    def _settled(self, future: concurrent.futures.Future[None], layer: int, heads: list[tuple[int, np.ndarray]]) -> None:
        """A read behind ended: landed entries are present now (RemoteKv marked them); a failed one may be asked
        again by a later step (if the prefill node is lost, that step's fetch raises instead)."""
        if future.cancelled() or future.exception() is not None:
            for h, tokens in heads:
                self.asked[layer, h, tokens] = False
