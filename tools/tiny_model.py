"""A random-weight causal LM with the real tokenizer, for fast tests and the loadtest (seconds to load, ms a step).

    python -m tools.tiny_model /tmp/loadtest-tiny
"""
from __future__ import annotations

import sys
from pathlib import Path

from shared.runtime.models import resolve_model


def make_tiny_model(target: Path, tokenizer_from: Path | None = None, num_layers: int = 4, seed: int = 0,
                    model_type: str = "llama", prepare: bool = True, max_positions: int = 4096) -> Path:
    """A random-weight causal LM with the real tokenizer, for fast tests (seconds to load, ms per step), with the
    selectors' offline preparation (a small calibration: 2 texts of 512 tokens) unless `prepare` is False;
    `max_positions`: its longest prompt + completion, in tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from or resolve_model())
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
        initializer_range=0.3)  # NOTE: wide weights give varied greedy tokens (0.02 repeats one token)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    if prepare:  # the default selector (hata) and infinigen need their offline preparation: ~3 s at this size
        from tools.prepare_selectors import run

        run(str(target), "all", num_prompts=2, prompt_tokens=512)
    return target


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tools.tiny_model TARGET_FOLDER")
    print(make_tiny_model(Path(sys.argv[1])))
