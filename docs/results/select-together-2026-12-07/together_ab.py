"""A/B in one process: a batched step's Quest selections row by row with the page bound of one product per query
head (before), row by row with the group summed first (bound), and together (after: `_select_together`, one
`select_rows_with_floor` a layer for all rows, with the summed bound), dense interleaved, step by step.

    OMP_WAIT_POLICY=PASSIVE python docs/results/select-together-2026-12-07/together_ab.py THREADS CONTEXT BATCH [STEPS]

"before" and "bound" turn `_select_together` off for their own steps (every row then selects in `_issue`, as
before); "before" also puts back the old `QuestSelector._pages` (below, as of 9e3d86e). Every request's KV is a
copy of one prefill of the same prompt; each configuration steps its own BATCH requests, in turn; medians from
step 3; the tokens of every configuration are compared."""
import statistics
import sys
import time

import torch
from transformers import AutoTokenizer

from schemas import Sampling
from shared.compute import selective
from shared.compute.decode_engine import DecodeEngine
from shared.compute.kvstore import KvStore
from shared.compute.modeling import ModelRunner
from shared.compute.selectors import default_prep_dir
from shared.compute.selectors.base import top_k_unsorted
from shared.compute.selectors.quest import QuestSelector
from shared.runtime.models import resolve_model
from tools.bench.decode_batch import _copy_request
from tools.workloads import stdlib_files


def pages_before(self, state, query, k):
    """QuestSelector._pages as of 9e3d86e: the bound as one product per query head, summed over the group after."""
    g = self.geometry
    num_full, n, num_pages = self._plan(state, k)
    if num_pages == 0:
        return None, num_full, n
    lo, hi = state.page_min.data[:, :num_full], state.page_max.data[:, :num_full]
    q = query.float().view(g.num_kv_heads, g.group, -1)
    bound = torch.baddbmm(torch.bmm(q.clamp(max=0), lo.transpose(1, 2)), q.clamp(min=0), hi.transpose(1, 2))
    return top_k_unsorted(bound.sum(1), num_pages), num_full, n


threads, ctx, batch = (int(a) for a in sys.argv[1:4])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 16
torch.set_num_threads(threads)
path = resolve_model("")
runner = ModelRunner(path, "cpu", "auto")
layout = runner.kv_layout(16, "bfloat16")
store = KvStore.with_capacity_mb(layout, (4 * batch + 2) * (ctx + 3 * steps + 20) * layout.token_bytes // 2**20 + 1)
engine = DecodeEngine(runner, store, default_prep_dir(path))
text = "\n".join(p.read_text(errors="replace") for p in stdlib_files(40_000)[:3])
ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"][:ctx]
engine.prefill_local("prompt", ids, Sampling(), max_new_tokens=3 * steps + 10)
names = ("dense", "before", "bound", "after")
for name in names:
    for b in range(batch):
        _copy_request(engine, "prompt", f"{name}{b}", len(ids), 3 * steps + 10)
        if name != "dense":
            engine.use_selection(f"{name}{b}", "quest", 0.1)
together, pages_now = selective._select_together, QuestSelector._pages
times = {n: [] for n in names}
tokens = {n: [] for n in names}
for _ in range(steps + 2):
    for name in names:
        selective._select_together = together if name == "after" else (lambda *args: {})
        QuestSelector._pages = pages_before if name == "before" else pages_now
        started = time.perf_counter()
        out = engine.step_batch([(f"{name}{b}", ids[-1]) for b in range(batch)])
        times[name].append(time.perf_counter() - started)
        tokens[name].append([int(torch.argmax(o)) for o in out])
selective._select_together, QuestSelector._pages = together, pages_now
ms = {n: statistics.median(t[2:]) * 1e3 for n, t in times.items()}
print(f"threads {threads}, {batch} × {ctx}, quest 10%: dense {ms['dense']:.1f} ms, "
      + ", ".join(f"{n} {ms[n]:.1f} ({ms[n] / ms['dense']:.3f}×)" for n in names[1:])
      + f"; same tokens: {tokens['before'] == tokens['bound'] == tokens['after']}")
