"""LongBench's task metrics, re-implemented from its `metrics.py` (THUDM/LongBench) without its packages.

Each takes (prediction, ground_truth) and returns a score in [0, 1]; a sample's score is the best over its
references, a task's is 100 × the mean (see `task_score`).
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD's normalizer)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_score(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F1 over lowercased alphanumeric tokens (what `rouge` 1.0.1 computes for one sentence each).
    NOTE: LongBench's scorer silently gives 0 when its recursive LCS overflows (texts over ~1,000 words);
    this iterative LCS does not, so long summaries score here where LongBench would report 0."""
    tokens = lambda s: re.sub(r"[^a-z0-9]+", " ", s.lower()).split()  # noqa: E731
    pred, gold = tokens(prediction), tokens(ground_truth)
    if not pred or not gold:
        return 0.0
    lcs = _lcs(pred, gold)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(gold)
    return 2 * precision * recall / (precision + recall)


def code_sim_score(prediction: str, ground_truth: str) -> float:
    """First line of the prediction that is not a comment or fence, compared with fuzz.ratio (difflib)."""
    line = next((ln for ln in prediction.lstrip("\n").split("\n") if not any(m in ln for m in ("`", "#", "//"))), "")
    return round(100 * difflib.SequenceMatcher(None, line, ground_truth).ratio()) / 100


def string_match(prediction: str, ground_truth: str) -> float:
    """Needle retrieval: 1 if the needle's value appears in the prediction."""
    return float(ground_truth.strip().lower() in prediction.lower())


def rouge_first_line(prediction: str, ground_truth: str) -> float:
    """Few-shot summarization (LongBench's samsum rule): only the first line of the prediction counts."""
    return rouge_score(prediction.lstrip("\n").split("\n")[0], ground_truth)


METRICS: dict[str, Callable[[str, str], float]] = {
    "qa_f1": qa_f1_score, "rouge_l": rouge_score, "rouge_l_first_line": rouge_first_line,
    "code_sim": code_sim_score, "string_match": string_match}


def sample_score(metric: str, prediction: str, references: Sequence[str]) -> float:
    """One answer's score, 0–100: the best over its references."""
    return 100 * max(METRICS[metric](prediction, r) for r in references)


def task_score(metric: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    per_sample = [sample_score(metric, p, refs) for p, refs in zip(predictions, references)]
    return round(sum(per_sample) / len(per_sample), 2) if per_sample else 0.0
