"""How much the low-bit push's per-entry codes cost in answers (the measurement behind PUSH_KEY_BITS in
schemas/constants.py): for one prompt of each serving-benchmark task, dense greedy decoding over the prompt's KV
(rounded to bf16, the store's dtype) with every entry's K and V through per-entry codes of the given widths,
against the same KV uncoded: the KL divergence of the first decoded step's distribution, and how many greedy
tokens stay equal before the first difference. Every prompt entry is coded, which is what the push does at
R = 2, where all of step 1's selection fits; a bound on what it does at higher R.

    python -m tools.bench.push_codes_fidelity [--prompt-tokens 2048] [--steps 24] [--widths 4/0,4/4,0/4,8/4,8/8]

A width K/V of 0 leaves that side uncoded.
"""
from __future__ import annotations

import argparse

import torch

from shared.compute.quantization import dequantize_partitions, quantize_partitions
from tools.args import csv_of
from tools.bench.serve import DEFAULT_TASKS


def coded(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x (…, head_dim) through one partition per vector of `bits`-bit codes (shared/compute/entry_codes.py's rule)."""
    codes, scale_min = quantize_partitions(x.float(), bits)
    return dequantize_partitions(codes, scale_min, bits).to(x.dtype)


def decode(model, ids: torch.Tensor, widths: tuple[int, int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after the prompt, and the first decoded step's log-probabilities, with the prompt's KV in
    bf16 and then coded at `widths` (K bits, V bits; 0 = uncoded)."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        for layer in cache.layers:
            for kv, bits in ((layer.keys, widths[0]), (layer.values, widths[1])):  # (1, H_kv, N, head_dim)
                kv.copy_(kv.to(torch.bfloat16).float())
                if bits:
                    kv.copy_(coded(kv, bits))
        token, tokens, first = out.logits[:, -1].argmax(-1), [], None
        for _ in range(steps):
            tokens.append(int(token))
            step = model(token[:, None], past_key_values=cache, use_cache=True)
            if first is None:
                first = torch.log_softmax(step.logits[:, -1].float(), -1)
            token = step.logits[:, -1].argmax(-1)
        return tokens, first


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--widths", type=csv_of(str), default=["4/0", "4/4", "0/4", "8/4", "8/8"], metavar="K/V[,K/V…]")
    parser.add_argument("--model", default="", help="a model folder (default: the prepared SmolLM2)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tools import workloads
    from shared.runtime.models import prepare_default_model, resolve_model

    if not args.model:
        prepare_default_model()
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    widths = [tuple(int(b) for b in w.split("/")) for w in args.widths]
    print("| task | prompt tokens | " + " | ".join(f"K{k or '16'}/V{v or '16'}: KL step 1, equal prefix" for k, v in widths) + " |")
    print("|---|---|" + "---|" * len(widths))
    for task in DEFAULT_TASKS:
        samples = workloads.TASKS[task](tokenizer, 1, args.prompt_tokens)
        if not samples:
            continue
        sample = samples[0]
        if sample.is_chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
        reference, ref_logprobs = decode(model, ids, (0, 0), args.steps)
        cells = []
        for w in widths:
            tokens, logprobs = decode(model, ids, w, args.steps)
            kl = float((ref_logprobs.exp() * (ref_logprobs - logprobs)).sum())
            equal = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), args.steps)
            cells.append(f"{kl:.4f}, {equal}/{args.steps}")
        print(f"| {task} | {ids.shape[1]} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
