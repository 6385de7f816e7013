"""`smartgen bench decode-batch`: what continuous batching buys one decode worker, without prefill or network
sharing its cores: the step time of B requests stepped together (DecodeEngine.step_batch) and the tokens per
second that gives, B = 1, 2, 4, 8, dense and with a selector; each step timed both batch-invariant (every row
projected as if alone, the decode worker's default) and with one shared matmul (`batch_invariant: false`),
alternately, so the two columns are measured side by side; with a selector, dense and selective steps of the
same batch size alternate too (the selective/dense ratio is taken within one run).

Each request has its own slab with the same context length (its own copy of one prefilled prompt).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tools.args import add_device, add_json, add_model


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `decode-batch` to the `smartgen bench` measurements."""
    bench = subparsers.add_parser("decode-batch", help="decode-step time and tokens/s by batch size")
    add_json(bench)
    bench.add_argument("--context", type=int, default=512, help="context length of every request")
    bench.add_argument("--batch", default="1,2,4,8", help="batch sizes")
    bench.add_argument("--selector", default="", help="also with this selector at a 10%% budget (e.g. quest)")
    bench.add_argument("--steps", type=int, default=12, help="timed steps per configuration (the first 2 are warm-up)")
    bench.add_argument("--threads", type=int, default=0, help="torch threads (default: as is)")
    add_model(bench)
    add_device(bench)
    bench.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    run(model=args.model, context=args.context, batches=[int(b) for b in args.batch.split(",")],
        selector=args.selector, steps=args.steps, json_path=args.json, device=args.device, dtype=args.dtype)


def run(model: str = "", context: int = 512, batches: list[int] | None = None, selector: str = "", steps: int = 12,
        json_path: str | None = None, device: str = "cpu", dtype: str = "auto") -> dict:
    """Median ms per batched step and tokens/s per batch size; prints the table and returns it."""
    import torch
    from transformers import AutoTokenizer

    from schemas import DEFAULT_KV_BUDGET
    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import default_prep_dir
    from shared.runtime.models import resolve_model
    from tools.workloads import stdlib_files

    batches = batches or [1, 2, 4, 8]
    path = resolve_model(model)
    runner = ModelRunner(path, device, dtype)
    # a step's time ends when the device has finished it (kernels run asynchronously on an accelerator)
    synchronize = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)
    largest = max(batches)
    layout = runner.kv_layout(16, "bfloat16")
    store = KvStore.with_capacity_mb(layout, (2 * largest + 2) * (context + 2 * steps * len(batches) + 16) * layout.token_bytes // 2**20 + 1)
    engine = DecodeEngine(runner, store, default_prep_dir(path))
    text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"][:context]
    rows = {}
    names = ("dense", selector) if selector else ("dense",)
    new_tokens = 2 * steps * len(batches) + 1
    engine.prefill_local("prompt", ids, _greedy(), max_new_tokens=new_tokens)  # once: every request copies its KV
    for name in names:  # every configuration's requests exist at once: their steps are interleaved below
        for b in range(largest):
            _copy_request(engine, "prompt", f"{name}{b}", len(ids), new_tokens)
            if name != "dense":
                engine.use_selection(f"{name}{b}", name, DEFAULT_KV_BUDGET)
    engine.end("prompt")
    for size in batches:
        times: dict[tuple[str, bool], list[float]] = {(name, v): [] for name in names for v in (True, False)}
        for _ in range(steps):
            for invariant in (True, False):
                runner.batch_invariant = invariant
                for name in names:  # round-robin: dense and the selector share whatever else runs on the cores
                    started = time.perf_counter()
                    engine.step_batch([(f"{name}{b}", ids[-1]) for b in range(size)])
                    synchronize()
                    times[name, invariant].append(time.perf_counter() - started)
        for name in names:
            invariant_ms, shared_ms = (statistics.median(times[name, v][2:]) * 1e3 for v in (True, False))
            rows[f"{name}@{size}"] = {"selector": name, "batch": size, "step_ms": invariant_ms,
                                      "tokens_per_s": size / invariant_ms * 1e3, "shared_step_ms": shared_ms,
                                      "shared_tokens_per_s": size / shared_ms * 1e3}
    runner.batch_invariant = True
    for name in names:
        for b in range(largest):
            engine.end(f"{name}{b}")
            store.free(f"{name}{b}")
    if selector:
        print(f"{selector} against dense, same batch (interleaved steps): "
              + ", ".join(f"B={size}: {rows[f'{selector}@{size}']['step_ms'] / rows[f'dense@{size}']['step_ms']:.2f}× "
                          f"(shared {rows[f'{selector}@{size}']['shared_step_ms'] / rows[f'dense@{size}']['shared_step_ms']:.2f}×)"
                          for size in batches))
    base = {r["selector"]: r for r in rows.values() if r["batch"] == batches[0]}
    print(f"context {context} tokens, {runner.name}; ratios against batch {batches[0]}")
    print("batch-invariant (the default) | shared matmul (batch_invariant: false)")
    print("| selector | batch | ms/step | tokens/s | tokens/s ratio | step-time ratio | ms/step shared | "
          "tokens/s shared | tokens/s ratio shared |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows.values():
        b = base[r["selector"]]
        print(f"| {r['selector']} | {r['batch']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / b['tokens_per_s']:.2f} | {r['step_ms'] / b['step_ms']:.2f} | "
              f"{r['shared_step_ms']:.1f} | {r['shared_tokens_per_s']:.1f} | "
              f"{r['shared_tokens_per_s'] / b['shared_tokens_per_s']:.2f} |")
    report = {"context": context, "model": runner.name, "device": str(runner.device), "dtype": str(runner.dtype),
              "rows": list(rows.values())}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return report


def _copy_request(engine, source: str, request_id: str, num_tokens: int, new_tokens: int) -> None:
    """A request whose prompt KV is a copy of `source`'s (a prefill of the same prompt gives the same KV, in a
    fraction of the time: a 4K prefill takes ~20 s on a small CPU)."""
    store = engine.store
    slab = store.allocate(request_id, num_tokens + new_tokens)
    store.view(slab)[:, :, :, :num_tokens] = store.view(store.slab(source))[:, :, :, :num_tokens]
    engine.load_from_store(request_id, slab, num_tokens)


def _greedy():
    from schemas import Sampling

    return Sampling()
