"""`smartgen bench decode-batch`: what continuous batching buys one decode worker, without prefill or network
sharing its cores: the step time of B requests stepped together (DecodeEngine.step_batch) and the tokens per
second that gives, B = 1, 2, 4, 8, dense and with a selector.

Each request has its own slab with the same context length (its own copy of one prefilled prompt).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tools.args import add_json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `decode-batch` to the `smartgen bench` measurements."""
    bench = subparsers.add_parser("decode-batch", help="decode-step time and tokens/s by batch size")
    add_json(bench)
    bench.add_argument("--context", type=int, default=512, help="context length of every request")
    bench.add_argument("--batch", default="1,2,4,8", help="batch sizes")
    bench.add_argument("--selector", default="", help="also with this selector at a 10%% budget (e.g. quest)")
    bench.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    run(context=args.context, batches=[int(b) for b in args.batch.split(",")], selector=args.selector,
        json_path=args.json)


def run(model: str = "", context: int = 512, batches: list[int] | None = None, selector: str = "", steps: int = 12,
        json_path: str | None = None) -> dict:
    """Median ms per batched step and tokens/s per batch size; prints the table and returns it."""
    from transformers import AutoTokenizer

    from schemas import DEFAULT_KV_BUDGET
    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import default_prep_dir
    from shared.models import resolve_model
    from shared.workloads import stdlib_files

    batches = batches or [1, 2, 4, 8]
    path = resolve_model(model)
    runner = ModelRunner(path)
    largest = max(batches)
    layout = runner.kv_layout(16, "bfloat16")
    store = KvStore.with_capacity_mb(layout, (largest + 1) * (context + steps + 16) * layout.token_bytes // 2**20 + 1)
    engine = DecodeEngine(runner, store, default_prep_dir(path))
    text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"][:context]
    rows = {}
    for name in ("dense", selector) if selector else ("dense",):
        for b in range(largest):
            engine.prefill_local(f"r{b}", ids, _greedy(), max_new_tokens=steps * len(batches) + 1)
            if name != "dense":
                engine.use_selection(f"r{b}", name, DEFAULT_KV_BUDGET)
        for size in batches:
            times = []
            for _ in range(steps):
                started = time.perf_counter()
                engine.step_batch([(f"r{b}", ids[-1]) for b in range(size)])
                times.append(time.perf_counter() - started)
            ms = statistics.median(times[2:]) * 1e3
            rows[f"{name}@{size}"] = {"selector": name, "batch": size, "step_ms": ms, "tokens_per_s": size / ms * 1e3}
        for b in range(largest):
            engine.end(f"r{b}")
    base = {r["selector"]: r for r in rows.values() if r["batch"] == batches[0]}
    print(f"context {context} tokens, {runner.name}; ratios against batch {batches[0]}")
    print("| selector | batch | ms/step | tokens/s | tokens/s ratio | step-time ratio |\n|---|---|---|---|---|---|")
    for r in rows.values():
        b = base[r["selector"]]
        print(f"| {r['selector']} | {r['batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / b['tokens_per_s']:.2f} | {r['step_ms'] / b['step_ms']:.2f} |")
    report = {"context": context, "rows": list(rows.values())}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return report


def _greedy():
    from schemas import Sampling

    return Sampling()
