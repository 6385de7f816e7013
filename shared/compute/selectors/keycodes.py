"""`keycodes`: the attention top-k over 2-bit codes of the keys — the oracle's rule on keys of a tenth its bytes.

Each key (KV head, token) is quantized as one partition of head_dim values at KEY_BITS (quantization.py's rule:
asymmetric, x ≈ scale·q + min, fp16 scale and minimum). Those codes are the metadata: 16 + 4 = 20 bytes a token
per KV head at head_dim 64 (HATA's hash codes: 16; Quest's 8-bit page bounds: 8.5; the oracle's fp32 keys: 256). A
step scores every token as the oracle does — attention probability, summed over the query heads that share the
KV head — but over the codes' values, and keeps the top k. No offline preparation.

Why (docs/results/frontier-2026-12-07): at 8K, on five held-out tasks, HATA's 20% is further from dense than
4-bit quantization of every entry (KL 0.0241 against 0.0141 nats/token), while the oracle's 20% is at 0.0003 and
its 10% at 0.0014: the gap is the selector's ranking, not the budget. The oracle over 2-bit key codes keeps most
of that (10%: 0.0033 with K8V4 records on every path), so a tenth of the entries per step suffices and the union
a slow link carries by token 64 shrinks with it.

State per layer: the codes as they travel, and their values transposed (num_kv_heads, head_dim, n) float32 for
the step's matmul — host memory of a float32 K per selective layer (the price of scoring every token exactly;
InfiniGen's partial keys are the same shape at a fraction of the channels).
"""
from __future__ import annotations

import torch

from shared.compute.quantization import dequantize_partitions, quantize_partitions
from shared.compute.selectors.base import Geometry, LayerState, MetadataSpec, Rows, Selector, top_k, top_k_unsorted
from shared.compute.selectors.oracle import attention_mass

KEY_BITS = 2


class KeyCodesState(LayerState):
    def __init__(self) -> None:
        self.codes = Rows()  # (num_kv_heads, n, head_dim · KEY_BITS / 8) uint8
        self.scale_min = Rows()  # (num_kv_heads, n, 2) float16
        self.keys = Rows(dim=2)  # (num_kv_heads, head_dim, n) float32: the codes' values, a column a token


class KeyCodesSelector(Selector):
    name = "keycodes"

    # The selection's memory (BudgetFloor.stick) works on `token_scores`, the log of each token's attention mass: in
    # nats, a bonus of stick × a row's standard deviation keeps earlier picks where the scores are close. Over the
    # probabilities themselves a few large values set the deviation and the bonus froze the selection (8K, 10%: stick
    # 0.5 took the union of 64 steps from 37% to 12% and the KL from 0.0070 to 0.0309); over their log, stick 0.25
    # takes the union to 30% at the same KL (0.0071), 0.76× quantized-4bit's bytes (docs/results/long-default-2026-12-08).
    ranks_tokens = True

    def __init__(self, geometry: Geometry, key_bits: int = KEY_BITS) -> None:
        super().__init__(geometry)
        self.key_bits = key_bits  # the codes' width: 2 (1 bit: 8K, 10%, KL 0.047 against 2 bits' 0.0070)

    def metadata_bytes_per_token(self) -> float:
        g = self.geometry
        return g.num_kv_heads * (g.head_dim * self.key_bits // 8 + 4)

    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        g = self.geometry
        return [((g.num_kv_heads, num_tokens, g.head_dim * self.key_bits // 8), torch.uint8),
                ((g.num_kv_heads, num_tokens, 2), torch.float16)]

    def new_state(self, layer: int) -> KeyCodesState:
        return KeyCodesState()

    def extend(self, layer: int, state: KeyCodesState, keys: torch.Tensor) -> None:
        fresh = keys[:, state.num_tokens:]
        if fresh.shape[1]:
            self._append(state, *quantize_partitions(fresh.float(), self.key_bits))
        state.num_tokens = keys.shape[1]

    def _append(self, state: KeyCodesState, codes: torch.Tensor, scale_min: torch.Tensor) -> None:
        state.codes.append(codes)
        state.scale_min.append(scale_min)
        state.keys.append(dequantize_partitions(codes, scale_min, self.key_bits).transpose(1, 2))

    def export(self, state: KeyCodesState) -> list[torch.Tensor]:
        return [state.codes.data, state.scale_min.data]

    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> KeyCodesState:
        state = KeyCodesState()
        self._append(state, tensors[0], tensors[1])  # Rows copy: the caller's buffer may be reused
        state.num_tokens = num_tokens
        return state

    def _scores(self, state: KeyCodesState, query: torch.Tensor) -> torch.Tensor:
        return attention_mass(self.geometry, query, state.keys.data)  # the oracle's rule over the codes' keys

    def token_scores(self, layer: int, state: KeyCodesState, query: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        return self._scores(state, query).clamp_min_(1e-30).log_(), k  # log mass: the order `select` keeps

    def select(self, layer: int, state: KeyCodesState, query: torch.Tensor, k: int) -> torch.Tensor:
        return top_k(self._scores(state, query), k)

    def mark(self, layer: int, state: KeyCodesState, query: torch.Tensor, k: int, mask: torch.Tensor) -> None:
        mask.scatter_(1, top_k_unsorted(self._scores(state, query), k), True)
