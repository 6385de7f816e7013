"""The measurement harness's arithmetic on synthetic inputs: bench serve's summaries and ratios, eval accuracy's
scoring, and simulate's projections."""
from __future__ import annotations

import pytest

from tools.workloads import Sample
from tools.bench import cluster, report, simulate
from schemas import DEFAULT_PUSH_KV_BITS
from tools.bench.serve import mode_body
from tools.bench.summary import summarize
from tools.eval import accuracy


def _record(mode: str, times: list[float], pressure=2.0, gbps=0.1, regime="prefill", **extra) -> dict:
    return {"mode": mode, "regime": regime if gbps else "unpaced", "prompt_tokens_asked": 2048, "pressure": pressure,
            "link_gbps": gbps, "prompt_tokens": 2000,
            "token_times_s": times, "ttft_s": times[0], "ttst_s": times[1] - times[0],
            "tbt_s": (times[-1] - times[1]) / (len(times) - 2), "e2e_s": times[-1] + 0.01,
            "kv_bytes": extra.pop("kv_bytes", {}), "local_share": extra.pop("local_share", 1.0),
            "step_local_share": extra.pop("step_local_share", []), "on_demand_wait_s": 0.0, "all_local_step": -1, **extra}


def test_summaries_of_known_timelines():
    """Percentiles, TBT and CTL of a mode come out of known token timelines exactly."""
    # full: token 1 at 10 s, a 5 s stall, then 0.1 s per token; two requests 2 s apart in TTFT
    a = [10.0, 15.0] + [15.0 + 0.1 * i for i in range(1, 63)]
    b = [12.0, 17.0] + [17.0 + 0.1 * i for i in range(1, 63)]
    runs = summarize([_record("full", a, kv_bytes={"full": 100}), _record("full", b, kv_bytes={"full": 300})])
    (r,) = runs
    assert r["num_requests"] == r["n"] == 2
    assert r["ttft_p50_s"] == pytest.approx(11.0) and r["ttft_mean_s"] == pytest.approx(11.0)
    assert r["ttft_p99_s"] is None  # too few requests for a p99
    twenty = summarize([_record("full", [10.0 + i / 19] + a[1:]) for i in range(20)])[0]
    assert twenty["ttft_p99_s"] == pytest.approx(10.0 + 0.99)
    assert r["ttst_p50_s"] == pytest.approx(5.0) and r["tbt_mean_s"] == pytest.approx(0.1)
    assert r["ctl_s"]["2"] == pytest.approx(16.0) and r["ctl_s"]["64"] == pytest.approx(16.0 + 6.2)
    assert r["kv_bytes"] == {"full": 200} and len(r["ctl_curve_s"]) == 64


def test_ratios_come_from_the_same_run():
    """TTST and TBT ratios are taken against full at the same pressure and the unpaced colocated references."""
    t = lambda ttft, ttst, tbt: [ttft, ttft + ttst] + [ttft + ttst + tbt * i for i in range(1, 63)]  # noqa: E731
    runs = summarize([_record("full", t(10, 4.0, 0.1)), _record("smartgen", t(10, 0.4, 0.11)),
                      _record("full", t(10, 1.0, 0.1), gbps=1.0, regime="step"),
                      _record("full", t(10, 13.0, 0.1), pressure=6.5, gbps=0.03),
                      _record("colocated", t(10, 0.1, 0.1), pressure=None, gbps=0.0),
                      _record("colocated-selective", t(10, 0.1, 0.1), pressure=None, gbps=0.0)])
    report.add_ratios(runs)
    sg = next(r for r in runs if r["mode"] == "smartgen")
    assert sg["ttst_vs_full"] == pytest.approx(0.1)
    assert sg["ttst_vs_colocated"] == pytest.approx(4.0)
    assert sg["tbt_vs_colocated_selective"] == pytest.approx(1.1)
    full_65 = next(r for r in runs if r["mode"] == "full" and r["pressure"] == 6.5)
    assert full_65["ttst_vs_full"] == pytest.approx(1.0)
    step = next(r for r in runs if r["mode"] == "full" and r["regime"] == "step")
    assert step["ttst_vs_full"] == pytest.approx(1.0)  # against full in its own regime, not the prefill-matched one


def test_accuracy_scores_and_token_agreement():
    """Gold answers score 100, dense is colocated, and transfer modes are checked token for token against the
    all-local selective run of the same selector."""
    samples = [Sample("needle", "p1", ["12345"], "string_match", 8), Sample("needle", "p2", ["777"], "string_match", 8)]
    reply = lambda text, ids: {"text": text, "token_ids": ids, "kv_bytes": {"full": 10}}  # noqa: E731
    answers = {"colocated": [reply("12345", [1]), reply("777", [2])],
               "colocated-selective/quest": [reply("12345", [1]), reply("no", [3])],
               "smartgen/quest": [reply("12345", [1]), reply("nope", [4])]}
    configs = accuracy.configurations(["colocated", "colocated-selective", "smartgen"], ["quest"])
    assert configs == [("colocated", None), ("colocated-selective", "quest"), ("smartgen", "quest")]
    rows = {r["mode"]: r for r in accuracy.score(configs, samples, answers)}
    assert rows["colocated"]["mean"] == 100.0 and rows["colocated"]["delta_vs_dense"] == 0.0
    assert rows["colocated-selective"]["mean"] == 50.0 and rows["colocated-selective"]["same_tokens_as_local"] is None
    assert rows["smartgen"]["delta_vs_dense"] == -50.0 and rows["smartgen"]["same_tokens_as_local"] == 0.5


def test_simulated_cluster_follows_the_pressure():
    """On the modelled L20 cluster: R grows as the link slows; where full transfer hides behind the prefill auto
    keeps full; where it does not, SmartGen's TTST gain over full grows with R."""
    calib = {**simulate.DEFAULT_CALIBRATION,
             "hits": {m: [(0.0, 0.5, 0.7), (1.0, 1.0, 1.0)] for m in ("smartgen", "partial")}}
    m = cluster.LLAMA_31_8B
    at = lambda gbps, batch: simulate.project(simulate.Setting(m, gbps, 32768, batch, 0.9, 0.1), calib)  # noqa: E731
    fast, slow = at(32, 6), at(15, 6)
    assert slow["full"]["R"] > fast["full"]["R"] > 1
    gain = lambda p: p["full"]["ttst_s"] / p["smartgen"]["ttst_s"]  # noqa: E731
    assert gain(slow) > gain(fast) > 1
    easy = at(32, 1)
    assert easy["full"]["R"] < 1 and easy["auto"] == easy["full"]
    assert simulate.local_hits(calib, "smartgen", 0.5) == pytest.approx((0.75, 0.85))
    # the equivalent rate inverts the pressure
    assert cluster.pressure(m, 8192, cluster.equivalent_gbps(3.0, m, 8192)) == pytest.approx(3.0)


def test_loadtest_memory_growth_splits_the_run_after_warm_up():
    """Linear growth shows in both halves alike; growth that stops shows in the first half only; a run cut
    short gives no verdict."""
    from tools.loadtest_report import memory_growth

    linear = [(t, 100.0 + t) for t in range(0, 101)]  # 1 MiB a second, sampled every second
    assert memory_growth(linear, 100) == (45.0, 45.0)
    settling = [(t, 100.0 + min(t, 40)) for t in range(0, 101)]
    assert memory_growth(settling, 100) == (30.0, 0.0)
    assert memory_growth(linear[:40], 100) is None


def test_answers_are_compared_with_the_same_prompts_all_local():
    """A selective row against colocated-selective, a dense one against colocated, prompt by prompt."""
    from tools.bench.summary import token_agreement

    def rec(mode, task, tokens, selector="quest"):
        return {"mode": mode, "prompt_tokens_asked": 2048, "regime": "prefill", "pressure": 2.0, "link_gbps": 0.1,
                "task": task, "token_ids": tokens, "selector": selector}

    records = [rec("colocated-selective", "a", [1, 2, 3, 4]), rec("colocated-selective", "b", [5, 6]),
               rec("colocated", "a", [9, 9], None), rec("smartgen-4bit", "a", [1, 2, 7, 4]),
               rec("smartgen-4bit", "b", [5, 6]), rec("quantized-4bit", "a", [9, 8], None)]
    agreement = token_agreement(records)
    assert agreement[("smartgen-4bit", 2048, "prefill", 2.0, 0.1)] == {"same_tokens": 0.5, "matched_prefix": 0.75}
    assert agreement[("quantized-4bit", 2048, "prefill", 2.0, 0.1)] == {"same_tokens": 0.0, "matched_prefix": 0.5}
    assert ("colocated", 2048, "prefill", 2.0, 0.1) not in agreement


def test_an_ablation_row_is_a_smartgen_mode_without_one_path():
    """`<smartgen mode>-no-<path>`: the mode's body with that path ablated; anything else is refused."""
    assert mode_body("smartgen-4bit-no-ahead", "quest", 0.1) == {"transfer_mode": "smartgen", "kv_bits": 4,
                                                                 "selector": "quest", "kv_budget": 0.1,
                                                                 "ablate": ["ahead"]}
    assert mode_body("smartgen-no-query", "quest", 0.1)["ablate"] == ["query"]
    for bad in ("full-no-query", "smartgen-no-nothing", "smartgen-16bit"):
        with pytest.raises(ValueError):
            mode_body(bad, "quest", 0.1)


def test_a_rows_kl_is_measured_over_the_kv_that_mode_decodes():
    """The KL column's configuration per mode: dense KV for colocated and full, the quantized widths, the selector
    over exact KV for colocated-selective, partial and exact smartgen, and over smartgen's records (K 8 bits, V the
    push width) for smartgen with low-bit KV, the default (K8V8) included; none where it cannot be one."""
    from tools.bench.modes import quality_config

    expected = {"colocated": "dense", "full": "dense", "quantized-4bit": "quantized-4bit", "colocated-selective": "hata",
                "partial": "hata", "smartgen-exact": "hata", "smartgen": f"hata+k8v{DEFAULT_PUSH_KV_BITS}",
                "smartgen-4bit": "hata+k8v4", "smartgen-4bit-no-ahead": "hata+k8v4", "auto": None,
                "smartgen-no-stall": None}
    assert {mode: quality_config(mode, "hata") for mode in expected} == expected


def test_the_drift_replay_counts_misses_and_what_a_wider_ranking_reads_ahead():
    """One layer, three steps: step 1's selection is local, later steps read what they miss, and with reading ahead
    a layer that missed (and step 1) brings its wider ranking before the next step."""
    from tools.eval.drift import replay

    a, b, c, d, e = ((0, t) for t in range(5))
    picks = {(0, 2): {1.0: {a, b}, 2.0: {a, b, c}},
             (1, 2): {1.0: {a, c}, 2.0: {a, c, d}},
             (2, 2): {1.0: {c, d}, 2.0: {c, d, e}}}
    assert replay(picks, [2], 3, None) == (2, 0)  # c at step 2, d at step 3
    assert replay(picks, [2], 3, 2.0) == (1, 2)  # c read ahead after step 1; d missed, then e read ahead


def test_the_own_step_is_cpu_plus_link_waits_and_cpu_is_per_step():
    """The own step (tbt_own) is the decode worker's torch-thread CPU plus its link waits from token 2 on, whatever
    the client's clock says; a request without remote KV waits on nothing after its list ends; CPU per step divides
    a role's decode-phase CPU by the steps from token 2 to the last."""
    from tools.bench.summary import add_honest_bounds

    t = [1.0, 1.2] + [1.2 + 0.2 * i for i in range(1, 11)]  # 12 tokens, client TBT 0.2 s
    local = _record("colocated-selective", t, pressure=None, gbps=0.0, step_cpu_s=[0.05] * 11, sample=0,
                    decode_cpu_s={"decode": 0.5, "prefill": 0.0, "machine": 1.0})
    remote = _record("smartgen", t, step_cpu_s=[0.07] * 11, step_wait_s=[0.5, 0.01, 0.03], sample=0,  # then local
                     decode_cpu_s={"decode": 0.7, "prefill": 0.8, "machine": 2.0})
    records = [local, remote]
    add_honest_bounds(records)
    runs = summarize(records)
    report.add_ratios(runs)
    sg = next(r for r in runs if r["mode"] == "smartgen")
    assert sg["tbt_own_mean_s"] == pytest.approx(0.07 + 0.04 / 10)  # step 1 (index 0) is TTST's, not TBT's
    assert sg["tbt_own_vs_colocated_selective"] == pytest.approx((0.07 + 0.004) / 0.05)
    assert sg["tbt_mean_s"] == pytest.approx(0.2)  # the client's clock is untouched
    assert sg["decode_cpu_ms_per_step"] == pytest.approx({"decode": 70.0, "prefill": 80.0, "machine": 200.0})


def test_the_honest_bound_takes_the_link_as_the_run_paced_it():
    """Two requests on the same paced link whose plans carry different estimates of it (the broker's, from the prefill
    worker's recent sends) get the same r and the bound from the paced rate: 1 MB beyond r·T at 8 Mbit/s is 1 s."""
    from tools.bench.summary import add_honest_bounds

    t = [10.0, 12.0, 12.1, 12.2]
    reference = _record("colocated-selective", t, pressure=None, gbps=0.0, sample=0, step1_compute_s=0.1)
    records = [reference] + [_record("smartgen", t, gbps=0.008, sample=0, selector="hata", step1_compute_s=0.3,
                                     step1_kv_bytes=11_000_000, prefill_s=10.0, plan={"link_gbps": estimate})
                             for estimate in (0.008, 0.0064)]
    add_honest_bounds(records)
    for r in records[1:]:
        assert r["link_bytes_per_s"] == pytest.approx(1e6)
        assert r["ttst_bound_honest_s"] == pytest.approx(0.1 + 1.0)
