"""Low-bit KV for the `quantized` transfer mode, in the spirit of HACK (2-, 4- or 8-bit codes, asymmetric per
partition: x ≈ scale·q + min, partitions of Π = 64 values).

Per layer and KV head, as HACK partitions them:
  K  per token: one partition over the head_dim channels of each (token, head)   — QKᵀ runs along d
  V  per channel: partitions of Π tokens along the sequence for each (channel, head) — PV runs along tokens
  the first `sinks` tokens (attention sinks) stay in fp16, unquantized
Scales and minimums are fp16. The prefill node quantizes each layer as it is computed and pushes only these
bytes; the decode node dequantizes them into its fp32/bf16 slab on arrival and decodes densely.
"""
from __future__ import annotations

import math

import torch

from shared.compute.packed import PackedTensors

PARTITION = 64  # Π, values per quantization partition
SINK_TOKENS = 4  # HACK's default: the first tokens keep 16 bits
BITS = (2, 4, 8)


class QuantLayout:
    """The bytes of one request's quantized KV: one packed block per layer, in the aux area."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int, bits: int,
                 sinks: int = SINK_TOKENS, partition: int = PARTITION):
        if bits not in BITS:
            raise ValueError(f"kv_bits must be one of {BITS}, not {bits}")
        if head_dim * bits % 8:
            raise ValueError(f"head_dim {head_dim} × {bits} bits is not a whole number of bytes")
        self.num_layers, self.num_tokens, self.bits, self.partition = num_layers, num_tokens, bits, partition
        self.num_sinks = min(sinks, num_tokens)
        self.num_rest = num_tokens - self.num_sinks
        self.num_v_parts = math.ceil(self.num_rest / partition)
        h, d, per_byte = num_kv_heads, head_dim, 8 // bits
        self.block = PackedTensors([
            ((2, h, self.num_sinks, d), torch.float16),                                    # sink K, V
            ((h, self.num_rest, d // per_byte), torch.uint8),                              # K codes
            ((h, self.num_rest, 2), torch.float16),                                        # K scale, min
            ((h, d, self.num_v_parts, partition // per_byte), torch.uint8),                # V codes
            ((h, d, self.num_v_parts, 2), torch.float16),                                  # V scale, min
        ])
        self.layer_bytes = self.block.nbytes
        self.nbytes = self.layer_bytes * num_layers

    def layer_range(self, layer: int) -> tuple[int, int]:
        return layer * self.layer_bytes, self.layer_bytes

    def _buf(self, aux: torch.Tensor, layer: int) -> torch.Tensor:
        at, n = self.layer_range(layer)
        return aux[at: at + n]

    def quantize(self, aux: torch.Tensor, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys/values (num_kv_heads, num_tokens, head_dim) → `layer`'s block of aux (uint8)."""
        s = self.num_sinks
        sinks, k_codes, k_sm, v_codes, v_sm = self.block.views(self._buf(aux, layer))
        sinks[0].copy_(keys[:, :s])
        sinks[1].copy_(values[:, :s])
        if not self.num_rest:
            return
        codes, sm = quantize_partitions(keys[:, s:].float(), self.bits)  # partitions along d
        k_codes.copy_(codes)
        k_sm.copy_(sm)
        v = values[:, s:].float().transpose(1, 2)  # (h, d, rest)
        pad = self.num_v_parts * self.partition - self.num_rest
        if pad:  # pad with the last token (min and max unchanged); dequantize drops it
            v = torch.cat([v, v[..., -1:].expand(-1, -1, pad)], dim=-1)
        codes, sm = quantize_partitions(v.reshape(*v.shape[:2], self.num_v_parts, self.partition), self.bits)
        v_codes.copy_(codes)
        v_sm.copy_(sm)

    def dequantize(self, aux: torch.Tensor, layer: int, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """`layer`'s block → keys_out/values_out (num_kv_heads, num_tokens, head_dim), written in place."""
        s = self.num_sinks
        sinks, k_codes, k_sm, v_codes, v_sm = self.block.views(self._buf(aux, layer))
        keys_out[:, :s] = sinks[0]
        values_out[:, :s] = sinks[1]
        if not self.num_rest:
            return
        keys_out[:, s:] = dequantize_partitions(k_codes, k_sm, self.bits)
        v = dequantize_partitions(v_codes, v_sm, self.bits).flatten(2)[..., : self.num_rest]  # (h, d, rest)
        values_out[:, s:] = v.transpose(1, 2)


def quantize_partitions(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (…, m) → packed codes (…, m·bits/8) uint8 and (scale, min) (…, 2) fp16, one partition per row."""
    levels = 2 ** bits - 1
    lo = x.amin(dim=-1, keepdim=True).half().float()
    hi = x.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(1e-8).half().float()  # NOTE: quantize with the fp16 values we send
    q = ((x - lo) / scale).round_().clamp_(0, levels).to(torch.uint8)
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.uint8, device=x.device) * bits
    packed = (q.view(*q.shape[:-1], -1, per_byte) << shifts).sum(-1, dtype=torch.uint8)
    return packed, torch.cat([scale, lo], dim=-1).half()


def dequantize_partitions(codes: torch.Tensor, scale_min: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of quantize_partitions: (…, m·bits/8) uint8 and (…, 2) fp16 → (…, m) float32. One fp32 product,
    then the sum, in place: 8-bit codes need no unpacking, 4-bit ones two strided writes."""
    if bits == 8:
        q = codes.float()
    elif bits == 4:  # value 2j in the low nibble of byte j, 2j + 1 in the high one
        q = torch.empty(*codes.shape[:-1], codes.shape[-1] * 2, dtype=torch.float32, device=codes.device)
        q[..., 0::2] = codes & 0x0F
        q[..., 1::2] = codes >> 4
    else:
        shifts = torch.arange(8 // bits, dtype=torch.uint8, device=codes.device) * bits
        q = ((codes[..., None] >> shifts) & (2 ** bits - 1)).flatten(-2).float()
    scale_min = scale_min.float()
    return q.mul_(scale_min[..., 0:1]).add_(scale_min[..., 1:2])


def bound_codes(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bounds lo ≤ hi (…, m) → 8-bit codes rounded outward: (lo codes, hi codes) (…, m) uint8 and (…, 4) fp16 (lo's
    scale and minimum, hi's). `bound_values` of them is ≤ lo and ≥ hi, each within about one step (1/255 of its
    vector's range) of it: Quest's page bounds stay bounds, a page's score can only rise. The fp16 minimum is rounded
    down and the scale up (with 0.1% to spare), so code 255 reaches the vector's maximum; a code whose value the
    fp32 arithmetic still leaves on the wrong side moves one step outward."""
    codes, scale_min = [], []
    for x, outward in ((lo.float(), torch.floor), (hi.float(), torch.ceil)):
        m = _fp16_toward(x.amin(dim=-1, keepdim=True), -1)
        scale = _fp16_toward(((x.amax(dim=-1, keepdim=True) - m) * (1.001 / 255)).clamp_min(1e-6), 1)
        codes.append(outward((x - m) / scale).clamp_(0, 255).to(torch.uint8))
        scale_min.append(torch.cat([scale, m], dim=-1).half())
    lo_codes, hi_codes, scale_min = codes[0], codes[1], torch.cat(scale_min, dim=-1)
    lo_values, hi_values = bound_values(lo_codes, hi_codes, scale_min)
    lo_codes -= ((lo_values > lo) & (lo_codes > 0)).to(torch.uint8)
    hi_codes += ((hi_values < hi) & (hi_codes < 255)).to(torch.uint8)
    return lo_codes, hi_codes, scale_min


def bound_values(lo_codes: torch.Tensor, hi_codes: torch.Tensor, scale_min: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of bound_codes: (lo, hi) (…, m) float32, each one fp32 step further outward (against the rounding
    of the product and the sum)."""
    lo = dequantize_partitions(lo_codes, scale_min[..., 0:2], 8)
    hi = dequantize_partitions(hi_codes, scale_min[..., 2:4], 8)
    return torch.nextafter(lo, torch.full_like(lo, -math.inf)), torch.nextafter(hi, torch.full_like(hi, math.inf))


def _fp16_toward(x: torch.Tensor, direction: int) -> torch.Tensor:
    """x float32 → float32 holding an fp16 value, the nearest one at or below x (direction −1) or above (+1)."""
    h = x.half()
    off = (h.float() > x) if direction < 0 else (h.float() < x)
    h = torch.where(off, torch.nextafter(h, torch.full_like(h, direction * math.inf)), h)
    return h.float()
