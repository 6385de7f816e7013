"""`smartgen bench decode-step`: median decode-step time, dense against each selector, at one context length.

The same prompt is prefilled once into a KV slab (as the full transfer mode leaves it on the decode node);
each configuration decodes in place from a fresh copy of it. The goal is a selective step no slower than a
dense one (the selector's scoring must cost less than what it saves).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from schemas import DEFAULT_KV_BUDGET, SELECTORS
from tools.args import add_json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `decode-step` to the `smartgen bench` measurements."""
    step = subparsers.add_parser("decode-step", help="decode-step time, dense against each selector")
    add_json(step)
    step.add_argument("--context", type=int, default=4096, help="context length")
    step.add_argument("--budget", type=float, default=DEFAULT_KV_BUDGET, help="KV budget")
    step.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """`smartgen bench decode-step`: measure and print (and write --json)."""
    run(context=args.context, budget=args.budget, json_path=args.json)


def run(model: str = "", context: int = 4096, budget: float = DEFAULT_KV_BUDGET, steps: int = 16,
        json_path: str | None = None) -> dict:
    """Median ms per decode step at `context` tokens, dense and per selector (a selector whose offline
    preparation is missing is skipped); prints the table and returns {"context", "budget", "step_ms"}."""
    from transformers import AutoTokenizer

    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import PreparationMissing, default_prep_dir
    from shared.models import resolve_model
    from shared.workloads import stdlib_files

    path = resolve_model(model)
    runner = ModelRunner(path)
    store = KvStore.with_capacity_mb(runner.kv_layout(16), 2 * (context + steps) * runner.kv_bytes_per_token // 2**20 + 1)
    engine = DecodeEngine(runner, store, default_prep_dir(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
    ids = tokenizer(text)["input_ids"][:context]
    _, cache = runner.prefill(ids)
    prompt = store.allocate("prompt", len(ids))
    for layer in range(runner.num_layers):
        store.write_layer(prompt, layer, cache.layers[layer].keys[0], cache.layers[layer].values[0])
    results = {}
    for name in ("dense", *SELECTORS):
        slab = store.allocate("r", len(ids) + steps)
        store.view(slab)[:, :, :, : len(ids)] = store.view(prompt)
        engine.load_from_store("r", slab, len(ids))
        try:
            if name != "dense":
                engine.use_selection("r", name, budget)
        except PreparationMissing as exc:
            print(f"{name}: skipped ({exc})")
            engine.end("r")
            store.free("r")
            continue
        times, token = [], ids[-1]
        for _ in range(steps):
            started = time.perf_counter()
            token = int(engine.step_logits("r", token).argmax())
            times.append(time.perf_counter() - started)
        engine.end("r")
        store.free("r")
        results[name] = statistics.median(times[2:]) * 1e3
    for name, ms in results.items():
        print(f"{name:<11} {ms:7.1f} ms/step  ({ms / results['dense']:.2f}× dense)")
    report = {"context": context, "budget": budget, "step_ms": results}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return report
