"""`infinigen`: skewed partial-channel speculation (InfiniGen, Lee et al. OSDI 2024).

Offline (`smartgen prepare-selectors --selector infinigen`), per layer and KV head: an orthogonal skewing
matrix A from the SVD of calibration queries of the head's group (so q·k = (qA)·(kA) while most of qA's
magnitude sits in few columns), and the `ratio`·head_dim columns where it sits.
Online: the metadata is the skewed keys' partial columns, rounded to the KV store's dtype (Geometry.kv_dtype: bf16
as served, half fp32's bytes on the wire, as the paper keeps its partial weights and keys in fp16), on every node
alike, so a selection is the same wherever it runs; a step's approximate logits are
(q̃A)[cols] · (kA)[cols] / √d, where q̃ is *speculated* for layer i from layer i-1's input (the engine
passes it, see selective.py); tokens within `alpha` of the best logit are kept, at most the budget.
"""
from __future__ import annotations

import math

import torch

from shared.compute.selectors.base import Geometry, LayerState, MetadataSpec, Rows, Selector, top_k, top_k_unsorted

RATIO = 0.25  # share of the head's channels kept as partial keys
ALPHA = 4.0  # logits more than ALPHA below the best one are not worth fetching (e^-4 ≈ 1.8% of its weight)


def _power_of_two(x: float) -> bool:
    """x a power of two: scaling by it only moves exponents, so (q / x)·k and (q·k) / x are the same float (in the
    normal range: partial queries and keys are nowhere near 1e-38)."""
    m, _ = math.frexp(x)
    return m == 0.5


class InfiniGenState(LayerState):
    def __init__(self) -> None:
        # (num_kv_heads, c, n) float32 holding values of the KV's dtype: skewed keys' partial channels, a column a
        # token (metadata on the wire is (num_kv_heads, n, c) in the KV's dtype: `export` and `restore` transpose)
        self.partial_keys = Rows(dim=2)


class InfiniGenSelector(Selector):
    name = "infinigen"
    ranks_tokens = True
    speculates = True  # asks the engine for layer i's query speculated from layer i-1's input

    def __init__(self, geometry: Geometry, skew: dict[int, torch.Tensor], channels: dict[int, torch.Tensor],
                 alpha: float = ALPHA):
        super().__init__(geometry)
        self.skew, self.channels, self.alpha = skew, channels, alpha  # layer → (h, d, d), (h, c)
        self._cache: dict[tuple, torch.Tensor] = {}

    @property
    def num_channels(self) -> int:
        return next(iter(self.channels.values())).shape[1]

    def metadata_bytes_per_token(self) -> float:
        return self.geometry.num_kv_heads * self.num_channels * self.geometry.kv_dtype.itemsize

    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        return [((self.geometry.num_kv_heads, num_tokens, self.num_channels), self.geometry.kv_dtype)]

    def new_state(self, layer: int) -> InfiniGenState:
        return InfiniGenState()

    def _partial(self, layer: int, x: torch.Tensor, per_query_head: bool) -> torch.Tensor:
        """x (h, n, d) → skewed partial channels (h, n, c); h = KV heads, or query heads if per_query_head."""
        return torch.bmm(x.float(), self._projection(layer, x.device, per_query_head))

    def _projection(self, layer: int, device: torch.device, per_query_head: bool) -> torch.Tensor:
        """The layer's skew restricted to its kept channels, (h, d, c) on `device`, per query head if asked (built
        once). NOTE: x @ skew[:, :, cols] gives the same floats as gathering cols from x @ skew (checked for every
        shape a step and a prefill use here), at a quarter of the multiplications and without the gather:
        3 µs against 42 for a step's query."""
        key = (layer, device, per_query_head)
        got = self._cache.get(key)
        if got is None:
            skew, cols = self.skew[layer].to(device), self.channels[layer].to(device)
            if per_query_head:
                skew, cols = (t.repeat_interleave(self.geometry.group, dim=0) for t in (skew, cols))
            got = self._cache[key] = torch.gather(skew, 2, cols[:, None, :].expand(-1, skew.shape[1], -1)).contiguous()
        return got

    def extend(self, layer: int, state: InfiniGenState, keys: torch.Tensor) -> None:
        partial = self._partial(layer, keys[:, state.num_tokens:], per_query_head=False)
        if self.geometry.kv_dtype != torch.float32:  # what travels, and what every node selects by
            partial = partial.to(self.geometry.kv_dtype).float()
        state.partial_keys.append(partial.transpose(1, 2))
        state.num_tokens = keys.shape[1]

    def export(self, state: InfiniGenState) -> list[torch.Tensor]:
        return [state.partial_keys.data.transpose(1, 2).to(self.geometry.kv_dtype).contiguous()]  # exact: see extend

    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> InfiniGenState:
        state = InfiniGenState()
        state.partial_keys.append(tensors[0].transpose(1, 2).float())
        state.num_tokens = num_tokens
        return state

    def _scores(self, layer: int, state: InfiniGenState, query: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        """(num_kv_heads, n) approximate logits relative to the best (best over the group), and how many to keep."""
        g = self.geometry
        q = self._partial(layer, query[:, None, :], per_query_head=True).view(g.num_kv_heads, g.group, -1)
        scale = g.head_dim ** 0.5
        if _power_of_two(scale):  # dividing q instead of the logits is the same floats (d = 64: / 8) and n× fewer ops
            logits = (q / scale) @ state.partial_keys.data  # (kv, G, n)
        else:
            logits = q @ state.partial_keys.data / scale
        rel = logits.sub_(logits.amax(dim=-1, keepdim=True)).amax(1)  # (kv, n): best over the group
        count = int((rel >= -self.alpha).sum(-1).max())  # the α rule, widest head decides the row length
        return rel, max(1, min(k, count))

    def select(self, layer: int, state: InfiniGenState, query: torch.Tensor, k: int) -> torch.Tensor:
        return top_k(*self._scores(layer, state, query, k))

    def token_scores(self, layer: int, state: InfiniGenState, query: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        return self._scores(layer, state, query, k)

    def mark(self, layer: int, state: InfiniGenState, query: torch.Tensor, k: int, mask: torch.Tensor) -> None:
        mask.scatter_(1, top_k_unsorted(*self._scores(layer, state, query, k)), True)
