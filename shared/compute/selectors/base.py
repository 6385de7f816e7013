"""The selector interface: which cached tokens a decode step attends to, per layer and KV head.

A selector keeps per-layer *metadata* for every cached token (what the prefill node can push ahead of the
KV itself: partial keys, hash codes, page bounds, or nothing) and, each step, turns the current query into
token indices per KV head under a budget. Layers 0–1 are always dense (the engine never asks).

Metadata crosses the network: the prefill node builds a layer's state from the prompt's keys (`extend`),
`export`s it as tensors of the shapes `metadata_specs` declares, and the decode node `restore`s the same
state from those bytes before decoding, so both ends select exactly as if the keys were local.

Shapes: keys (num_kv_heads, num_tokens, head_dim); query (num_heads, head_dim) for one decode position;
indices (num_kv_heads, k) int64, each row sorted. Query heads h·G … h·G+G-1 share KV head h (G = group size).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from schemas import DEFAULT_FLOOR, DENSE_LAYERS, BudgetFloor, kv_budget_problem  # noqa: F401  (DENSE_LAYERS: re-exported)

# (shape, dtype) of each tensor a layer's metadata exports, in order
MetadataSpec = list[tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True, slots=True)
class Budget:
    """A fraction of the cached tokens (0 < value ≤ 1) or a token count (value > 1, whole): the one rule of
    schemas/constants.py (`kv_budget_problem`), under its floor (dense below a context length, a minimum, and
    the sinks and recent window always kept)."""

    value: float
    floor: BudgetFloor = DEFAULT_FLOOR

    def __post_init__(self) -> None:
        if problem := kv_budget_problem(self.value):
            raise ValueError(problem)

    def tokens(self, num_tokens: int) -> int:
        return self.floor.tokens(self.value, num_tokens)


@dataclass(frozen=True, slots=True)
class Geometry:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int = 16
    kv_dtype: torch.dtype = torch.float32  # how the KV store keeps keys: metadata exact in it may travel in it

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


class Rows:
    """A tensor that grows along dim `dim` (1: (heads, n, …), a row a token; 2: (heads, m, n), a column a token, for
    metadata a step multiplies by, so the product is a plain matmul instead of one over a transposed view).
    Capacity doubles, so appending one decoded token's metadata per step costs O(1) amortized instead of a copy of
    everything held."""

    def __init__(self, dim: int = 1) -> None:
        self._buf: torch.Tensor | None = None
        self.dim = dim
        self.num_rows = 0

    @property
    def data(self) -> torch.Tensor:
        """A view of the rows held so far (empty tensor before the first append)."""
        assert self._buf is not None, "no rows yet"
        return self._buf.narrow(self.dim, 0, self.num_rows)

    def last(self) -> torch.Tensor:
        """A view of the last row held (one op: a decode step updates it in place)."""
        assert self._buf is not None, "no rows yet"
        return self._buf.select(self.dim, self.num_rows - 1)

    def append(self, rows: torch.Tensor) -> None:
        n, m = self.num_rows, rows.shape[self.dim]
        held = self._buf.shape[self.dim] if self._buf is not None else 0
        if self._buf is None or n + m > held:
            shape = list(rows.shape)
            shape[self.dim] = max(n + m, 2 * held, 16)
            grown = rows.new_empty(shape)
            if self._buf is not None:
                grown.narrow(self.dim, 0, n).copy_(self._buf.narrow(self.dim, 0, n))
            self._buf = grown
        self._buf.narrow(self.dim, n, m).copy_(rows)
        self.num_rows = n + m


class LayerState:
    """A selector's metadata for one layer of one request; grows as tokens are cached."""

    num_tokens: int = 0
    # the selection's memory (schemas BudgetFloor.stick, shared/compute/floor.py): (num_kv_heads, N + 1) float32,
    # 1.0 at the first N cached tokens an earlier step selected at this layer (column N gathers later tokens: unused)
    picked: torch.Tensor | None = None


class Selector(abc.ABC):
    name: str = ""
    ranks_tokens: bool = False  # `token_scores` scores every token (the selection's memory and read-behind use it)

    def __init__(self, geometry: Geometry):
        self.geometry = geometry

    @abc.abstractmethod
    def metadata_bytes_per_token(self) -> float:
        """Bytes of metadata this selector keeps (and the prefill node pushes) per cached token, per layer."""

    @abc.abstractmethod
    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        """The tensors `export` returns for a layer holding `num_tokens` tokens."""

    @abc.abstractmethod
    def new_state(self, layer: int) -> LayerState:
        """Empty metadata for one layer of a new request."""

    @abc.abstractmethod
    def extend(self, layer: int, state: LayerState, keys: torch.Tensor) -> None:
        """Add metadata for keys[:, state.num_tokens:] (all keys cached so far are passed; only the new ones
        are read) and advance."""

    @abc.abstractmethod
    def export(self, state: LayerState) -> list[torch.Tensor]:
        """The layer's metadata as tensors matching `metadata_specs(state.num_tokens)` (views where possible)."""

    @abc.abstractmethod
    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> LayerState:
        """The state `export` came from, rebuilt from its tensors (copied: the caller's buffer may be reused)."""

    @abc.abstractmethod
    def select(self, layer: int, state: LayerState, query: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (num_kv_heads, ≤ k) of the tokens to attend to for this query; rows sorted ascending."""

    def token_scores(self, layer: int, state: LayerState, query: torch.Tensor, k: int) -> tuple[torch.Tensor, int] | None:
        """For selectors that rank single tokens: (scores (num_kv_heads, n) float, a fresh tensor the caller may
        change; k' ≤ k) such that the top k' scores of each row are `mark`'s picks. None for the others (they have
        no selection memory, BudgetFloor.stick)."""
        return None

    def mark(self, layer: int, state: LayerState, query: torch.Tensor, k: int, mask: torch.Tensor) -> None:
        """Set `mask` (num_kv_heads, ≥ n) bool at the tokens `select` picks, the same set (the decode step's floor
        works on a mask: selectors override this to skip what a mask does not need, e.g. sorting the indices)."""
        mask.scatter_(1, self.select(layer, state, query, k), True)

    def mark_rows(self, layer: int, states: list[LayerState], queries: torch.Tensor, picks: list[int],
                  masks: torch.Tensor) -> None:
        """`mark` for several rows of one decode step (several requests at one layer): row r's query queries[r]
        (H, d), its budget picks[r], its mask masks[r] (num_kv_heads, ≥ its n) bool. Row by row here; a selector
        overrides it to do the rows' work in fewer, larger ops (the same marks)."""
        for r, state in enumerate(states):
            self.mark(layer, state, queries[r], picks[r], masks[r])


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(num_kv_heads, n) scores → (num_kv_heads, k) indices, sorted ascending. Ties broken by position
    (stable), so selection is deterministic."""
    return torch.sort(top_k_unsorted(scores, k), dim=-1).values


def top_k_unsorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`top_k`'s indices, the same set per row, unsorted (enough to mark a mask)."""
    return torch.topk(scores, min(k, scores.shape[-1]), dim=-1, sorted=False).indices


def row_std(scores: torch.Tensor) -> torch.Tensor:
    """(H, n) → (H, 1): each row's sample standard deviation, by two passes (mean, then squared deviations).
    NOTE: `Tensor.std` computes the same statistic by Welford's recurrence, which torch does not vectorise on CPU:
    163 µs against 23 for a (3, 8192) row set here, once per selective layer per step (the selection's memory)."""
    deviations = scores - scores.mean(dim=1, keepdim=True)
    return deviations.square_().sum(dim=1, keepdim=True).div_(max(1, scores.shape[1] - 1)).sqrt_()
