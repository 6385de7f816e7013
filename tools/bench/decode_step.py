"""`smartgen bench decode-step`: median decode-step time, dense against each selector, at one context length.

The same prompt is prefilled once into a KV slab (as the full transfer mode leaves it on the decode node);
each configuration decodes in place from its own copy of it. The configurations are stepped round-robin (step i
of dense, then step i of every selector, then step i + 1 of dense, …), so whatever else shares the cores slows
them alike and the ratios to dense are taken within one run. `--threads 1,2` repeats the whole round-robin at
each torch thread count. The goal is a selective step well below a dense one (issue #33).

`--profile N` also runs N steps of each configuration under torch.profiler and prints the top ops by self CPU
time (where a step's time goes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from schemas import DEFAULT_KV_BUDGET, SELECTORS
from tools.args import add_device, add_json, add_model

DEFAULT_SELECTORS = tuple(s for s in SELECTORS if s != "hata_untrained")  # same cost as hata
# NOTE: ModelWorkerConfig.kv_dtype's default: the KV a decode worker steps from, so a dense step includes what serving
# pays to read it (on CPU, a cast of the whole cache to fp32 each layer). Before 2026-12-07 the default was the compute
# dtype (fp32 on CPU), which no worker serves with: a dense step without that cast (docs/results/decode-batch-2026-12-07)
SERVED_KV_DTYPE = "bfloat16"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `decode-step` to the `smartgen bench` measurements."""
    step = subparsers.add_parser("decode-step", help="decode-step time, dense against each selector")
    add_json(step)
    step.add_argument("--context", type=int, default=4096, help="context length")
    step.add_argument("--budget", type=float, default=DEFAULT_KV_BUDGET, help="KV budget")
    step.add_argument("--steps", type=int, default=20, help="timed steps per configuration (the first 2 are warm-up)")
    step.add_argument("--threads", default="", help="torch thread counts, comma-separated (default: as is)")
    step.add_argument("--selectors", default=",".join(DEFAULT_SELECTORS), help="selectors to compare with dense")
    step.add_argument("--kv-dtype", default=SERVED_KV_DTYPE,
                      help="KV store dtype (default: bfloat16, as the decode workers keep it; '' = the compute dtype)")
    add_model(step)
    add_device(step)
    step.add_argument("--profile", type=int, default=0, metavar="N",
                      help="also profile N steps per configuration (torch.profiler, top ops by self CPU time)")
    step.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """`smartgen bench decode-step`: measure and print (and write --json)."""
    run(model=args.model, context=args.context, budget=args.budget, steps=args.steps, json_path=args.json,
        threads=[int(t) for t in args.threads.split(",") if t], selectors=[s for s in args.selectors.split(",") if s],
        kv_dtype=args.kv_dtype, profile=args.profile, device=args.device, dtype=args.dtype)


def run(model: str = "", context: int = 4096, budget: float = DEFAULT_KV_BUDGET, steps: int = 20,
        json_path: str | None = None, threads: list[int] | None = None, selectors: list[str] | None = None,
        kv_dtype: str = SERVED_KV_DTYPE, profile: int = 0, device: str = "cpu", dtype: str = "auto") -> dict:
    """Median ms per decode step at `context` tokens, dense and per selector (a selector whose offline
    preparation is missing is skipped), per thread count; prints the table and returns
    {"context", "budget", "threads": {n: {"step_ms": {name: ms}, "ratio": {name: ×dense}}}}. On an accelerator
    (`device`) the KV store stays in host memory and each configuration's cache is copied to the device once, as
    the decode worker does; a step's time includes the synchronisation that reading its token forces."""
    import torch
    from transformers import AutoTokenizer

    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import PreparationMissing, default_prep_dir
    from shared.runtime.models import resolve_model
    from tools.workloads import stdlib_files

    path = resolve_model(model)
    runner = ModelRunner(path, device, dtype)
    names = ["dense", *(selectors if selectors is not None else DEFAULT_SELECTORS)]
    threads = threads or [torch.get_num_threads()]
    rounds = len(threads) * steps + profile * len(threads) + 1
    layout = runner.kv_layout(16, kv_dtype)
    store = KvStore.with_capacity_mb(layout, (len(names) + 2) * (context + rounds + 32) * layout.token_bytes // 2**20 + 1)
    engine = DecodeEngine(runner, store, default_prep_dir(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
    ids = tokenizer(text)["input_ids"][:context]
    if len(ids) < context:
        raise SystemExit(f"only {len(ids)} prompt tokens available for --context {context}")
    _, cache = runner.prefill(ids)
    prompt = store.allocate("prompt", len(ids))
    for layer in range(runner.num_layers):
        store.write_layer(prompt, layer, cache.layers[layer].keys[0], cache.layers[layer].values[0])
    del cache
    live, tokens = [], {}
    for name in names:
        slab = store.allocate(name, len(ids) + rounds)
        store.view(slab)[:, :, :, : len(ids)] = store.view(prompt)
        engine.load_from_store(name, slab, len(ids))
        try:
            if name != "dense":
                engine.use_selection(name, name, budget)
        except PreparationMissing as exc:
            print(f"{name}: skipped ({exc})")
            engine.end(name)
            store.free(name)
            continue
        live.append(name)
        tokens[name] = ids[-1]

    cpu: dict[str, list[float]] = {}

    def one_step(name: str) -> float:
        started, started_cpu = time.perf_counter(), time.process_time()
        tokens[name] = int(engine.step_logits(name, tokens[name]).argmax())
        cpu.setdefault(name, []).append(time.process_time() - started_cpu)
        return time.perf_counter() - started

    report: dict = {"context": context, "budget": budget, "kv_dtype": str(layout.dtype), "steps": steps,
                    "model": runner.name, "device": str(runner.device), "dtype": str(runner.dtype), "threads": {}}
    before = torch.get_num_threads()
    for count in threads:
        torch.set_num_threads(count)
        times: dict[str, list[float]] = {name: [] for name in live}
        cpu.clear()
        for _ in range(steps):
            for name in live:  # round-robin: every configuration's step i before anyone's step i + 1
                times[name].append(one_step(name))
        ms = {name: statistics.median(t[2:]) * 1e3 for name, t in times.items()}
        ratio = {name: ms[name] / ms["dense"] for name in live} if "dense" in ms else {}
        # CPU time of the process per step (all its threads): what the step computes, without the time it waited for
        # the cores (on a shared machine the wall-clock medians move with the other load; this does not)
        cpu_ms = {name: statistics.median(t[2:]) * 1e3 for name, t in cpu.items()}
        cpu_ratio = {name: cpu_ms[name] / cpu_ms["dense"] for name in live} if "dense" in cpu_ms else {}
        report["threads"][count] = {"step_ms": ms, "ratio": ratio, "cpu_ms": cpu_ms, "cpu_ratio": cpu_ratio}
        print(f"context {context}, budget {budget}, {count} thread(s), median of {steps - 2} interleaved steps "
              f"(wall clock; CPU time of the process)")
        for name in live:
            print(f"  {name:<15} {ms[name]:7.1f} ms/step  ({ratio.get(name, float('nan')):.2f}× dense)   "
                  f"cpu {cpu_ms[name]:7.1f} ms  ({cpu_ratio.get(name, float('nan')):.2f}×)")
        if profile:
            report["threads"][count]["profile"] = _profile(live, one_step, profile)
    torch.set_num_threads(before)
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return report


def _profile(names: list[str], one_step, steps: int, top: int = 15) -> dict[str, str]:
    """torch.profiler over `steps` steps of each configuration: the top ops by self CPU time, printed."""
    from torch.profiler import ProfilerActivity, profile

    tables = {}
    for name in names:
        one_step(name)  # warm
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                one_step(name)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        tables[name] = table
        print(f"--- profile: {name}, {steps} steps\n{table}")
    return tables
