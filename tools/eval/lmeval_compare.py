"""lm-evaluation-harness through the gateway against lm-eval's own `hf` backend, on the same samples of the
repository's tasks (tools/eval/lmeval_tasks.py): the scores, and per sample the largest log-likelihood gap
and whether the generations agree.

    python -m tools.eval.lmeval_compare --url http://127.0.0.1:8000 --out docs/results/lmeval [--limit N]

Runs `lm_eval` three times: `local-completions` (both tasks), `local-chat-completions` (the generation task,
with the chat template), and `hf` on the model folder (both tasks; the chat row's reference is `hf` with the
chat template too). Writes compare.json and compare.md under --out.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from tools.eval.lmeval_tasks import write

TASKS = ["smartgen_capitals_mc", "smartgen_capitals_gen"]


def lm_eval(tasks_dir: Path, out: Path, tasks: list[str], model: str, model_args: str, chat: bool,
            limit: int) -> dict[str, list[dict]]:
    """Run lm_eval; its samples per task, in doc order."""
    exe = shutil.which("lm_eval") or str(Path(sys.executable).with_name("lm_eval"))
    cmd = [exe, "run", "--include_path", str(tasks_dir), "--tasks", ",".join(tasks), "--model", model,
           "--model_args", model_args, "--output_path", str(out), "--log_samples"]
    cmd += ["--apply_chat_template"] if chat else []
    cmd += ["--device", "cpu"] if model == "hf" else []
    cmd += ["--limit", str(limit)] if limit else []
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    samples = {}
    for task in tasks:
        path = sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1]
        samples[task] = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])
    return samples


def compare(served: list[dict], reference: list[dict]) -> dict:
    """Scores of both, and the per-sample differences."""
    out = {"n": len(served)}
    metric = "acc" if "acc" in served[0] else "exact_match"
    out["score_served"] = sum(s[metric] for s in served) / len(served)
    out["score_hf"] = sum(s[metric] for s in reference) / len(reference)
    if metric == "acc":  # loglikelihood: resps are [[logprob, is_greedy]] per choice
        gaps = [abs(float(a[0][0]) - float(b[0][0])) for s, r in zip(served, reference)
                for a, b in zip(s["resps"], r["resps"])]
        out["max_loglikelihood_gap"] = max(gaps)
    else:
        out["same_generation"] = sum(s["resps"][0][0] == r["resps"][0][0] for s, r in zip(served, reference))
    return out


def main() -> None:
    from shared.runtime.models import default_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", default="", help="model folder (default: the default model)")
    parser.add_argument("--limit", type=int, default=0, help="samples per task (0 = all 20)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = Path(args.model) if args.model else default_model_path()
    out = Path(args.out)
    tasks_dir = out / "tasks"
    write(tasks_dir)
    api = f"model={model.name},tokenizer={model},tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
    hf = f"pretrained={model},dtype=float32"
    runs = {"completions": lm_eval(tasks_dir, out / "completions", TASKS, "local-completions",
                                   f"{api},base_url={args.url}/v1/completions", False, args.limit),
            "chat": lm_eval(tasks_dir, out / "chat", TASKS[1:], "local-chat-completions",
                            f"{api},base_url={args.url}/v1/chat/completions", True, args.limit),
            "hf": lm_eval(tasks_dir, out / "hf", TASKS, "hf", hf, False, args.limit),
            "hf-chat": lm_eval(tasks_dir, out / "hf-chat", TASKS[1:], "hf", hf, True, args.limit)}
    result = {"completions": {task: compare(runs["completions"][task], runs["hf"][task]) for task in TASKS},
              "chat": {TASKS[1]: compare(runs["chat"][TASKS[1]], runs["hf-chat"][TASKS[1]])}}
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    lines = ["| route | task | n | served | lm-eval hf | max loglikelihood gap | same generation |", "|---|---|---|---|---|---|---|"]
    for route, tasks in result.items():
        for task, r in tasks.items():
            lines.append(f"| {route} | {task} | {r['n']} | {r['score_served']:.3f} | {r['score_hf']:.3f} | "
                         f"{r.get('max_loglikelihood_gap', float('nan')):.2e} | {r.get('same_generation', '–')} |")
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
