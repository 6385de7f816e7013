"""Choosing the next token from logits: greedy at temperature 0, else seeded sampling.

A sampled token depends only on (seed, token index, logits), not on which process draws it,
so a request gives the same tokens colocated or disaggregated.
"""
from __future__ import annotations

import torch

from schemas import Sampling


def sample(logits: torch.Tensor, sampling: Sampling, index: int) -> int:
    """logits: (vocab,) for the last position; index: the completion token's index (0 = first token)."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits.float().cpu() / sampling.temperature
    if not torch.isfinite(scaled.max()):  # a temperature so small (1e-300) it overflows: its limit, greedy
        return int(torch.argmax(logits))
    generator = torch.Generator().manual_seed((sampling.seed * 1_000_003 + index) % 2**63)
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))
