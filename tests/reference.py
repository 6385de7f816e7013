"""Reference outputs from plain transformers, to hold the served tokens against."""
from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@cache
def load(path: str):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path)


def greedy_tokens(path: Path | str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """What `model.generate` returns for the prompt, greedy, stopping at EOS like the server does."""
    model, tokenizer = load(str(path))
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def prompt_ids(path: Path | str, text: str) -> list[int]:
    return list(load(str(path))[1](text)["input_ids"])


def token_logprobs(path: Path | str, token_ids: list[int]) -> list[float]:
    """Plain transformers' log-probability of each token after the ones before it (tokens 1…N-1)."""
    model, _ = load(str(path))
    with torch.inference_mode():
        logits = model(torch.tensor([token_ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(token_ids[1:])[:, None])[:, 0].tolist()
