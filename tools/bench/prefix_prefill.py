"""`smartgen bench prefix-prefill`: what the prefill's prefix cache saves on one prompt, without a stack: the prefill
time of prompts that share a document of `hit` × `prompt_tokens` tokens (each then asks its own question, a
different text), computed whole and with the document's KV taken from the cache, on one model process.

The hit prompts are checked against the whole prefill of the same prompt: the first token must be equal and the
KV landed in the slab (what every transfer mode pushes) close (max |Δ| printed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from shared.runtime.config import ModelWorkerConfig
from tools.args import add_json, add_model

PAGE_TOKENS = ModelWorkerConfig().page_tokens  # the services' default page_tokens


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `prefix-prefill` to the `smartgen bench` measurements."""
    bench = subparsers.add_parser("prefix-prefill", help="prefill time with and without a prefix cache hit")
    add_json(bench)
    bench.add_argument("--prompt-tokens", type=int, default=2048, help="tokens of each prompt")
    bench.add_argument("--hit", type=float, default=0.75, help="share of each prompt that is the shared document")
    bench.add_argument("--repeats", type=int, default=3, help="timed prompts per case (median reported)")
    bench.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    add_model(bench)
    bench.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    run(args.model, args.prompt_tokens, args.hit, args.repeats, args.json)


def run(model: str = "", prompt_tokens: int = 2048, hit: float = 0.75, repeats: int = 3,
        json_path: str | None = None) -> dict:
    """Median prefill seconds without and with the hit; prints them and returns the row."""
    from transformers import AutoTokenizer

    from schemas import Sampling
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.prefill_engine import PrefillEngine
    from shared.compute.prefix_cache import PrefixCache
    from shared.runtime.models import resolve_model
    from tools.workloads import stdlib_files

    if not 0 <= hit < 1 or prompt_tokens < PAGE_TOKENS or repeats < 1:
        raise SystemExit("--hit must be in [0, 1), --prompt-tokens at least a page (16), --repeats at least 1")
    path = resolve_model(model)
    runner = ModelRunner(path)
    text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:4 + repeats])
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    shared = int(hit * prompt_tokens)
    tail = prompt_tokens - shared
    if len(ids) < shared + (repeats + 1) * tail:
        raise SystemExit("not enough local text for these prompts: ask for fewer tokens or repeats")
    document = ids[:shared]
    prompts = [document + ids[shared + k * tail: shared + (k + 1) * tail] for k in range(repeats + 1)]
    layout = runner.kv_layout(PAGE_TOKENS, "bfloat16")
    store = KvStore(layout, 2 * (prompt_tokens // PAGE_TOKENS + 1))
    plain = PrefillEngine(runner, store)
    cached = PrefillEngine(runner, store, prefix_cache=PrefixCache(2 * prompt_tokens * runner.kv_bytes_per_token * 2,
                                                                    PAGE_TOKENS))

    def prefill(engine: PrefillEngine, prompt: list[int], name: str):  # (seconds, first token, cached, the slab's KV)
        slab = store.allocate(name, len(prompt))
        try:
            started = time.perf_counter()
            first = engine.run_scored(slab, prompt, Sampling(), lambda _layer: None, reuse_prefix=True)
            seconds = time.perf_counter() - started
            return seconds, first.token, first.num_cached_tokens, store.view(slab)[:, :, :, :len(prompt)].float().clone()
        finally:
            store.free(name)

    prefill(plain, prompts[0][:64], "warm-up")
    prefill(cached, prompts[0], "fill")  # the document's pages now in the cache
    prefill(cached, prompts[0][:-1], "warm-up")  # a hit's first run builds what later ones reuse
    whole_s, hit_s, hit_tokens, max_diff, equal = [], [], [], 0.0, True
    for prompt in prompts[1:]:
        s0, t0, _, kv0 = prefill(plain, prompt, "whole")
        s1, t1, c1, kv1 = prefill(cached, prompt, "hit")
        whole_s.append(s0)
        hit_s.append(s1)
        hit_tokens.append(c1)
        equal &= t0 == t1
        max_diff = max(max_diff, float((kv0 - kv1).abs().max()))
    row = {"model": Path(path).name, "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
           "whole_prefill_s": round(statistics.median(whole_s), 4), "hit_prefill_s": round(statistics.median(hit_s), 4),
           "first_tokens_equal": equal, "kv_max_abs_diff": max_diff}
    row["ratio"] = round(row["hit_prefill_s"] / row["whole_prefill_s"], 3)
    print(f"{row['model']}: {prompt_tokens}-token prompts, {hit_tokens[0]} tokens cached: prefill "
          f"{row['whole_prefill_s'] * 1e3:.0f} ms whole, {row['hit_prefill_s'] * 1e3:.0f} ms with the hit "
          f"({row['ratio']:.2f}×); first tokens equal: {equal}; KV max |Δ| {max_diff:.3g}")
    if json_path:
        Path(json_path).write_text(json.dumps(row, indent=2))
    return row
