"""`smartgen bench decode-step`: median decode-step time, dense against each selector, at one context length.

The same prompt is prefilled once; each configuration decodes from a copy of that cache. The goal is a
selective step no slower than a dense one (the selector's scoring must cost less than what it saves).
"""
from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from services.decode.engine import DecodeEngine
from services.decode.selectors import SELECTORS, PreparationMissing, default_prep_dir
from shared.kvstore import KvStore
from shared.modeling import ModelRunner
from shared.models import resolve_model
from tools.eval.data import stdlib_files


def run(model: str = "", context: int = 4096, budget: float = 0.1, steps: int = 16, json_path: str | None = None) -> dict:
    path = resolve_model(model)
    runner = ModelRunner(path)
    engine = DecodeEngine(runner, KvStore(runner.kv_layout(16), 1), default_prep_dir(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
    ids = tokenizer(text)["input_ids"][:context]
    _, cache = runner.prefill(ids)
    results = {}
    for name in ("dense", *SELECTORS):
        engine.caches["r"] = copy.deepcopy(cache)
        try:
            if name != "dense":
                engine.use_selection("r", name, budget)
        except PreparationMissing as exc:
            print(f"{name}: skipped ({exc})")
            continue
        times, token = [], ids[-1]
        for _ in range(steps):
            started = time.perf_counter()
            token = int(engine.step_logits("r", token).argmax())
            times.append(time.perf_counter() - started)
        engine.end("r")
        results[name] = statistics.median(times[2:]) * 1e3
    for name, ms in results.items():
        print(f"{name:<11} {ms:7.1f} ms/step  ({ms / results['dense']:.2f}× dense)")
    report = {"context": context, "budget": budget, "step_ms": results}
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    return report
