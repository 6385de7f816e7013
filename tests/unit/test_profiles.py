"""Profile arithmetic: buckets, keys, page importance, the bounded online update, plan bitmaps."""
from __future__ import annotations

import numpy as np
import pytest

from schemas import pack_bits, unpack_bits
from shared.runtime.profiles import (bucket_for, blend, observed_importance, page_importance, positional_importance,
                             profile_key, token_blocks, tokens_per_block)


def test_buckets_are_powers_of_two_from_1k():
    """Prompts share a profile per power-of-two length bucket, the smallest being 1,024 tokens."""
    assert [bucket_for(n) for n in (1, 1024, 1025, 2048, 2049, 8000)] == [1024, 1024, 2048, 2048, 4096, 8192]


def test_profile_keys_are_valid_bucket_keys():
    """Model names with odd characters still make a JetStream key of letters, digits, '-', '_', '.'."""
    key = profile_key("Llama 3.1:8B/instruct", "quest", 2048)
    assert key == "Llama_3_1_8B_instruct.quest.2048"


def test_token_blocks_cover_every_block_once_when_n_is_a_multiple():
    """Relative blocks split a prompt evenly: N = 2·M gives two tokens per block."""
    assert np.all(tokens_per_block(2048, 1024) == 2)
    assert token_blocks(2048, 1024)[[0, 1, 2, 2047]].tolist() == [0, 0, 1, 1023]
    assert tokens_per_block(100, 1024).sum() == 100  # N < M leaves gaps, never loses a token


def test_page_importance_is_the_mean_over_the_pages_tokens():
    """A page of tokens gets the mean importance of its tokens' relative blocks (last page partial)."""
    importance = np.zeros((1, 4), dtype=np.float32)
    importance[0] = [1, 0, 0, 3]  # N = 40 tokens → 10 tokens per block; pages of 16 tokens
    pages = page_importance(importance, 40, 16)
    assert pages.shape == (1, 3)
    assert pages[0].tolist() == pytest.approx([10 / 16, 2 * 3 / 16, 3.0])  # page 1 ends in block 3


def test_positional_profile_favours_sinks_and_recent():
    """The fallback puts the first block and the last blocks on top."""
    p = positional_importance(3, 64)
    assert p.shape == (3, 64) and p[0, 0] == 1 and p[0, -1] == 1
    assert p[0, 1] < p[0, 32] < p[0, 62]


def test_online_update_moves_at_most_its_weight():
    """Blending an observation changes no entry by more than weight × the gap, and leaves unseen blocks alone."""
    rng = np.random.default_rng(0)
    current, observed = rng.random((4, 16)).astype(np.float32), rng.random((4, 16)).astype(np.float32)
    seen = np.arange(16) % 2 == 0
    out = blend(current, observed, seen, 0.05)
    assert np.all(np.abs(out - current) <= 0.05 * np.abs(observed - current) + 1e-7)
    assert np.array_equal(out[:, ~seen], current[:, ~seen])
    with pytest.raises(ValueError):
        blend(current, observed, seen, 0)


def test_observed_importance_is_selected_over_offered():
    """A request's own importance is what it selected over what it could have; blocks it never offered are unseen."""
    selected = np.array([[2, 0, 0, 4]], dtype=np.float32)
    offered = np.array([4, 4, 0, 4], dtype=np.float32)
    obs, seen = observed_importance(selected, offered)
    assert obs.tolist() == [[0.5, 0, 0, 1]] and seen.tolist() == [True, True, False, True]


def test_bitmaps_round_trip_and_refuse_the_wrong_size():
    """Plan bitmaps survive packing; a bitmap of the wrong length is an error, not a silent misread."""
    flags = np.random.default_rng(1).random((30, 129)) > 0.5
    assert np.array_equal(unpack_bits(pack_bits(flags), flags.shape), flags)
    with pytest.raises(ValueError):
        unpack_bits(pack_bits(flags), (30, 200))
