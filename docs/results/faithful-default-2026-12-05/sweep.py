"""Which selector and budget is as faithful as quantized-4bit (issue #34 item 3)? KL vs dense and top-token
agreement, teacher-forced along dense's 64-token answer, on held-out 2K prompts (the serving benchmark's tasks;
profiles and selectors are calibrated on others), for Quest and HATA at 10/20/30% and quantized 4/8-bit, under
the decode worker's default floor. One process; prints a table and writes sweep.json beside this file.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python docs/results/faithful-default-2026-12-05/sweep.py
"""
import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from shared.runtime.models import resolve_model
from tools.bench.serve import build_samples
from tools.eval import paired

PROMPTS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
path = resolve_model("")
tokenizer = AutoTokenizer.from_pretrained(path)
samples = build_samples(tokenizer, ["squad_docqa", "aclsum_report", "aclsum_fewshot", "lcc_stdlib", "needle"], PROMPTS, 2048)
ids = [list(tokenizer(s.prompt)["input_ids"]) for s in samples]
rows = {}
for budget in (0.1, 0.2, 0.3):
    scores = paired.quality("", ids, ["quest", "hata", "quantized-4bit", "quantized-8bit"] if budget == 0.1
                            else ["quest", "hata"], 64, budget)
    for config, q in scores.items():
        if config == "dense":
            continue
        name = config if config.startswith("quantized") else f"{config}@{budget:g}"
        rows[name] = q
        print(f"{name:16} KL {q['kl_mean']:.4f}  agreement {q['agreement_mean']:.3f}", flush=True)
Path(__file__).with_name("sweep.json").write_text(json.dumps({"prompts": len(ids), "tasks": [s.task for s in samples],
                                                             "rows": rows}, indent=1))
