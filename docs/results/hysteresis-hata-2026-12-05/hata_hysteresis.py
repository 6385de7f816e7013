"""Experiment (not part of the stack): HATA with hysteresis, a token selected last step stays selected while it
still ranks within STICK × the budget. Prints the selection drift (`smartgen eval drift`: the MB later steps miss
when step 1's selection is local) and the fidelity against dense (`smartgen eval fidelity`, 4 documents) of HATA at
20% patched so. The question: how much of the 64-step union (serve-2k-faithful-default: ~79% of the entries at
R = 6.5) hysteresis removes, and at what KL against quantized-4bit's.

    OMP_NUM_THREADS=2 .venv/bin/python docs/results/hysteresis-hata-2026-12-05/hata_hysteresis.py 1.5   # 1.0 = HATA
"""
import json
import sys

import torch

from shared.compute.selectors import hata
from shared.compute.selectors.base import top_k, top_k_unsorted
from tools.eval import drift, fidelity

STICK = float(sys.argv[1])
BUDGET = float(sys.argv[2]) if len(sys.argv) > 2 else 0.2
scores = hata.HataSelector._scores


def sticky_scores(self, layer, state, query, k):
    """HATA's scores (kv, n), with last step's picks that still rank within STICK × k lifted above every other."""
    score = scores(self, layer, state, query)
    prev = getattr(state, "prev", None)
    if prev is not None and STICK > 1:
        n = score.shape[1]
        cut = score.topk(min(n, int(STICK * k)), dim=1).values[:, -1:]
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep[:, :prev.shape[1]] = prev[:, :n]
        keep &= score >= cut
        score = score + keep * (score.max() - score.min() + 1)
    return score


def remember(state, idx, n):
    state.prev = torch.zeros(idx.shape[0], n, dtype=torch.bool).scatter_(1, idx, True)


def select(self, layer, state, query, k):
    score = sticky_scores(self, layer, state, query, k)
    idx = top_k(score, k)
    remember(state, idx, score.shape[1])
    return idx


def mark(self, layer, state, query, k, mask):
    score = sticky_scores(self, layer, state, query, k)
    idx = top_k_unsorted(score, k)
    remember(state, idx, score.shape[1])
    mask.scatter_(1, idx, True)


hata.HataSelector.select = select
hata.HataSelector.mark = mark
report = drift.run(selector="hata", budget=BUDGET, factors=(), tasks=["squad_docqa", "aclsum_report", "lcc_stdlib", "needle"],
                   progress=lambda *a: None)
fid = fidelity.evaluate(selectors=["hata"], budgets=[BUDGET], num_docs=4, tasks=[], progress=lambda *a: None)["results"][0]
print(json.dumps({"stick": STICK, "budget": BUDGET,
                  "step1_mb": {r["task"]: round(r["step1_mb"], 2) for r in report["rows"]},
                  "missed_mb": {r["task"]: round(r["missed_mb"], 2) for r in report["rows"]},
                  **{key: fid[key] for key in ("kl_mean", "greedy_agreement", "ppl_ratio")}}))
