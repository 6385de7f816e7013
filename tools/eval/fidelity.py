"""`smartgen eval fidelity`: selective attention against dense attention, on the same inputs.

Per selector and budget:
  kl_mean           mean KL(dense ‖ selective) of the next-token distribution, nats/token, teacher-forced
                    over the `tokens` tokens that follow each document's prompt
  greedy_agreement  share of those positions where both pick the same greedy token (teacher-forced, so one
                    early difference does not decide all later ones; free-running text diverges sooner)
  ppl_ratio         perplexity of the true continuation, selective / dense
  attention_mass    share of the dense attention probability that the selected tokens hold (layers ≥ 2)
  scores            per task: the LongBench metric of free-running greedy answers, dense and selective
Documents: code and ACL paper bodies alternately (tools/workloads.py `evaluation_documents`), none of them
seen by the selectors' calibration. The KV stays in the compute dtype; selectors run under the decode worker's
budget floor unless --no-floor. The dense prefill is computed once per document and its cache copied for every
configuration.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

from schemas import DEFAULT_FLOOR, DEFAULT_KV_BUDGET, NO_FLOOR, SELECTORS
from tools.args import add_json, add_model
from tools.eval.metrics import task_score

if TYPE_CHECKING:  # NOTE: torch and the engine load at run time only, so `smartgen --help` starts fast
    import torch

    from shared.compute.decode_engine import DecodeEngine


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `fidelity` to the `smartgen eval` evaluations."""
    fid = subparsers.add_parser("fidelity", help="each selector against dense attention, all KV local (in process)")
    fid.add_argument("--selector", nargs="+", default=list(SELECTORS), help="selectors to compare (default all)")
    fid.add_argument("--budget", nargs="+", type=float, default=[0.05, 0.1, 0.2],
                     help="shares of the KV selected (default 0.05 0.1 0.2)")
    add_model(fid)
    fid.add_argument("--num-docs", type=int, default=2, help="documents per task (default 2)")
    fid.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length (default 2048)")
    fid.add_argument("--tokens", type=int, default=64, help="teacher-forced continuation tokens per document")
    fid.add_argument("--no-floor", action="store_true",
                     help="the bare budget: no dense threshold, minimum, sinks or recent window (what the floor buys)")
    fid.add_argument("--tasks", nargs="*", default=["lcc_stdlib", "needle", "squad_docqa", "aclsum_report"],
                     help="also score free-running answers on these tasks (none: fidelity only)")
    add_json(fid)
    fid.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """`smartgen eval fidelity`: evaluate, print the table (and write --json)."""
    run(args)


def _teacher_forced(engine: DecodeEngine, rid: str, continuation: list[int]) -> torch.Tensor:
    """Log-probabilities (len(continuation), vocab) of each next token, feeding the true continuation."""
    import torch

    out = []
    for token in continuation:
        out.append(torch.log_softmax(engine.step_logits(rid, token).float(), dim=-1))
    return torch.stack(out)


def _generate(engine: DecodeEngine, rid: str, first_logits: torch.Tensor, max_new: int, eos: int | None) -> list[int]:
    """Greedy token ids from `first_logits` on, until `eos` or `max_new` tokens."""
    import torch

    tokens = [int(torch.argmax(first_logits))]
    while len(tokens) < max_new and tokens[-1] != eos:
        tokens.append(int(torch.argmax(engine.step_logits(rid, tokens[-1]))))
    return tokens


def evaluate(model: str = "", selectors: list[str] = ("oracle",), budgets: list[float] = (DEFAULT_KV_BUDGET,),
             num_docs: int = 2, prompt_tokens: int = 2048, tokens: int = 64, tasks: list[str] = ("lcc_stdlib", "needle"),
             progress=print, floor: bool = True) -> dict:
    """The fidelity figures (module docstring) of every selector × budget: {"model", "num_docs", "prompt_tokens",
    "tokens", "tasks", "results": one dict per configuration, "seconds"}."""
    import torch
    from transformers import AutoTokenizer

    from tools import workloads
    from shared.compute.decode_engine import DecodeEngine
    from shared.compute.kvstore import KvStore
    from shared.compute.modeling import ModelRunner
    from shared.compute.selectors import default_prep_dir
    from shared.runtime.models import resolve_model

    if workloads.CALIBRATION_TASK in tasks:
        raise SystemExit(f"{workloads.CALIBRATION_TASK} is what profiles and selectors calibrate on: evaluate other tasks")
    path = resolve_model(model)
    runner = ModelRunner(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = DecodeEngine(runner, KvStore(runner.kv_layout(16), 1), default_prep_dir(path), DEFAULT_FLOOR if floor else NO_FLOOR)
    configs = [(s, b) for s in selectors for b in budgets]
    acc = {c: {"kl": [], "agree": [], "nll": [], "mass": [], "doc_kl": []} for c in configs}
    dense_nll: list[float] = []
    started = time.monotonic()

    # 1. teacher-forced fidelity on continuations of long documents that calibration never saw (code and prose)
    documents = []
    for name, text in workloads.evaluation_documents(4 * num_docs, min_chars=4 * (prompt_tokens + tokens)):
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= prompt_tokens + tokens and len(documents) < num_docs:
            documents.append((name, ids))
    for d, (name, ids) in enumerate(documents):
        prompt, continuation = ids[:prompt_tokens], ids[prompt_tokens: prompt_tokens + tokens]
        logits, cache = runner.prefill(prompt)
        engine.caches["dense"] = copy.deepcopy(cache)
        first = torch.log_softmax(logits.float(), -1)
        dense = torch.cat([first[None], _teacher_forced(engine, "dense", continuation[:-1])])
        dense_nll += [-float(dense[i, t]) for i, t in enumerate(continuation)]
        for selector, budget in configs:
            engine.caches["sel"] = copy.deepcopy(cache)
            engine.use_selection("sel", selector, budget, measure_mass=True)
            sel = torch.cat([first[None], _teacher_forced(engine, "sel", continuation[:-1])])
            selection = engine.end("sel")
            a = acc[(selector, budget)]
            a["kl"] += (dense.exp() * (dense - sel)).sum(-1)[1:].tolist()  # position 0 is the shared prefill
            a["agree"] += (dense.argmax(-1) == sel.argmax(-1))[1:].tolist()
            a["nll"] += [-float(sel[i, t]) for i, t in enumerate(continuation)]
            a["mass"].append(selection.attention_mass or 0.0)
            a["doc_kl"].append(float((dense.exp() * (dense - sel)).sum(-1)[1:].mean()))
        engine.end("dense")
        progress(f"fidelity: document {d + 1}/{len(documents)} {name} ({time.monotonic() - started:.0f} s)")

    # 2. task scores: free-running greedy answers, dense and selective, scored with LongBench's metrics
    samples = [s for t in tasks for s in workloads.TASKS[t](tokenizer, num_docs, prompt_tokens)]
    answers: dict[object, list[str]] = {"dense": [], **{c: [] for c in configs}}
    for i, sample in enumerate(samples):
        ids = tokenizer(sample.prompt)["input_ids"]
        logits, cache = runner.prefill(ids)
        for key in answers:
            engine.caches["gen"] = copy.deepcopy(cache)
            if key != "dense":
                engine.use_selection("gen", *key)
            out = _generate(engine, "gen", logits, sample.max_new_tokens, tokenizer.eos_token_id)
            engine.end("gen")
            answers[key].append(tokenizer.decode(out, skip_special_tokens=True))
        progress(f"tasks: sample {i + 1}/{len(samples)} ({sample.task}, {time.monotonic() - started:.0f} s)")

    def scores(key: object) -> dict[str, float]:
        out = {}
        for task in tasks:
            idx = [i for i, s in enumerate(samples) if s.task == task]
            if idx:
                out[task] = task_score(samples[idx[0]].metric, [answers[key][i] for i in idx], [samples[i].answers for i in idx])
        return out

    dense_scores = scores("dense")
    results = []
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    for (selector, budget), a in acc.items():
        sel_scores = scores((selector, budget))
        results.append({
            "selector": selector, "budget": budget,
            "kl_mean": mean(a["kl"]), "greedy_agreement": mean([float(x) for x in a["agree"]]),
            "ppl_ratio": math.exp(mean(a["nll"]) - mean(dense_nll)) if a["nll"] else float("nan"),
            "attention_mass": mean(a["mass"]), "kl_per_document": dict(zip([n for n, _ in documents], a["doc_kl"])),
            "scores": {t: {"dense": dense_scores[t], "selective": sel_scores[t]} for t in dense_scores},
        })
    return {"model": path.name, "floor": floor, "num_docs": len(documents), "documents": [n for n, _ in documents], "prompt_tokens": prompt_tokens, "tokens": tokens,
            "tasks": [t for t in tasks if any(s.task == t for s in samples)], "results": results,
            "seconds": round(time.monotonic() - started, 1)}


def print_table(report: dict) -> None:
    tasks = report["tasks"]
    head = f"{'selector':<11}{'budget':>7}{'KL':>8}{'agree':>7}{'ppl×':>7}{'mass':>7}" + "".join(f"{t[:14]:>16}" for t in tasks)
    print(head)
    for r in report["results"]:
        cells = "".join(f"{r['scores'][t]['selective']:>8.1f}/{r['scores'][t]['dense']:<7.1f}" for t in tasks)
        print(f"{r['selector']:<11}{r['budget']:>7.2f}{r['kl_mean']:>8.3f}{r['greedy_agreement']:>7.2f}"
              f"{r['ppl_ratio']:>7.3f}{r['attention_mass']:>7.2f}{cells}")
    print(f"(task cells: selective/dense; {report['num_docs']} docs × {report['prompt_tokens']} prompt tokens, "
          f"{'the budget floor' if report['floor'] else 'no floor'}, {report['seconds']} s)")


def run(args) -> dict:
    report = evaluate(args.model, args.selector, args.budget, args.num_docs, args.prompt_tokens, args.tokens, args.tasks,
                      floor=not args.no_floor)
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report
