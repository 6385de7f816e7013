"""`hata`: hash-based top-k (HATA, Gong et al. 2025).

Keys and queries of a KV head are hashed to `num_bits` binary codes with that head's projection W
(code = sign(W·x)); a token's score is minus its Hamming distance to the query's code, summed over the
query heads of the group; a fixed budget of the best tokens is kept. W is learned offline by
`smartgen prepare-selectors --selector hata` (hash weights next to the model); without it, random
Gaussian projections (SimHash, fixed seed) are the untrained fallback.
Metadata: the packed codes, num_bits / 8 bytes per KV head per token.

Scoring (CPU, whole 64-bit words): the group's Hamming distances in as few popcounts as the group size has
bits. With w_b = Σ_g q_g,b ∈ 0…G the query heads' votes for bit b, Σ_g popcount(q_g ^ c) = Σ_b (c_b ? G − w_b : w_b);
when G = 2^m − 1 (SmolLM2: 3), G − w = w ^ G, so that is Σ_b (w_b ^ G·c_b) = Σ_i 2^i popcount(W_i ^ c) over the bit
planes W_i of w: 2 popcounts instead of 3. The popcounts are numpy's (`bitwise_count`, a hardware popcount) over the
codes kept word-major next to the metadata (kv, words, n), so each pass is one long loop: ~10× the SWAR popcount in
torch ops (`hamming_sum`, still the path off CPU). Same integers as the byte table of the reference, so the same top-k.
"""
from __future__ import annotations

import numpy as np
import torch

from shared.compute.selectors.base import Geometry, LayerState, MetadataSpec, Rows, Selector, top_k, top_k_unsorted

NUM_BITS = 128
_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.uint8)  # set bits of each byte value


def pack_codes(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x (h, n, d), weights (h, bits, d) → packed sign codes (h, n, bits / 8) uint8."""
    bits = (torch.einsum("hnd,hbd->hnb", x.float(), weights.to(x.device)) > 0).to(torch.uint8)
    return (bits.view(*bits.shape[:-1], -1, 8) * _BIT_WEIGHTS.to(x.device)).sum(-1).to(torch.uint8)


class HataState(LayerState):
    def __init__(self) -> None:
        self.codes = Rows()  # (num_kv_heads, n, num_bits / 8) uint8
        self.words = Rows()  # (num_kv_heads · words, n) int64: the same codes word-major, built as select needs them


class HataSelector(Selector):
    name = "hata"
    ranks_tokens = True

    def __init__(self, geometry: Geometry, weights: dict[int, torch.Tensor] | None = None, num_bits: int = NUM_BITS):
        super().__init__(geometry)
        self.num_bits = num_bits
        self.is_trained = weights is not None
        if weights is None:  # the untrained fallback: SimHash with a fixed seed (deterministic)
            gen = torch.Generator().manual_seed(0)
            weights = {layer: torch.randn(geometry.num_kv_heads, num_bits, geometry.head_dim, generator=gen)
                       for layer in range(geometry.num_layers)}
        self.weights = weights  # layer → (num_kv_heads, num_bits, head_dim)
        self._per_query_head: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._key_weights: dict[int, torch.Tensor] = {}  # layer → (num_kv_heads, d, bits), CPU

    def metadata_bytes_per_token(self) -> float:
        return self.geometry.num_kv_heads * self.num_bits / 8

    def metadata_specs(self, num_tokens: int) -> MetadataSpec:
        return [((self.geometry.num_kv_heads, num_tokens, self.num_bits // 8), torch.uint8)]

    def new_state(self, layer: int) -> HataState:
        return HataState()

    def extend(self, layer: int, state: HataState, keys: torch.Tensor) -> None:
        fresh = keys[:, state.num_tokens:]
        if fresh.device.type == "cpu":  # pack_codes's codes: its einsum is this bmm, numpy packs the bits as it does
            w = self._key_weights.get(layer)
            if w is None:
                w = self._key_weights[layer] = self.weights[layer].transpose(1, 2)
            bits = (torch.bmm(fresh.float(), w) > 0).numpy()
            state.codes.append(torch.from_numpy(np.packbits(bits, axis=-1)))
        else:
            state.codes.append(pack_codes(fresh, self.weights[layer]))
        state.num_tokens = keys.shape[1]

    def export(self, state: HataState) -> list[torch.Tensor]:
        return [state.codes.data]

    def restore(self, layer: int, tensors: list[torch.Tensor], num_tokens: int) -> HataState:
        state = HataState()
        state.codes.append(tensors[0])
        state.num_tokens = num_tokens
        return state

    def _query_weights(self, layer: int, device: torch.device) -> torch.Tensor:
        """(num_heads, d, bits): the layer's projections, one per query head, transposed for bmm (built once per layer
        and device): torch.bmm(x, w) is the product pack_codes's einsum computes (it calls the same bmm)."""
        key = (layer, device)
        w = self._per_query_head.get(key)
        if w is None:
            w = self.weights[layer].to(device).repeat_interleave(self.geometry.group, dim=0)
            w = self._per_query_head[key] = w.transpose(1, 2)
        return w

    def _scores(self, layer: int, state: HataState, query: torch.Tensor) -> torch.Tensor:
        """(num_kv_heads, n) float: minus each token's Hamming distance to the query codes, summed over the group."""
        g = self.geometry
        codes = state.codes.data  # (kv, n, bytes)
        bits = torch.bmm(query[:, None, :].float(), self._query_weights(layer, query.device)) > 0  # (H, 1, bits)
        if codes.shape[-1] % 8 == 0 and codes.device.type == "cpu" and _HAS_POPCOUNT:
            planes, shifts = _planes(bits.view(g.num_kv_heads, g.group, -1).numpy())
            return -torch.from_numpy(hamming_planes(_words(state, g.num_kv_heads), planes, shifts)).float()
        q_codes = _pack(bits)  # (H, 1, bytes)
        if codes.shape[-1] % 8:  # NOTE: the int64 popcount below needs whole words (128 bits: 2)
            diff = q_codes.view(g.num_kv_heads, g.group, 1, -1) ^ codes[:, None]
            hamming = torch.take(_POPCOUNT.to(diff.device), diff.long()).sum((1, 3), dtype=torch.int32)
        else:
            hamming = hamming_sum(q_codes.view(torch.int64).view(g.num_kv_heads, g.group, -1),
                                  codes.view(torch.int64))
        return -hamming.float()

    def select(self, layer: int, state: HataState, query: torch.Tensor, k: int) -> torch.Tensor:
        return top_k(self._scores(layer, state, query), k)

    def token_scores(self, layer: int, state: HataState, query: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        return self._scores(layer, state, query), k

    def mark(self, layer: int, state: HataState, query: torch.Tensor, k: int, mask: torch.Tensor) -> None:
        mask.scatter_(1, top_k_unsorted(self._scores(layer, state, query), k), True)


_HAS_POPCOUNT = hasattr(np, "bitwise_count")  # numpy ≥ 2.0


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """(…, bits) bool or 0/1 → (…, bits / 8) uint8, packed as pack_codes packs."""
    return (bits.to(torch.uint8).view(*bits.shape[:-1], -1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(-1).to(torch.uint8)


def _planes(bits: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """bits (kv, G, num_bits) bool, the group's query codes → (planes (kv, P, words) uint64, shifts): Σ_g popcount(
    q_g ^ c) = Σ_p popcount(planes[p] ^ c) << shifts[p]. G = 2^m − 1: the m bit planes of the votes (module
    docstring); otherwise the G codes themselves. Packed as pack_codes packs (numpy's packbits: first bit highest)."""
    group = bits.shape[1]
    if group & (group + 1) == 0:  # 1, 3, 7, …
        votes = bits.sum(1, dtype=np.uint8)  # (kv, num_bits), 0…G
        m = group.bit_length()
        bits = (votes[:, None, :] >> np.arange(m, dtype=np.uint8)[:, None]) & 1  # (kv, m, num_bits)
        shifts = list(range(m))
    else:
        shifts = [0] * group
    return np.packbits(bits, axis=-1).view(np.uint64), shifts


def _words(state: HataState, kv: int) -> np.ndarray:
    """state's codes word-major, (kv, words, n) uint64 (a numpy view), brought up to date with `state.codes`."""
    codes = state.codes.data  # (kv, n, bytes)
    have, n = state.words.num_rows, codes.shape[1]
    if have < n:
        fresh = codes[:, have:].contiguous().view(torch.int64)  # (kv, m, words)
        state.words.append(fresh.transpose(1, 2).reshape(-1, n - have))
    return state.words.data[:, :n].view(kv, -1, n).numpy().view(np.uint64)


def hamming_planes(words: np.ndarray, planes: np.ndarray, shifts: list[int]) -> np.ndarray:
    """words (kv, W, n) uint64, planes (kv, P, W) uint64 → (kv, n) int16: Σ_p Σ_words popcount(planes[p] ^ code)
    << shifts[p] (see _planes): one XOR and one popcount over every plane at once, then the words and planes added."""
    counts = np.bitwise_count(np.bitwise_xor(words[:, None], planes[..., None]))  # (kv, P, W, n) uint8, ≤ 64
    if counts.shape[2] <= 3:  # ≤ 192: the words added in uint8, one contiguous add per word
        per_plane = counts[:, :, 0]
        for w in range(1, counts.shape[2]):
            per_plane = per_plane + counts[:, :, w]
    else:
        per_plane = counts.sum(axis=2, dtype=np.int16)
    total = per_plane[:, 0].astype(np.int16)
    for p in range(1, len(shifts)):
        total += per_plane[:, p].astype(np.int16) << shifts[p]
    return total


_M1, _M2, _M4, _H01 = 0x5555555555555555, 0x3333333333333333, 0x0F0F0F0F0F0F0F0F, 0x0101010101010101


def hamming_sum(queries: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """queries (kv, G, words) int64, codes (kv, n, words) int64 → (kv, n) int32: Σ over the group and the words of
    popcount(query ^ code), the same integers as the byte-table lookup (reference.py), ~6× faster: SWAR popcount
    on whole int64 words (torch has no popcount op), the group summed in 4-bit lanes (≤ 3 heads × 4 bits < 16,
    so no lane overflows) before the bytes are added up by one multiply."""
    total = None
    for start in range(0, queries.shape[1], 3):
        acc = None
        for h in range(start, min(start + 3, queries.shape[1])):
            x = codes ^ queries[:, h, None]  # (kv, n, words), a fresh tensor: updated in place below
            x.sub_((x >> 1) & _M1)  # 2-bit lanes: count of their 2 bits (arithmetic >> is masked off by _M1)
            x = (x & _M2).add_((x >> 2) & _M2)  # 4-bit lanes: ≤ 4
            acc = x if acc is None else acc.add_(x)  # ≤ 12 per lane
        x = (acc & _M4).add_((acc >> 4) & _M4)  # bytes: ≤ 24
        x = x.mul_(_H01).bitwise_right_shift_(56).bitwise_and_(255)  # the word's byte sum (≤ 192), in its low byte
        total = x if total is None else total.add_(x)
    return total.sum(-1, dtype=torch.int32)
