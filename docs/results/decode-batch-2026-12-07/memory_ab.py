"""A/B in one process: Quest's steps with the selection's memory kept (before d64b1d9: `remember_picks` ran for every
selector) against without (d64b1d9: only selectors that rank tokens keep it), dense interleaved, step by step.

    OMP_WAIT_POLICY=PASSIVE python docs/results/decode-batch-2026-12-07/memory_ab.py THREADS CONTEXT BATCH [STEPS]

"before" sets QuestSelector.ranks_tokens for its own steps: on an all-local step that flag gates only the memory
(selective.py `_issue`), so those steps run the old code path. Every request's KV is a copy of one prefill of the
same prompt; dense, before and after each step their own BATCH requests, in turn; medians from step 3."""
import statistics
import sys
import time

import torch
from transformers import AutoTokenizer

from schemas import Sampling
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import default_prep_dir
from shared.compute.selectors.quest import QuestSelector
from shared.runtime.models import resolve_model
from tools.bench.decode_batch import _copy_request
from tools.workloads import stdlib_files

threads, ctx, batch = (int(a) for a in sys.argv[1:4])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 16
torch.set_num_threads(threads)
path = resolve_model("")
runner = ModelRunner(path, "cpu", "auto")
layout = runner.kv_layout(16, "bfloat16")
store = KvStore.with_capacity_mb(layout, (3 * batch + 2) * (ctx + 3 * steps + 20) * layout.token_bytes // 2**20 + 1)
engine = DecodeEngine(runner, store, default_prep_dir(path))
text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"][:ctx]
engine.prefill_local("prompt", ids, Sampling(), max_new_tokens=3 * steps + 10)
names = ("dense", "before", "after")
for name in names:
    for b in range(batch):
        _copy_request(engine, "prompt", f"{name}{b}", len(ids), 3 * steps + 10)
        if name != "dense":
            engine.use_selection(f"{name}{b}", "quest", 0.1)
times = {n: [] for n in names}
tokens = {n: [] for n in names}
for _ in range(steps + 2):
    for name in names:
        QuestSelector.ranks_tokens = name == "before"
        started = time.perf_counter()
        out = engine.step_batch([(f"{name}{b}", ids[-1]) for b in range(batch)])
        times[name].append(time.perf_counter() - started)
        tokens[name].append([int(torch.argmax(o)) for o in out])
QuestSelector.ranks_tokens = False
ms = {n: statistics.median(t[2:]) * 1e3 for n, t in times.items()}
print(f"threads {threads}, {batch} × {ctx}, quest 10%: dense {ms['dense']:.1f} ms, before {ms['before']:.1f} "
      f"({ms['before'] / ms['dense']:.3f}×), after {ms['after']:.1f} ({ms['after'] / ms['dense']:.3f}×); "
      f"same tokens: {tokens['before'] == tokens['after']}")
