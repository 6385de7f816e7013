"""`bench serve`'s numbers from its records: per request the figures its TTST is judged by (the honest bound),
and per mode × prompt length × regime × setting the summary runs.json and the report show (n, mean, p50, p99
from MIN_P99_SAMPLES, CTL, bytes per path, agreement with the all-local answers)."""
from __future__ import annotations

import statistics

CTL_TOKENS = (2, 8, 32, 64)
REFERENCE_MODES = ("colocated", "colocated-selective")  # in every run, on every prompt: what the ratios divide by
MIN_P99_SAMPLES = 20  # fewer requests than this report no p99


def add_honest_bounds(records: list[dict]) -> None:
    """Per request, the figures its TTST is judged by, each measured in this run (docs/api.md, `ttst_bound_s`):
    B₁ (`step1_kv_bytes`: what step 1 needed from the link), the link rate r (bytes/s, as the run paced it), the
    prefill time T (with any step 1 run on the prefill node), `decode_s` (t64 − t1: the decode phase, without TTFT's
    spread), and the honest bound: colocated-selective's step-1 compute on the same prompt (colocated's, for a
    dense request) + max(0, B₁ − r·T)/r. The request's own step-1 compute would put its own overheads
    (speculation, dequantization, bookkeeping) into its bound; the reference's does not."""
    step1: dict[tuple, float] = {}
    for r in records:
        if r["mode"] in REFERENCE_MODES and r.get("step1_compute_s"):
            step1[(r["mode"], r["prompt_tokens_asked"], r["sample"])] = r["step1_compute_s"]
    for r in records:
        times = r.get("token_times_s") or []
        r["decode_s"] = times[-1] - times[0] if len(times) > 1 else None
        r["tbt_own_s"] = own_step_s(r)
        r["decode_cpu_ms_per_step"] = cpu_per_step_ms(r)
        # the link's rate as the run paced it; the plan's is the broker's estimate from the prefill worker's recent
        # sends (their idle gaps included: 20% under the pacing in a run of 2026-12-07), which would put the system's
        # own send pattern into its bound
        plan = r.get("plan") or {}
        rate = (r.get("link_gbps") or plan.get("link_gbps") or 0.0) * 1e9 / 8
        r["link_bytes_per_s"] = rate
        reference = step1.get(("colocated-selective" if r.get("selector") else "colocated", r["prompt_tokens_asked"],
                               r["sample"]))
        b1, prefill_s = r.get("step1_kv_bytes"), r.get("prefill_s") or 0.0
        if reference is None or b1 is None:
            r["ttst_bound_honest_s"] = None
            continue
        wait_s = max(0.0, b1 - rate * prefill_s) / rate if rate > 0 else 0.0
        r["ttst_bound_honest_s"] = reference + wait_s


def own_step_s(record: dict) -> float | None:
    """The request's mean step from token 2 on as its decode node's own core saw it: the torch thread's CPU time
    (`step_cpu_s`) plus its waits on the link (`step_wait_s`), without the time other threads and processes on the
    same cores took from it. On this benchmark's machine the prefill worker, the gateway, the broker and the data
    plane share the decode worker's two cores, which a deployment of separate prefill and decode nodes does not;
    TBT on the client's clock keeps what they take. None where the decode worker did not report its steps' CPU."""
    cpu, wait = record.get("step_cpu_s") or [], record.get("step_wait_s") or []
    if len(cpu) < 2:
        return None
    wait = wait + [0.0] * (len(cpu) - len(wait))  # a request without remote KV waits on nothing
    return statistics.fmean(c + w for c, w in zip(cpu[1:], wait[1:]))


def cpu_per_step_ms(record: dict) -> dict[str, float]:
    """role (and "machine": every process) → CPU milliseconds per step of the decode phase (token 2 to the last:
    tools/bench/cpu_window.py), {} where the run did not record it."""
    cpu, steps = record.get("decode_cpu_s") or {}, len(record.get("token_times_s") or []) - 2
    return {role: 1e3 * s / steps for role, s in cpu.items() if s is not None} if steps > 0 else {}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(records: list[dict]) -> list[dict]:
    """One entry per mode × prompt length × regime × setting: n, mean and p50 of the latencies (p99 only from
    MIN_P99_SAMPLES requests), CTL, TTST's bound, bytes per path, local share."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["mode"], r["prompt_tokens_asked"], r["regime"], r["pressure"], r["link_gbps"]), []).append(r)
    runs = []
    for (mode, length, regime, r, gbps), rs in groups.items():
        def spread(key: str) -> dict[str, float | None]:
            values = [x[key] for x in rs if x.get(key) is not None]
            return {f"{key[:-2]}_mean_s": _mean(values), f"{key[:-2]}_p50_s": _pct(values, 0.5),
                    f"{key[:-2]}_p99_s": _pct(values, 0.99) if len(values) >= MIN_P99_SAMPLES else None}

        paths = sorted({p for x in rs for p in x["kv_bytes"]})
        ctl = {str(i): _mean([x["token_times_s"][i - 1] for x in rs if len(x["token_times_s"]) >= i]) for i in CTL_TOKENS}
        runs.append({
            "mode": mode, "regime": regime, "prompt_tokens": round(_mean([x["prompt_tokens"] for x in rs])),
            "prompt_tokens_asked": length, "pressure": r, "link_gbps": gbps, "n": len(rs), "num_requests": len(rs),
            **spread("ttft_s"), **spread("ttst_s"), **spread("tbt_s"), **spread("e2e_s"), **spread("tbt_own_s"),
            # the honest bound (add_honest_bounds): colocated-selective's step 1 on the same prompt + the link term
            "ttst_bound_p50_s": _pct([x["ttst_bound_honest_s"] for x in rs if x.get("ttst_bound_honest_s") is not None], 0.5),
            "ttst_bound_own_p50_s": _pct([x["ttst_bound_s"] for x in rs if x.get("ttst_bound_s") is not None], 0.5),
            "ttst_over_bound_p50": _pct([x["ttst_s"] / x["ttst_bound_honest_s"] for x in rs
                                         if x.get("ttst_s") and x.get("ttst_bound_honest_s")], 0.5),
            "ctl_s": ctl, "ctl64_mean_s": ctl["64"], "decode_s_mean": _mean([x.get("decode_s") for x in rs]),
            "prefill_mean_s": _mean([x.get("prefill_s") for x in rs]),
            "step1_kv_bytes_mean": _mean([x.get("step1_kv_bytes") for x in rs]),
            "ctl_curve_s": [_mean([x["token_times_s"][i] for x in rs if len(x["token_times_s"]) > i])
                            for i in range(max(len(x["token_times_s"]) for x in rs))],
            "kv_bytes": {p: _mean([x["kv_bytes"].get(p, 0) for x in rs]) for p in paths},
            "local_share": _mean([x["local_share"] for x in rs]),
            "step1_local_share": _mean([x["step_local_share"][0] for x in rs if x.get("step_local_share")]),
            "on_demand_wait_s": _mean([x["on_demand_wait_s"] for x in rs]),
            # where step 1's time goes on the decode node: waiting for the push, then building the cache and the
            # remote view (kv_load), then step 1's own on-demand waits
            "kv_wait_mean_s": _mean([x["kv_wait_s"] for x in rs if x.get("kv_wait_s") is not None]),
            "kv_load_mean_s": _mean([x["kv_load_s"] for x in rs if x.get("kv_load_s") is not None]),
            "step1_wait_mean_s": _mean([x["step_wait_s"][0] for x in rs if x.get("step_wait_s")]),
            # on-demand reads per request: issued by a layer as it attended, or a layer early on a prediction
            "fetch_reads_mean": _mean([x["reads"]["fetch"] for x in rs if x.get("reads")]),
            "speculative_reads_mean": _mean([x["reads"]["speculative"] for x in rs if x.get("reads")]),
            # path 3 by the latest query: reads of what a wider selection adds, and their bytes (in kv_bytes' background)
            "ranked_reads_mean": _mean([x["reads"].get("ranked", 0) for x in rs if x.get("reads")]),
            "ranked_bytes_mean": _mean([x["reads"].get("ranked_bytes", 0) for x in rs if x.get("reads")]),
            "all_local_step": _mean([x["all_local_step"] for x in rs]),
            "background_declined_share": _mean([float(x.get("background_declined", False)) for x in rs]),
            "concurrency": rs[0].get("concurrency", 1),
            # what ran during the decode phase, per step: the decode worker, the prefill worker, …, the whole machine
            "decode_cpu_ms_per_step": {role: _mean([x["decode_cpu_ms_per_step"].get(role) for x in rs])
                                       for role in sorted({k for x in rs for k in x.get("decode_cpu_ms_per_step", {})})},
            # the setting's requests were served `concurrency` at a time (one group per served_in_s): their tokens ÷
            # the groups' wall time
            "output_tokens_per_s": _tokens_per_s(rs),
        })
    agreement = token_agreement(records)
    for run in runs:
        run.update(agreement.get((run["mode"], run["prompt_tokens_asked"], run["regime"], run["pressure"],
                                  run["link_gbps"]), {}))
    return runs


def _tokens_per_s(rs: list[dict]) -> float | None:
    """Output tokens per second of one setting's requests: their tokens over the summed wall time of the groups
    they were served in (records of one group share `served_in_s`; `sample` // concurrency names the group)."""
    groups = {x.get("sample", 0) // max(1, x.get("concurrency", 1)): x.get("served_in_s") for x in rs}
    wall = sum(t for t in groups.values() if t)
    return sum(len(x["token_times_s"]) for x in rs) / wall if wall else None


def token_agreement(records: list[dict]) -> dict[tuple, dict]:
    """Per setting (as `summarize` groups them): how the answers compare with the same prompts' answers all
    local — `colocated-selective`'s for a request with a selector, `colocated`'s for a dense one (when the run
    has that row): `same_tokens` (share of requests whose tokens are equal) and `matched_prefix` (mean share of
    the reference's tokens before the first difference)."""
    def key(r: dict, nth: int) -> tuple:
        return r["prompt_tokens_asked"], r.get("task", ""), nth

    references: dict[str, dict[tuple, list[int]]] = {"colocated-selective": {}, "colocated": {}}
    seen: dict[tuple, int] = {}
    for r in records:
        if r["mode"] in references:
            nth = seen[(r["mode"], *key(r, 0))] = seen.get((r["mode"], *key(r, 0)), -1) + 1
            references[r["mode"]].setdefault(key(r, nth), r.get("token_ids", []))
    groups: dict[tuple, list[tuple[bool, float]]] = {}
    seen.clear()
    for r in records:
        setting = (r["mode"], r["prompt_tokens_asked"], r["regime"], r["pressure"], r["link_gbps"])
        nth = seen[(setting, r.get("task", ""))] = seen.get((setting, r.get("task", "")), -1) + 1
        ref = references["colocated-selective" if r.get("selector") else "colocated"].get(key(r, nth))
        if not ref or r["mode"] in references:
            continue
        ours = r.get("token_ids", [])
        prefix = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        groups.setdefault(setting, []).append((ours == ref, prefix / max(1, len(ref))))
    return {s: {"same_tokens": _mean([float(same) for same, _ in v]), "matched_prefix": _mean([m for _, m in v])}
            for s, v in groups.items()}
