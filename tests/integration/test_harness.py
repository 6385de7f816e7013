"""The measurement harness end to end on the tiny-model stack: `bench serve` and `eval accuracy` through the API."""
from __future__ import annotations

import json

from schemas import DEFAULT_PUSH_KV_BITS, DEFAULT_SELECTOR
from tools.bench.serve import BenchConfig
from tools.bench.serve import run as bench_serve
from tools.eval import accuracy


def test_bench_serve_small_run(clean_stack, tmp_path, monkeypatch):
    """Two requests per mode at one pressure: runs.json has every field the report promises, the report and
    plots are written, and the stack is left unpaced and holding nothing."""
    monkeypatch.setenv("SMARTGEN_ADMIN_TOKEN", clean_stack.admin_token)  # as for `bench serve --url`: pacing is an admin POST
    cfg = BenchConfig(modes=["colocated", "full", "smartgen"], pressures=[2.0], regimes=["prefill"],
                      prompt_tokens=[256], requests=2, max_tokens=8, tasks=["lcc_stdlib", "needle"], url=clean_stack.gateway_url,
                      model=str(clean_stack.spec.model), out=str(tmp_path), progress=False)
    bench_serve(cfg)
    report = json.loads((tmp_path / "runs.json").read_text())
    assert report["machine"]["cpus"] and report["calibration"]["256"]["prefill_tokens_per_s"] > 0
    runs = {r["mode"]: r for r in report["runs"]}
    assert set(runs) == {"colocated", "colocated-selective", "full", "smartgen"}  # the all-local references always run
    for r in runs.values():
        assert r["num_requests"] == 2 and r["ttst_p50_s"] > 0 and r["tbt_mean_s"] > 0
        assert set(r["ctl_s"]) == {"2", "8", "32", "64"} and r["ctl_s"]["2"] >= r["ttft_p50_s"] * 0.5
        assert {"pressure", "link_gbps", "ttft_p50_s", "ttst_p99_s", "e2e_p50_s", "kv_bytes", "local_share", "regime",
                "ttst_bound_p50_s", "ctl64_mean_s", "step1_local_share", "n", "decode_s_mean", "kl_mean"} <= set(r)
        assert 0 < r["decode_s_mean"] < r["ctl_curve_s"][-1]
        # the decode worker's own step (its torch thread's CPU + link waits) and what the machine spent meanwhile
        assert 0 < r["tbt_own_mean_s"] and r["decode_cpu_ms_per_step"]["machine"] > 0
    for x in report["requests"]:  # one CPU time per decode step (token 2 on), each measured
        assert len(x["step_cpu_s"]) == len(x["token_ids"]) - 1 and min(x["step_cpu_s"]) > 0
    # prompt-major: every mode served prompt 0 before any served prompt 1
    order = [x["sample"] for x in report["requests"]]
    assert order == sorted(order) and set(order) == {0, 1}
    # the honest bound: the reference's step 1 on the same prompt, plus a link term that is never negative
    for x in report["requests"]:
        if x["mode"] == "smartgen":
            ref = next(y for y in report["requests"] if y["mode"] == "colocated-selective" and y["sample"] == x["sample"])
            assert x["ttst_bound_honest_s"] >= ref["step1_compute_s"] > 0
    assert runs["colocated"]["kl_mean"] == 0.0 and runs["full"]["kl_mean"] == 0.0  # dense: dense itself
    # the default selector under the stack's floor (none here: the tiny stack selects at 256 tokens) over smartgen's
    # default K8V8 records: a KL of its own, and not colocated-selective's (the records' rounding is in it)
    assert runs["smartgen"]["quality_config"] == f"{DEFAULT_SELECTOR}+k8v{DEFAULT_PUSH_KV_BITS}"
    assert runs["smartgen"]["kl_mean"] > 0 and runs["smartgen"]["kl_mean"] != runs["colocated-selective"]["kl_mean"]
    assert runs["full"]["pressure"] == 2.0 and runs["full"]["link_gbps"] > 0 and runs["full"]["kv_bytes"]["full"] > 0
    assert runs["colocated"]["link_gbps"] == 0 and not runs["colocated"]["kv_bytes"]
    assert runs["smartgen"]["kv_bytes"].get("metadata", 0) > 0 and runs["smartgen"]["ttst_vs_full"] is not None
    assert (tmp_path / "report.md").read_text().startswith("# Serving benchmark")
    assert list(tmp_path.glob("ctl_256_prefill_R2.png")) and list(tmp_path.glob("bytes_256.png"))


def test_bench_serve_at_several_concurrencies(clean_stack, tmp_path, monkeypatch):
    """--concurrency 1,3: a whole run at each (c1/, c3/), then the batch-size table and figure; requests in flight
    together share decode steps, so 3 at once give more tokens per second than 1."""
    monkeypatch.setenv("SMARTGEN_ADMIN_TOKEN", clean_stack.admin_token)
    cfg = BenchConfig(modes=["full"], pressures=[2.0], regimes=["prefill"], prompt_tokens=[128], requests=3,
                      max_tokens=32, tasks=["lcc_stdlib"], url=clean_stack.gateway_url, concurrency=[1, 3],
                      model=str(clean_stack.spec.model), out=str(tmp_path), progress=False)
    result = bench_serve(cfg)
    by_level = {c: {(r["mode"], r["pressure"]): r for r in runs} for c, runs in result["concurrency"].items()}
    assert set(by_level) == {"1", "3"} and (tmp_path / "c1" / "runs.json").exists() and (tmp_path / "c3" / "report.md").exists()
    table = (tmp_path / "concurrency.md").read_text()
    assert "| full | 128 | unpaced |" in table or "| full | 128 |" in table
    assert (tmp_path / "batch_size.png").exists()
    one, three = by_level["1"][("full", 2.0)], by_level["3"][("full", 2.0)]
    assert one["concurrency"] == 1 and three["concurrency"] == 3
    assert three["output_tokens_per_s"] > one["output_tokens_per_s"], (one["output_tokens_per_s"], three["output_tokens_per_s"])


def test_eval_accuracy_small_run(clean_stack, tmp_path):
    """Dense, full and smartgen answers are scored per task (the QA task through the chat route, the needle
    through completions), and smartgen decodes the same tokens as the same selector with all KV local."""
    report = accuracy.run(["colocated", "full", "colocated-selective", "smartgen-exact"], ["quest"], 0.25,
                          ["needle", "squad_docqa"], 2, 256, url=clean_stack.gateway_url,
                          model=str(clean_stack.spec.model), out=str(tmp_path), progress=False)
    rows = {(r["mode"], r["selector"]): r for r in report["rows"]}
    assert set(rows) == {("colocated", None), ("full", None), ("colocated-selective", "quest"), ("smartgen-exact", "quest")}
    assert rows[("colocated", None)]["delta_vs_dense"] == 0
    assert rows[("smartgen-exact", "quest")]["same_tokens_as_local"] == 1.0  # exact KV: bit for bit
    assert 0 <= rows[("full", None)]["scores"]["needle"] <= 100
    assert 0 <= rows[("full", None)]["scores"]["squad_docqa"] <= 100
    assert json.loads((tmp_path / "accuracy.json").read_text())["rows"]


def test_bench_serve_prefix_hit(clean_stack, tmp_path, monkeypatch):
    """--prefix-hit 0.75: each request asks its own question over one shared document, and the prefill finds the
    document's full pages cached (about 75% of each prompt) in every disaggregated request; all-local ones compute it."""
    monkeypatch.setenv("SMARTGEN_ADMIN_TOKEN", clean_stack.admin_token)
    cfg = BenchConfig(modes=["full"], pressures=[2.0], regimes=["prefill"], prompt_tokens=[256], requests=2,
                      max_tokens=4, url=clean_stack.gateway_url, model=str(clean_stack.spec.model), out=str(tmp_path),
                      progress=False, quality=False, prefix_hit=0.75)
    bench_serve(cfg)
    report = json.loads((tmp_path / "runs.json").read_text())
    requests = report["requests"]
    assert len(requests) == 2 * 3  # colocated, colocated-selective and full on 2 samples
    for x in requests:
        if x["mode"] == "full":
            assert 0.6 * 256 <= x["cached_tokens"] <= 0.75 * 256, x["cached_tokens"]
        else:
            assert x["cached_tokens"] == 0
