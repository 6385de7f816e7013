"""How much of step 1's selection the query-aware push would carry, by its size (the measurement behind
services/broker/planner.py QUERY_PUSH_FACTOR).

For one prompt: run the prefill with its last-position queries kept (as the prefill worker does), decode step 1
with the selector under the default budget floor (as the decode worker does), and for each factor m report the
share of step 1's selected prompt entries (layers ≥ 2) inside the prefill's own selection of m × step 1's budget.

    python -m tools.bench.query_overlap [--prompt-tokens 1100,2100] [--selector quest] [--kv-budget 0.1]
"""
from __future__ import annotations

import argparse
import inspect

import numpy as np

FACTORS = (1.0, 1.5, 2.0, 3.0)


def document(num_tokens: int, tokenizer) -> list[int]:
    """Real text (the standard library's source: email, then json) cut to `num_tokens` tokens."""
    import email.message
    import json.decoder

    text = inspect.getsource(email.message) + inspect.getsource(json.decoder)
    ids = tokenizer(text)["input_ids"]
    if len(ids) < num_tokens:
        raise SystemExit(f"the document has only {len(ids)} tokens")
    return ids[:num_tokens]


def overlap(num_tokens: int, selector: str, kv_budget: float) -> dict[float, float]:
    from transformers import AutoTokenizer

    from schemas import DEFAULT_FLOOR, Sampling
    from shared.compute import selective
    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.prefill_engine import PrefillEngine, QueryPush
    from shared.compute.selectors import DENSE_LAYERS, default_prep_dir
    from shared.compute.selectors.metadata import MetadataLayout
    from shared.runtime.models import resolve_model

    path = resolve_model("")
    runner = ModelRunner(path)
    ids = document(num_tokens, AutoTokenizer.from_pretrained(path))
    store = KvStore.with_capacity_mb(runner.kv_layout(16, "bfloat16"), 512)
    prefill = PrefillEngine(runner, store, default_prep_dir(path))
    aux = MetadataLayout(prefill.selector(selector), runner.num_layers, num_tokens, query_bitmap=True).nbytes
    slab = store.allocate("r", num_tokens + 4, aux)
    k = DEFAULT_FLOOR.tokens(kv_budget, num_tokens + 1)
    # keep every layer's state and last query, then select per factor from them
    push = QueryPush(0, np.zeros((runner.num_layers, -(-num_tokens // 16)), dtype=bool), 16)
    _, encode = prefill.metadata_encoder(slab, selector, num_tokens, push)
    states = {}
    sel = prefill.selector(selector)

    def keep_state(layer, keys, values):
        encode(layer, keys, values)
        if layer >= DENSE_LAYERS:
            state = sel.new_state(layer)
            sel.extend(layer, state, keys)
            states[layer] = (state, prefill.last_query[layer])

    first = prefill.run(slab, ids, Sampling(), lambda layer: None, keep_state, last_queries=True)
    decode = DecodeEngine(runner, store, default_prep_dir(path))
    decode.load_from_store("r", slab, num_tokens)
    decode.use_selection("r", selector, kv_budget, slab=slab, query_bitmap=True)
    step1: dict[int, np.ndarray] = {}
    original = selective.select_with_floor

    def spy(*args, **kw):
        idx = original(*args, **kw)
        step1[args[1]] = idx.cpu().numpy()
        return idx

    selective.select_with_floor = spy
    try:
        decode.step("r", first, Sampling(), 1)
    finally:
        selective.select_with_floor = original
    shares = {}
    for factor in FACTORS:
        hit = total = 0
        for layer, (state, query) in states.items():
            pushed = np.zeros((runner.num_kv_heads, num_tokens), dtype=bool)
            idx = original(sel, layer, state, query, int(factor * k), num_tokens, DEFAULT_FLOOR).cpu().numpy()
            np.put_along_axis(pushed, idx, True, axis=1)
            chosen = step1[layer]
            in_prompt = chosen < num_tokens
            hit += int(np.take_along_axis(pushed, np.minimum(chosen, num_tokens - 1), axis=1)[in_prompt].sum())
            total += int(in_prompt.sum())
        shares[factor] = hit / total
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", default="1100,2100")
    parser.add_argument("--selector", default="quest")
    parser.add_argument("--kv-budget", type=float, default=0.1)
    args = parser.parse_args()
    print(f"share of step 1's selection inside the query-aware push ({args.selector}, budget {args.kv_budget}):")
    print("| prompt tokens | " + " | ".join(f"{f:g}× step 1's budget" for f in FACTORS) + " |")
    print("|---" * (len(FACTORS) + 1) + "|")
    for n in (int(x) for x in args.prompt_tokens.split(",")):
        shares = overlap(n, args.selector, args.kv_budget)
        print(f"| {n} | " + " | ".join(f"{shares[f]:.2f}" for f in FACTORS) + " |")


if __name__ == "__main__":
    main()
