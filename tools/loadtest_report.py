"""`smartgen loadtest`'s figures from its request outcomes, and the Markdown report of a whole run."""
from __future__ import annotations

import statistics
from collections import Counter

from tools.client import ABORTED, OK



def percentiles(values: list[float]) -> dict:
    """n, p50, p90, p99 (linear interpolation between order statistics) and max."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"n": len(values), "p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "max": max(values)}


def summarize(outcomes: list, elapsed_s: float) -> dict:
    """Counts by kind, latency percentiles of the successful requests (TBT per gap), throughput over the run."""
    ok = [o for o in outcomes if o.kind == OK]
    errors = Counter(o.kind for o in outcomes if o.kind not in (OK, ABORTED))
    num_tokens = sum(o.completion_tokens for o in ok)
    return {
        "num_requests": len(outcomes), "num_ok": len(ok), "num_aborted": sum(o.kind == ABORTED for o in outcomes),
        "num_errors": sum(errors.values()), "errors": dict(errors.most_common()),
        "latency_s": {"ttft": percentiles([o.ttft_s for o in ok if o.ttft_s is not None]),
                      "ttst": percentiles([o.ttst_s for o in ok if o.ttst_s is not None]),
                      "tbt": percentiles([g for o in ok for g in o.tbt_gaps_s]),
                      "e2e": percentiles([o.e2e_s for o in ok])},
        "requests_per_s": len(ok) / elapsed_s if elapsed_s else 0.0,
        "tokens_per_s": num_tokens / elapsed_s if elapsed_s else 0.0,  # completion tokens of successful requests
        "completion_tokens": num_tokens,
        "prompt_tokens_mean": statistics.fmean(o.prompt_tokens for o in ok) if ok else None,
    }


def memory_growth(timeline: list, duration_s: float) -> tuple[float, float] | None:
    """Growth of the total RSS (MiB) over the two halves of the run after its warm-up (the first tenth), from
    (seconds, MiB) samples; None if there are too few samples."""
    warm, end = duration_s / 10, duration_s
    middle = (warm + end) / 2

    def at(t: float) -> float:
        return min(timeline, key=lambda sample: abs(sample[0] - t))[1]

    if len(timeline) < 3 or timeline[-1][0] < 0.9 * end:
        return None
    return at(middle) - at(warm), at(end) - at(middle)


def _num(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    row = lambda cells: "| " + " | ".join(map(str, cells)) + " |"  # noqa: E731
    return [row(header), "|" + "---|" * len(header), *map(row, rows)]


def markdown(result: dict) -> str:
    cfg = result["config"]
    modes = ", ".join(cfg["transfer_modes"]) or "the gateway's default"
    lines = [f"## smartgen loadtest: {cfg['concurrency']} streams × {cfg['duration_s']:g} s against {result['url']}",
             "", f"max_tokens {cfg['max_tokens']}, ~{cfg['prompt_tokens']} prompt tokens asked "
             f"(mean served {_num(result['prompt_tokens_mean'], 0)}), transfer mode: {modes}; "
             f"elapsed {result['elapsed_s']:.1f} s", ""]
    lines += _table(["requests", "ok", "errors", "aborted at the deadline", "requests/s", "tokens/s"],
                    [[result["num_requests"], result["num_ok"], result["num_errors"], result["num_aborted"],
                      _num(result["requests_per_s"], 2), _num(result["tokens_per_s"], 1)]])
    if result["errors"]:
        lines += ["", *_table(["error", "count"], [[k, n] for k, n in result["errors"].items()])]
    names = {"ttft": "TTFT", "ttst": "TTST", "tbt": "TBT (each gap)", "e2e": "end-to-end (client)"}
    lines += ["", *_table(["latency (s)", "n", "p50", "p90", "p99", "max"],
                          [[names[k], p["n"], *(_num(p[q]) for q in ("p50", "p90", "p99", "max"))]
                           for k, p in result["latency_s"].items()])]
    if result["by_mode"]:
        lines += ["", *_table(["mode", "ok", "errors", "aborted", "TTFT p50", "TTST p50", "e2e p50"],
                              [[m, s["num_ok"], s["num_errors"], s["num_aborted"], _num(s["latency_s"]["ttft"]["p50"]),
                                _num(s["latency_s"]["ttst"]["p50"]), _num(s["latency_s"]["e2e"]["p50"])]
                               for m, s in result["by_mode"].items()])]
    lines += ["", *_table(["process", "role", "pid", "RSS start (MiB)", "after warm-up", "max", "end", "note"],
                          [[name, m["role"], m["pid"] or "–", _num(m["start_mib"], 1), _num(m.get("warm_mib"), 1),
                            _num(m["max_mib"], 1), _num(m["end_mib"], 1), m["note"]]
                           for name, m in result["memory"].items()])]
    growth = memory_growth(result.get("memory_timeline") or [], cfg["duration_s"])
    if growth:
        lines += ["", f"Total RSS after the warm-up: {growth[0]:+.1f} MiB in the first half of the rest of the run, "
                      f"{growth[1]:+.1f} MiB in the second (a leak grows alike in both; warm-up and allocator "
                      "settling shrink" + ("; under chaos a killed worker's RSS leaves the total and its "
                                            "replacement's is not counted)." if result.get("kills") else ").")]
    if result.get("kills"):
        backs = [k["back_after_s"] for k in result["kills"]]
        lines += ["", f"Chaos: {len(backs)} decode workers killed (SIGKILL) at "
                      f"{', '.join(str(k['at_s']) for k in result['kills'])} s; back (a new one registered) after "
                      f"{', '.join('never' if b is None else f'{b} s' for b in backs)}; "
                      f"{result.get('num_resumed', 0)} requests resumed on another decode worker."]
        lines += _errors_after_kills(result)
    if result.get("num_checked"):
        wrong = sum(1 for r in result["requests"] if r["kind"] == "wrong tokens")
        ties = [m for m in result.get("mismatches", []) if m.get("near_tie")]
        exact = result["num_checked"] - wrong - len(ties)
        tie_note = (f"; {len(ties)} first differed where the reference's two most likely tokens were within "
                    f"{max(m['reference_margin'] for m in ties):.2g} nats (a near-tie that another batch's rounding "
                    "can flip; counted ok)") if ties else ""
        lines += ["", f"Tokens: {exact} of {result['num_checked']} completed requests had exactly their prompt's "
                      "reference tokens (colocated, alone)" + tie_note + (f"; **{wrong} did not**" if wrong else "") + "."]
    leaks = result["leaks"]
    lines += ["", "Leak check: " + ("clean (no requests, KV pages, leases, tickets or transfer plans held)" if not leaks
                                    else f"**workers still hold request state**: {leaks}")]
    return "\n".join(lines)


def _errors_after_kills(result: dict) -> list[str]:
    """How soon after the latest kill each failed request was told (failure_policy fail: within the heartbeat
    TTL for the requests on the killed worker; others fail for reasons of their own)."""
    kills = sorted(k["at_s"] for k in result["kills"])
    delays: dict[str, list[float]] = {}
    for r in result["requests"]:
        if r["kind"] in (OK, ABORTED, "wrong tokens") or r.get("finished_at_s") is None:
            continue
        before = [k for k in kills if k <= r["finished_at_s"]]
        delays.setdefault(r["kind"], []).append(r["finished_at_s"] - before[-1] if before else float("inf"))
    if not delays:
        return []
    parts = [f"{kind}: {len(ds)} ({', '.join(f'{d:.1f}' for d in sorted(ds)[:12])}"
             f"{f' … the longest {max(ds):.1f}' if len(ds) > 12 else ''} s)" for kind, ds in sorted(delays.items())]
    return ["", "Failed requests by kind, with the time from the latest kill to each failure, shortest first: "
                + "; ".join(parts) + " (inf: before the first kill)."]
