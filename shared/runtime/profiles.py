"""Positional importance profiles: the arithmetic shared by the KV-profile service (which builds and
refreshes them), the decode worker (which counts what it selects) and the broker (which orders blocks by
them). NumPy only: the broker does not load torch.

A profile is I[layer, block] over M relative blocks: block b of an N-token prompt holds tokens
[b·N/M, (b+1)·N/M), so prompts of different lengths share one profile per length bucket. Transfer works in
(layer, page) blocks of the KV store; a page's importance is the mean of I over its tokens.
"""
from __future__ import annotations

import math
import re

import numpy as np

from schemas import Profile

NUM_BLOCKS = 1024  # M, the default number of relative blocks per layer
MIN_BUCKET = 1024  # prompts up to this many tokens share the smallest bucket
POSITIONAL = "positional"  # the source of the fallback profile (no stored one)


def bucket_for(num_tokens: int) -> int:
    """The length bucket of a prompt: the smallest power of two ≥ num_tokens, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << math.ceil(math.log2(max(1, num_tokens))))


def profile_key(model: str, selector: str, bucket: int) -> str:
    """The bucket key (JetStream keys allow letters, digits, '-', '_', '=', '/', '.')."""
    return ".".join(re.sub(r"[^A-Za-z0-9_=-]", "_", part) for part in (model, selector, str(bucket)))


def token_blocks(num_tokens: int, num_blocks: int) -> np.ndarray:
    """(num_tokens,) the relative block of each prompt token."""
    return np.arange(num_tokens, dtype=np.int64) * num_blocks // num_tokens


def tokens_per_block(num_tokens: int, num_blocks: int) -> np.ndarray:
    """(num_blocks,) how many prompt tokens each relative block holds (0 when N < M leaves gaps)."""
    return np.bincount(token_blocks(num_tokens, num_blocks), minlength=num_blocks).astype(np.float32)


def positional_importance(num_layers: int, num_blocks: int = NUM_BLOCKS) -> np.ndarray:
    """The fallback profile: attention sinks and the recent window, what every selector keeps most often.
    (num_layers, num_blocks) float32: 1 for the first block, and halving every 1/16 of the prompt back from
    the end."""
    b = np.arange(num_blocks, dtype=np.float32)
    recency = 0.5 ** ((num_blocks - 1 - b) / (num_blocks / 16))
    row = np.maximum(recency, (b == 0).astype(np.float32))
    return np.repeat(row[None], num_layers, axis=0)


def importance_of(profile: Profile) -> np.ndarray:
    """(num_layers, num_blocks) float32 view of a stored profile."""
    return np.frombuffer(profile.importance, dtype=np.float32).reshape(profile.num_layers, profile.num_blocks)


def page_importance(importance: np.ndarray, num_tokens: int, page_tokens: int) -> np.ndarray:
    """(num_layers, num_pages): each KV page's importance for a prompt of num_tokens, the mean of its tokens'."""
    per_token = importance[:, token_blocks(num_tokens, importance.shape[1])]  # (L, N)
    num_pages = math.ceil(num_tokens / page_tokens)
    padded = np.zeros((importance.shape[0], num_pages * page_tokens), dtype=np.float32)
    padded[:, :num_tokens] = per_token
    counts = np.full(num_pages, page_tokens, dtype=np.float32)
    counts[-1] = num_tokens - (num_pages - 1) * page_tokens
    return padded.reshape(importance.shape[0], num_pages, page_tokens).sum(-1) / counts


def observed_importance(selected: np.ndarray, offered: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A request's (or a calibration run's) own importance: selected (L, M) / offered (M,), and the mask of
    blocks it says anything about (offered > 0)."""
    seen = offered > 0
    obs = np.zeros_like(selected, dtype=np.float32)
    obs[:, seen] = selected[:, seen] / offered[seen]
    return obs, seen


def blend(current: np.ndarray, observed: np.ndarray, seen: np.ndarray, weight: float) -> np.ndarray:
    """Online refresh with a bounded effect: I ← (1 − w)·I + w·I_obs on the blocks the observation covers.
    No entry moves by more than w·|I_obs − I| ≤ w per update."""
    if not 0 < weight <= 1:
        raise ValueError("the online update weight must be in (0, 1]")
    out = current.copy()
    out[:, seen] = (1 - weight) * current[:, seen] + weight * observed[:, seen]
    return out


def online_update(stored: np.ndarray | None, observed: np.ndarray, seen: np.ndarray, weight: float) -> np.ndarray:
    """A profile after one served request: the stored one, or where none is stored the positional fallback (what
    the broker uses meanwhile), moved toward what the request selected by at most `weight` (see `blend`).
    NOTE: a first observation never becomes the profile at weight 1: one request is one sample."""
    base = stored if stored is not None else positional_importance(observed.shape[0], observed.shape[1])
    return blend(base, observed, seen, weight)
