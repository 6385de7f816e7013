"""`smartgen bench decode-step`: median decode-step time, dense against each selector, at one context length.

The same prompt is prefilled once into a KV slab (as the full transfer mode leaves it on the decode node);
each configuration decodes in place from a fresh copy of it. The goal is a selective step no slower than a
dense one (the selector's scoring must cost less than what it saves).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from shared.compute.decode_engine import DecodeEngine
from shared.compute.selectors import SELECTORS, PreparationMissing, default_prep_dir
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.models import resolve_model
from shared.workloads import stdlib_files


def run(model: str = "", context: int = 4096, budget: float = 0.1, steps: int = 16, json_path: str | None = None) -> dict:
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
