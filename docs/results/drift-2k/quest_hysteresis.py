"""Experiment (not part of the stack): Quest with hysteresis, a page selected last step stays selected while it
still ranks within STICK × the budget's pages. Prints the selection drift (`smartgen eval drift`, no read-ahead)
and the fidelity against dense (`smartgen eval fidelity`, 4 documents, no tasks) of Quest patched so.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/drift-2k/quest_hysteresis.py 2.0   # STICK; 1.0 = Quest itself
"""
import json
import sys

import torch

from shared.compute.selectors import quest
from shared.compute.selectors.base import top_k
from tools.eval import drift, fidelity

STICK = float(sys.argv[1])


def select(self, layer, state, query, k):
    """QuestSelector.select, but last step's pages ranking within STICK × num_pages come first."""
    g, t, n = self.geometry, self.geometry.page_tokens, state.num_tokens
    num_full = n // t
    tail = torch.arange(num_full * t, n).expand(g.num_kv_heads, -1)
    num_pages = min(num_full, max(0 if tail.shape[1] else 1, (k - tail.shape[1]) // t))
    if num_pages == 0:
        return tail
    lo, hi = state.page_min.data[:, None, :num_full], state.page_max.data[:, None, :num_full]
    q = query.float().view(g.num_kv_heads, g.group, 1, -1)
    score = torch.maximum(q * lo, q * hi).sum(-1).sum(1)  # (kv, pages)
    prev = getattr(state, "prev", None)
    if prev is not None and STICK > 1:
        cut = score.topk(min(num_full, int(STICK * num_pages)), dim=1).values[:, -1:]
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep[:, :prev.shape[1]] = prev[:, :num_full]
        keep &= score >= cut
        pages = top_k(score + keep * (score.max() - score.min() + 1), num_pages)
    else:
        pages = top_k(score, num_pages)
    state.prev = torch.zeros(g.num_kv_heads, num_full, dtype=torch.bool).scatter_(1, pages, True)
    return torch.cat([(pages[..., None] * t + torch.arange(t)).flatten(1), tail], dim=1)


quest.QuestSelector.select = select
report = drift.run(factors=(), tasks=["squad_docqa", "aclsum_report", "lcc_stdlib", "needle"])
fid = fidelity.evaluate(selectors=["quest"], budgets=[0.1], num_docs=4, tasks=[], progress=lambda *a: None)["results"][0]
print(json.dumps({"stick": STICK, "missed_mb": {r["task"]: round(r["missed_mb"], 2) for r in report["rows"]},
                  **{key: fid[key] for key in ("kl_mean", "greedy_agreement", "ppl_ratio")}}))
