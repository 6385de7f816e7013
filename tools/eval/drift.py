"""`smartgen eval drift`: how a selector's choice moves over decode steps, and what reading ahead buys (offline).

Path 3 by the latest query (services/decode/remote.py, ranked reads) reads ahead the entries a wider ranking of the
step's query adds, so that later steps find them local. Whether that pays on a slow link depends on two numbers
this tool measures without a link: the bytes later steps still miss, and the bytes read ahead to save them.

Replay, per selective layer, with every entry of step 1's selection local (a complete query-aware push) and each
later step's misses read at once (on demand): the misses of steps 2..T, and for each factor f the misses left and the
bytes read ahead when every layer that missed ranks again under f × the budget after its step (the decode rule) and
that read lands before the next step (a link with room: the best case for reading ahead).
Prompts: the serving benchmark's tasks (tools/workloads.py), greedy decoding, all KV local, the decode worker's
budget floor. The KV stays in the compute dtype, as in `eval fidelity`; bytes are counted as the stack moves them: K
and V of one entry of one KV head in bf16, its kv_dtype. The selector's calls are recorded by wrapping
`selective.select_with_floor` for the run (as tools/bench/query_overlap.py does), which also asks each wider budget
with the step's own query.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

from schemas import DEFAULT_KV_BUDGET, Sampling
from tools.args import add_json, add_model, csv_of

Picks = dict[tuple[int, int], dict[float, set[tuple[int, int]]]]  # (step, layer) → factor → {(kv head, token)}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `drift` to the `smartgen eval` evaluations."""
    drift = subparsers.add_parser("drift", help="selection drift over decode steps and what reading ahead buys "
                                                "(offline, all KV local)")
    drift.add_argument("--selector", default="quest", help="default quest")
    drift.add_argument("--budget", type=float, default=DEFAULT_KV_BUDGET, help="share of the KV selected (default %(default)s)")
    drift.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (default 2048)")
    drift.add_argument("--steps", type=int, default=64, help="decode steps followed (default 64)")
    drift.add_argument("--factors", type=csv_of(float), default=[1.1, 1.25, 1.5, 2.0],
                       help="read-ahead sizes as multiples of the budget (default 1.1,1.25,1.5,2)")
    drift.add_argument("--tasks", type=csv_of(str), default=["squad_docqa", "aclsum_report", "lcc_stdlib", "needle"],
                       help="workloads, comma-separated (default squad_docqa,aclsum_report,lcc_stdlib,needle)")
    add_model(drift)
    add_json(drift)
    drift.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    report = run(args.model, args.selector, args.budget, args.prompt_tokens, args.steps, args.factors, args.tasks)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def replay(picks: Picks, layers: Sequence[int], steps: int, factor: float | None) -> tuple[int, int]:
    """(entries later steps miss, entries read ahead) over `steps` recorded steps (module docstring). `picks[(s, l)]`
    holds step s's selection at layer l under 1.0 × the budget and under each factor; None: no reading ahead."""
    missed = read_ahead = 0
    for layer in layers:
        local = set(picks[(0, layer)][1.0])  # step 1's selection: pushed

        def rank(step: int) -> int:
            ahead = picks[(step, layer)][factor] - local
            local.update(ahead)
            return len(ahead)

        if factor is not None:
            read_ahead += rank(0)  # step 1 ranks too (where its push was partial it read)
        for step in range(1, steps):
            new = picks[(step, layer)][1.0] - local
            missed += len(new)
            local.update(new)
            if factor is not None and new:
                read_ahead += rank(step)
    return missed, read_ahead


def run(model: str = "", selector: str = "quest", budget: float = DEFAULT_KV_BUDGET, prompt_tokens: int = 2048,
        steps: int = 64, factors: Sequence[float] = (1.25, 2.0), tasks: Sequence[str] = ("lcc_stdlib",),
        progress=print) -> dict:
    """Record each prompt's selections, replay them (module docstring), print the table and return it."""
    import torch
    from transformers import AutoTokenizer

    from tools import workloads
    from shared.compute import selective
    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import default_prep_dir
    from shared.runtime.models import resolve_model

    path = resolve_model(model)
    runner = ModelRunner(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    layout = runner.kv_layout(16)
    store = KvStore.with_capacity_mb(layout, 2 * (prompt_tokens + 64 + steps) * runner.kv_bytes_per_token // 2**20 + 1)
    engine = DecodeEngine(runner, store, default_prep_dir(path))
    entry_bytes = 2 * layout.head_dim * torch.finfo(torch.bfloat16).bits // 8  # K and V of one token of one KV head
    rows, started = [], time.monotonic()
    select = selective.select_with_floor
    for task in tasks:
        sample = workloads.TASKS[task](tokenizer, 1, prompt_tokens)[0]
        text = tokenizer.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True,
                                             tokenize=False) if sample.is_chat else sample.prompt
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        picks: Picks = {}
        step = 0

        def recording(selector_, layer, state, probe, k, n, floor, *rest, **kw):
            """The step's selection, and the same query's under each wider budget (prompt entries only)."""
            chosen = select(selector_, layer, state, probe, k, n, floor, *rest, **kw)
            for f in (1.0, *factors):
                idx = chosen if f == 1.0 else select(selector_, layer, state, probe, min(n, int(f * k)), n, floor)
                picks.setdefault((step, layer), {})[f] = {(h, t) for h in range(idx.shape[0])
                                                          for t in idx[h].tolist() if t < len(ids)}
            return chosen

        slab = store.allocate(task, len(ids) + steps)
        first = engine.prefill_local(task, ids, Sampling(), slab)  # greedy
        engine.use_selection(task, selector, budget)
        selective.select_with_floor = recording
        try:
            token = first
            for step in range(steps):
                token = int(engine.step_logits(task, token).argmax())
        finally:
            selective.select_with_floor = select
            engine.end(task)
            store.free(task)
        layers = sorted({layer for _, layer in picks})
        if not layers:
            raise SystemExit(f"{task}: {len(ids)} tokens attend densely (the budget floor's dense_below): nothing "
                             "was selected; use longer prompts")
        selected = sum(len(picks[(0, layer)][1.0]) for layer in layers)
        missed, _ = replay(picks, layers, steps, None)
        row = {"task": task, "prompt_tokens": len(ids), "step1_mb": selected * entry_bytes / 1e6,
               "missed_mb": missed * entry_bytes / 1e6, "factors": {}}
        for f in factors:
            left, ahead = replay(picks, layers, steps, f)
            row["factors"][str(f)] = {"missed_mb": left * entry_bytes / 1e6, "read_ahead_mb": ahead * entry_bytes / 1e6}
        rows.append(row)
        progress(f"drift: {task} ({len(ids)} tokens, {time.monotonic() - started:.0f} s)")
    head = " | ".join(f"f = {f}: missed / read ahead" for f in factors)
    print(f"| task | tokens | step 1 MB | later misses MB | {head} |")
    print("|---|---|---|---|" + "---|" * len(factors))
    for row in rows:
        cells = " | ".join(f"{row['factors'][str(f)]['missed_mb']:.2f} / {row['factors'][str(f)]['read_ahead_mb']:.2f}"
                           for f in factors)
        print(f"| {row['task']} | {row['prompt_tokens']} | {row['step1_mb']:.2f} | {row['missed_mb']:.2f} | {cells} |")
    return {"selector": selector, "budget": budget, "steps": steps, "factors": list(factors), "rows": rows}

