"""The post-RoPE query a decoder layer computes from its input: InfiniGen's speculation (the next layer's query
from this layer's input) and the prefill's last-position query (its query-aware push) both need it."""
from __future__ import annotations

import torch


def query_of(decoder_layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The post-RoPE query `decoder_layer` computes from its input `hidden` (1, 1, D) at the position of `cos`,
    `sin` (1, 1, d): (H, d)."""
    module = decoder_layer.self_attn
    x = decoder_layer.input_layernorm(hidden)
    q = module.q_proj(x).view(1, 1, -1, module.head_dim)
    if hasattr(module, "q_norm"):  # Qwen3 normalizes each head's query before RoPE
        q = module.q_norm(q)
    q = q.transpose(1, 2)  # (1, H, 1, d)
    q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
    return q[0, :, 0]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
