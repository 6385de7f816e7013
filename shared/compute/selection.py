"""One request's selective-attention state on a decode node: its selector, budget and per-layer selector states,
where its KV not yet local lives (`RemoteEntries`), and what its steps selected (counters for the report, the
attention mass kept when measured, and the profile blocks for online profiles). The decode step
(shared/compute/selective.py) reads and updates it on the engine's torch thread."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from shared.runtime.profiles import token_blocks
from shared.compute.remote_entries import RemoteEntries
from shared.compute.selectors import DENSE_LAYERS, Budget, LayerState, Selector


@dataclass
class Selection:
    """One request's selective-attention state: its selector, budget and per-layer metadata."""

    selector: Selector
    budget: Budget
    measure_mass: bool = False  # also compute the dense attention to report how much mass was kept
    states: dict[int, LayerState] = field(default_factory=dict)
    remote: RemoteEntries | None = None  # the KV still on the prefill node; None once every entry is local
    # layer → its state from the pushed metadata, for layers not restored yet (their metadata may still be landing:
    # restored on first use, after `remote.ready`); None: every state is in `states` or built from local keys
    restore: Callable[[int], LayerState] | None = None
    block_of_token: np.ndarray | None = None  # (prompt tokens,) relative profile block, when counting selections
    block_counts: np.ndarray | None = None  # (num_layers, num_blocks) tokens selected per relative block
    picks: dict[int, torch.Tensor] | None = None  # layer → (H_kv, k') what it selected last, when recording
    num_steps: int = 0
    num_sparse_steps: int = 0  # steps that selected (the others attended densely: short context, or k ≥ n)
    mass_sum: float = 0.0
    num_selections: int = 0
    num_selected: int = 0
    num_candidates: int = 0
    _tokens: tuple[int, int] = (-1, 0)  # (n, budget.tokens(n)) of the last step

    def tokens(self, n: int) -> int:
        """`budget.tokens(n)`, remembered for the last n (every layer of a step asks for the same one)."""
        if self._tokens[0] != n:
            self._tokens = (n, self.budget.tokens(n))
        return self._tokens[1]

    def count_blocks(self, num_layers: int, num_prompt_tokens: int, num_blocks: int) -> None:
        """Also count which relative blocks of the prompt each step selects (for online profiles)."""
        self.block_of_token = token_blocks(num_prompt_tokens, num_blocks)
        self.block_counts = np.zeros((num_layers, num_blocks), dtype=np.float32)

    def _count(self, layer: int, idx: torch.Tensor) -> None:
        assert self.block_of_token is not None and self.block_counts is not None
        picked = idx.cpu().numpy().ravel()
        picked = picked[picked < self.block_of_token.size]
        self.block_counts[layer] += np.bincount(self.block_of_token[picked], minlength=self.block_counts.shape[1])

    def state(self, layer: int) -> LayerState:
        """The selector state at `layer` (restored from pushed metadata, or new, on first use)."""
        state = self.states.get(layer)
        if state is None:
            state = self.states[layer] = self.restore(layer) if self.restore else self.selector.new_state(layer)
        return state

    def account(self, layer: int, query: torch.Tensor, keys: torch.Tensor, idx: torch.Tensor, scaling: float) -> None:
        """Count one selective attention at `layer` (query (1, H, 1, d), the row's whole cache's keys (H_kv, n, d),
        what it attended to idx (H_kv, k')): selected share, sparse steps, profile blocks, and the attention mass
        kept when measured."""
        n = keys.shape[1]
        group = query.shape[1] // keys.shape[0]
        self.num_selected += idx.numel()
        self.num_candidates += n * idx.shape[0]
        if layer == DENSE_LAYERS:  # NOTE: one step decides dense or sparse for all its layers (same n, same budget)
            self.num_sparse_steps += 1
        if self.block_counts is not None:
            self._count(layer, idx)
        if self.measure_mass:
            q = query[0, :, 0]  # (H, d)
            scores = q[:, None, :] @ keys.to(q.dtype).repeat_interleave(group, 0).transpose(1, 2)
            probs = torch.softmax(scores[:, 0] * scaling, -1)
            kept = torch.gather(probs, 1, idx.repeat_interleave(group, dim=0)).sum(-1)  # (H,)
            self.mass_sum += float(kept.mean())
        self.num_selections += 1

    @property
    def attention_mass(self) -> float | None:
        return self.mass_sum / self.num_selections if self.measure_mass and self.num_selections else None

    @property
    def selected_share(self) -> float | None:
        return self.num_selected / self.num_candidates if self.num_candidates else None
