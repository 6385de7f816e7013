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


def speculated_query(step, decoder_layer, from_layer: int, b: int) -> torch.Tensor:
    """InfiniGen's speculation: the query `decoder_layer` would compute for row b from the input of the layer
    `from_layer` before it, in this decode step (`step`: selective.Step, which keeps each layer's input and the
    step's RoPE), (H, d)."""
    hidden = step.layer_inputs.get(from_layer) if step is not None else None
    if hidden is None or step.position_embeddings is None:
        raise RuntimeError("speculation needs the previous layer's input: install() was not called")
    cos, sin = step.position_embeddings
    return query_of(decoder_layer, hidden[b: b + 1], cos[b: b + 1], sin[b: b + 1])
