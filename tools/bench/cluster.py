"""An analytical model of the paper's GPU cluster (docs/architecture.md, "Metrics": link emulation): what a prefill, a decode step
and a KV transfer cost for a real model on an L20, so that a pressure R measured here can be stated as the
bandwidth that gives the same R there, and so that `smartgen simulate` can project our measurements.

Assumptions (stated in every report that uses them):
  - L20: 119.5 TFLOPS dense fp16/bf16 tensor throughput, 864 GB/s HBM, 48 GB; prefill runs at MFU 0.5,
    decode streams weights and KV at 70% of HBM bandwidth.
  - Prefill FLOPs = 2·params·n + 2·layers·hidden·n² (causal attention: QKᵀ and PV over n²/2 pairs each).
    A prefix-cache hit of h skips h of the n tokens' linear FLOPs and their attention rows.
  - KV is bf16; a full transfer moves every token's K and V once over one link of `gbps`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:  # bf16 K and V, all layers
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


@dataclass(frozen=True)
class Gpu:
    name: str
    tflops: float  # dense bf16 tensor throughput, 10¹² FLOP/s
    hbm_gbytes_per_s: float
    mfu: float = 0.5
    hbm_efficiency: float = 0.7


LLAMA_31_8B = ModelShape("Llama-3.1-8B", 8.03e9, 32, 4096, 8, 128)
QWEN3_14B = ModelShape("Qwen3-14B", 14.8e9, 40, 5120, 8, 128)
MODELS = {m.name: m for m in (LLAMA_31_8B, QWEN3_14B)}
L20 = Gpu("L20", 119.5, 864.0)


def prefill_seconds(model: ModelShape, num_tokens: int, gpu: Gpu = L20, prefix_hit: float = 0.0) -> float:
    """One request's prefill on one GPU; `prefix_hit` of the prompt comes from a prefix cache."""
    computed = num_tokens * (1 - prefix_hit)
    # each computed token attends to every earlier token: Σ over computed positions ≈ computed·(n − computed/2)
    attention_pairs = computed * (num_tokens - computed / 2)
    flops = 2 * model.params * computed + 4 * model.layers * model.hidden * attention_pairs
    return flops / (gpu.tflops * 1e12 * gpu.mfu)


def decode_step_seconds(model: ModelShape, context: int, batch: int = 1, gpu: Gpu = L20, kv_share: float = 1.0) -> float:
    """One decode step of `batch` requests of `context` tokens, reading `kv_share` of each one's KV."""
    bytes_read = 2 * model.params + batch * context * model.kv_bytes_per_token * kv_share
    return bytes_read / (gpu.hbm_gbytes_per_s * 1e9 * gpu.hbm_efficiency)


def transfer_seconds(num_bytes: float, gbps: float) -> float:
    return num_bytes * 8 / (gbps * 1e9)


def pressure(model: ModelShape, num_tokens: int, gbps: float, gpu: Gpu = L20, prefix_hit: float = 0.0) -> float:
    """R = T_full_transfer / T_prefill for one request."""
    return transfer_seconds(num_tokens * model.kv_bytes_per_token, gbps) / prefill_seconds(model, num_tokens, gpu, prefix_hit)


def equivalent_gbps(r: float, model: ModelShape, num_tokens: int, gpu: Gpu = L20, prefix_hit: float = 0.0) -> float:
    """The link rate at which that model's request of num_tokens sees pressure R on that GPU."""
    return num_tokens * model.kv_bytes_per_token * 8 / (r * prefill_seconds(model, num_tokens, gpu, prefix_hit)) / 1e9


ASSUMPTIONS = (f"{L20.name}: {L20.tflops} TFLOPS bf16 at MFU {L20.mfu}, {L20.hbm_gbytes_per_s:g} GB/s HBM at "
               f"{L20.hbm_efficiency:.0%}; prefill FLOPs 2·P·n + 2·L·d·n²; bf16 KV "
               f"({LLAMA_31_8B.kv_bytes_per_token // 1024} KiB/token for {LLAMA_31_8B.name}); one link per transfer")
