"""What a completion reports beyond its tokens: the `smartgen` object of every response and of the last streamed
chunk (docs/api.md, "The `smartgen` object"), built from one CompletionRun."""
from __future__ import annotations

from typing import Any

from shared.runtime.timeline import Timeline
from services.gateway.completion import CompletionRun


def ttst_bound_s(run: CompletionRun) -> float | None:
    """The best TTST any transfer schedule could reach with this request's step-1 selection on this link:
    the all-local step time, plus the time the bytes step 1 needs take beyond what the link carries while the
    prefill runs: step1_compute_s + max(0, B₁ − r·T_prefill) / r (r = the plan's link rate; unpaced: 0 s)."""
    final = run.final
    if final is None or not final.step1_compute_s:
        return None
    rate = run.plan.link_gbps * 1e9 / 8 if run.plan is not None else 0.0  # bytes/s
    behind_prefill = rate * (run.prefill_s or 0.0)
    wait_s = max(0.0, final.step1_kv_bytes - behind_prefill) / rate if rate > 0 else 0.0
    return round(final.step1_compute_s + wait_s, 6)

def summary(run: CompletionRun) -> dict[str, Any]:
    """The `smartgen` object of the response."""
    t = Timeline.of(run.token_times_s)
    final, plan = run.final, run.plan
    return {
        "queue_s": round(run.queue_s, 4),
        "ttft_s": t.ttft_s, "ttst_s": t.ttst_s, "tbt_s": t.tbt_s, "ttst_bound_s": ttst_bound_s(run),
        "token_times_s": [round(x, 6) for x in run.token_times_s],
        "kv_bytes": run.kv_bytes,
        "kv_wait_s": run.kv_wait_s,
        "kv_load_s": final.kv_load_s if final else 0.0,
        "started_while_pushing": final.started_while_pushing if final else False,
        "push_landing_wait_s": final.push_landing_wait_s if final else 0.0,
        "reads": {"fetch": final.fetch_reads, "speculative": final.speculative_reads,
                  "ranked": final.ranked_reads, "ranked_bytes": final.ranked_bytes,
                  "behind": final.behind_reads, "substituted": final.substituted,
                  "direct": final.direct_reads} if final else {},
        "prefill_s": run.prefill_s,
        "prefill_step1_s": run.prefill_step1_s,
        # what ttst_bound_s is made of: step 1's all-local compute here and the bytes it needed from the link
        "step1_compute_s": final.step1_compute_s if final else None,
        "step1_kv_bytes": final.step1_kv_bytes if final else None,
        "transfer_mode": run.mode or run.job.transfer_mode,
        "requested_mode": run.job.transfer_mode,
        "attention": "selective" if run.selector else "dense",
        "selector": run.selector or None,
        "kv_budget": run.job.kv_budget if run.selector else None,
        "kv_bits": run.kv_bits or None,  # as it ran (auto: the plan's)
        "ablate": run.job.ablate,
        "selected_share": run.selected_share,
        "local_share": final.local_share if final else None,
        "on_demand_wait_s": final.on_demand_wait_s if final else None,
        "step_local_share": final.step_local_share if final else [],
        "step_wait_s": final.step_wait_s if final else [],
        "step_cpu_s": final.step_cpu_s if final else [],
        "all_local_step": final.all_local_step if final and final.all_local_step >= 0 else None,
        "background_declined": bool(final and final.background_declined),
        "plan": {"mode": plan.transfer_mode, "reason": plan.reason, "profile": plan.profile or None,
                 "profile_version": plan.profile_version, "profile_source": plan.profile_source or None,
                 "num_push_blocks": plan.num_push_blocks, "num_blocks": plan.num_pages * (run.decode_layers or 0),
                 "query_tokens": plan.query_tokens, "query_stop_layer": plan.query_stop_layer,
                 "query_tail_tokens": plan.query_tail_tokens, "exact_push": plan.exact_push,
                 "exact_from_layer": run.exact_from_layer,
                 "link_gbps": plan.link_gbps, "prefill_tokens_per_s": plan.prefill_tokens_per_s,
                 "prefill_cached_tokens": plan.prefill_cached_tokens,
                 "parallel": plan.parallel, "background": plan.background} if plan else None,
        "failure_policy": run.job.failure_policy,
        "recomputed": bool(run.recompute_reason),
        "resumed_from": run.migrated_from,  # decode workers that died while streaming it (recompute)
        "recompute_reason": run.recompute_reason or None,
        "prefill_worker_id": run.prefill.worker_id if run.prefill else None,
        "decode_worker_id": run.decode.worker_id if run.decode else None,
        "prompt_tokens": len(run.job.prompt_ids),
        "cached_tokens": run.num_cached_tokens,  # of those, taken from the prefill's prefix cache
        "decode_cached_tokens": run.decode_cached_tokens,  # of those, the decode worker had (their KV not pushed)
        "token_ids": run.token_ids,
    }
