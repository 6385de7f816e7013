"""The serving benchmark's report: ratios from the same run, a markdown table, and the paper-style plots.

Ratios: TTST and TBT of each mode over `full` at the same prompt length, pacing regime and pressure, TTST over
the honest bound (colocated-selective's step 1 on the same prompt plus the link term: summary.add_honest_bounds),
and over the colocated references measured in the same run, on the same prompts, interleaved (`colocated`
dense: the physical limit; `colocated-selective`: the same selector with all KV local, what SmartGen's TBT is
held against). Every row carries its quality beside its latency: KL vs dense and top-token agreement,
teacher-forced on the served prompts (serve.measure_quality).
Plots (PNG): CTL per token index per mode (the paper's time-series figure), TTST per mode against R (the
bandwidth figure), CTL64 against KL per mode (the latency × quality front), the ablation bars, and bytes per path.
"""
from __future__ import annotations

from pathlib import Path

from tools.bench import cluster

ABLATIONS = ("smartgen", "smartgen-no-proactive", "smartgen-no-parallel", "smartgen-no-background", "smartgen-no-query",
             "smartgen-no-ahead")
PATHS = ("full", "quantized", "metadata", "proactive", "on_demand", "background")


def add_ratios(runs: list[dict]) -> None:
    """Each run gets ttst_vs_full, tbt_vs_full, ttst_vs_bound, ttst_vs_colocated, ttst_vs_colocated_selective and
    tbt_vs_colocated_selective (None where the reference was not run)."""
    def find(mode: str, length: int, pressure, regime: str = "any") -> dict | None:
        for r in runs:
            if r["mode"] == mode and r["prompt_tokens_asked"] == length and (pressure == "any" or r["pressure"] == pressure) \
                    and (regime == "any" or r.get("regime") == regime):
                return r
        return None

    def ratio(a, b):
        return a / b if a is not None and b else None

    for r in runs:
        length = r["prompt_tokens_asked"]
        full, colo, local = find("full", length, r["pressure"], r.get("regime", "any")), \
            find("colocated", length, "any"), find("colocated-selective", length, "any")
        r["ttst_vs_full"] = ratio(r["ttst_p50_s"], full and full["ttst_p50_s"])
        r["ttst_vs_bound"] = ratio(r["ttst_p50_s"], r.get("ttst_bound_p50_s"))
        r["ttst_vs_colocated_selective"] = ratio(r["ttst_p50_s"], local and local["ttst_p50_s"])
        r["tbt_vs_full"] = ratio(r["tbt_mean_s"], full and full["tbt_mean_s"])
        r["ttst_vs_colocated"] = ratio(r["ttst_p50_s"], colo and colo["ttst_p50_s"])
        r["tbt_vs_colocated_selective"] = ratio(r["tbt_mean_s"], local and local["tbt_mean_s"])
        r["tbt_own_vs_colocated_selective"] = ratio(r.get("tbt_own_mean_s"), local and local.get("tbt_own_mean_s"))


def _f(x, digits: int = 3) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _mb(n) -> str:
    return "—" if not n else f"{n / 1e6:.1f}"


def markdown(report: dict) -> str:
    m, cfg, runs = report["machine"], report["config"], report["runs"]
    lines = [f"# Serving benchmark: {m['model']}", "",
             f"{m['date']} on {m['host']} ({m['cpus']} CPUs, {m['platform']}, torch {m['torch']}, {m['dtype']}). "
             f"Absolute times belong to this machine; compare rows within a table.", "",
             f"Selector `{cfg['selector']}` at budget {cfg['kv_budget']}, {cfg['requests']} requests per row "
             f"({', '.join(cfg['tasks'])}), {cfg['max_tokens']} output tokens each, concurrency {cfg['concurrency']}. "
             f"Times on the client's clock ({m.get('clock', 'gateway stamps')}).", "",
             _profile_line(report), "",
             "## Link settings", "",
             "| prompt tokens | prefill tok/s here | KV bytes/token | R | emulated link | same R for Llama-3.1-8B on an L20 (same length / 48K) |",
             "|---|---|---|---|---|---|"]
    seen = set()
    for r in runs:
        key = (r["prompt_tokens_asked"], r["pressure"], r["link_gbps"])
        if key in seen or not r["link_gbps"]:
            continue
        seen.add(key)
        calib = report["calibration"][str(r["prompt_tokens_asked"])]
        pressure = r["pressure"]
        eq = (f"{cluster.equivalent_gbps(pressure, cluster.LLAMA_31_8B, r['prompt_tokens']):.2f} / "
              f"{cluster.equivalent_gbps(pressure, cluster.LLAMA_31_8B, 48 * 1024):.2f} Gbit/s") if pressure else "—"
        lines.append(f"| {r['prompt_tokens']} | {calib['prefill_tokens_per_s']:.0f} | {calib['kv_bytes_per_token']:.0f} | "
                     f"{_f(pressure, 2)} ({r.get('regime', '—')}) | {r['link_gbps'] * 1e3:.2f} Mbit/s | {eq} |")
    lines += ["", f"Cluster assumptions: {report['cluster_assumptions']}.", ""]
    for length, regime, pressure in _tables(runs):
        rows = [r for r in runs if r["prompt_tokens_asked"] == length
                and ((r["pressure"] == pressure and r.get("regime") == regime) or not r["link_gbps"])]
        lines += [f"## {length} tokens, R = {pressure:g}, {regime}-matched link", "",
                  "| mode | n | TTFT p50 | TTST mean / p50 | TTST bound p50 | TBT mean | E2E p50 | CTL 2 / 8 / 32 / 64 | t64 − t1 | MB per path | local share (step 1) | TTST ÷ bound | TTST ÷ full | TTST ÷ colocated-selective | TBT ÷ colocated-selective | own step (÷ colocated-selective) | CPU ms/step: decode / prefill / machine | same tokens (prefix) | KL vs dense (agreement) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            ctl = " / ".join(_f(r["ctl_s"].get(str(i)), 2) for i in (2, 8, 32, 64))
            paths = ", ".join(f"{p} {_mb(r['kv_bytes'].get(p))}" for p in PATHS if r["kv_bytes"].get(p))
            share = f"{_f(r['local_share'], 2)} ({_f(r['step1_local_share'], 2)})" if r["local_share"] is not None else "—"
            lines.append(f"| {r['mode']} | {r['n']} | {_f(r['ttft_p50_s'], 2)} | {_f(r['ttst_mean_s'])} / {_f(r['ttst_p50_s'])} | "
                         f"{_f(r.get('ttst_bound_p50_s'))} | {_f(r['tbt_mean_s'])} | {_f(r['e2e_p50_s'], 2)} | {ctl} | "
                         f"{_f(r.get('decode_s_mean'), 2)} | {paths or '—'} | {share} | {_f(r.get('ttst_vs_bound'), 2)} | {_f(r['ttst_vs_full'], 2)} | "
                         f"{_f(r.get('ttst_vs_colocated_selective'), 2)} | {_f(r['tbt_vs_colocated_selective'], 2)} | "
                         f"{_f(r.get('tbt_own_mean_s'))} ({_f(r.get('tbt_own_vs_colocated_selective'), 2)}) | {_cpu(r)} | "
                         f"{_agreement(r)} | {_quality(r)} |")
        lines.append("")
    lines.append("Times in seconds on the client's clock. n = requests in the row (p99 is reported from 20). "
                 "CTL(i) = time of token i from arrival; TTST = t2 − t1; TBT = mean gap from token 2 on; t64 − t1 = the decode "
                 "phase without TTFT's spread; own step = the decode worker's torch thread's CPU time per step plus its "
                 "waits on the link, from token 2 on: the step without what other processes on this machine's shared "
                 "cores took from it (tools/bench/summary.py `own_step_s`); CPU ms/step: what the decode worker, the "
                 "prefill worker and the whole machine spent per step of the decode phase (tools/bench/cpu_window.py); TTST bound = colocated-selective's step 1 on the same prompt (colocated's "
                 "for a dense mode) plus the step-1 bytes the prefill could not hide (docs/api.md, `ttst_bound_s`). "
                 "KL vs dense: mean KL(dense ‖ row) per next token in nats, teacher-forced along dense's answer on the "
                 "same prompts, and in brackets the share of positions with dense's top token (a smartgen row with low-bit "
                 "KV, its default K8V8 included: its selector over every entry's record, tools/eval/paired.py). "
                 "Same tokens: the share of requests whose answer equals the same prompt's all local "
                 "(colocated-selective for a selective mode, colocated for a dense one, where the run has it), and in "
                 "brackets the mean share of the answer before the first difference.")
    return "\n".join(lines) + "\n"


def _cpu(run: dict) -> str:
    cpu = run.get("decode_cpu_ms_per_step") or {}
    return " / ".join(_f(cpu.get(role), 0) for role in ("decode", "prefill", "machine")) if cpu else "—"


def _quality(run: dict) -> str:
    if run.get("kl_mean") is None:
        return "—"
    return f"{run['kl_mean']:.4f} ({_f(run.get('agreement_mean'), 3)})"


def _agreement(run: dict) -> str:
    if run.get("same_tokens") is None:
        return "—"
    return f"{run['same_tokens']:.2f} ({run['matched_prefix']:.2f})"


def _tables(runs: list[dict]) -> list[tuple[int, str, float]]:
    """(prompt length, regime, R) of every paced setting, in order."""
    return sorted({(r["prompt_tokens_asked"], r.get("regime", "prefill"), r["pressure"]) for r in runs
                   if r["pressure"] and r["link_gbps"]})


def _profile_line(report: dict) -> str:
    """Where the profiles came from: built per bucket on documents the run does not measure, or none."""
    built = report.get("profiles") or {}
    if not built:
        return "Profiles: the stack's stored ones, or the positional fallback (none built for this run)."
    parts = [f"{length} tokens → bucket {bucket} ({b.get('num_prompts', '?')} × {b.get('calibration_task', '?')}, "
             f"version {b.get('version', '?')})" for length, buckets in built.items() for bucket, b in buckets.items()]
    return ("Profiles built before measuring on documents no row measures, online updates frozen while measuring "
            "(except a `smartgen-online` row): " + "; ".join(parts) + ".")


def plots(report: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, written = report["runs"], []
    for length in sorted({r["prompt_tokens_asked"] for r in runs}):
        every = [r for r in runs if r["prompt_tokens_asked"] == length]
        for _, regime, pressure in [t for t in _tables(runs) if t[0] == length]:  # CTL per token index per mode
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for r in every:
                if ((r["pressure"] == pressure and r.get("regime") == regime) or not r["link_gbps"]) and r["ctl_curve_s"]:
                    ax.plot(range(1, len(r["ctl_curve_s"]) + 1), r["ctl_curve_s"], label=r["mode"],
                            linestyle="--" if not r["link_gbps"] else "-")
            ax.set(xlabel="token index", ylabel="cumulative token latency (s)",
                   title=f"CTL, {length} tokens, R = {pressure:g}, {regime}-matched")
            ax.legend(fontsize=7)
            written.append(_save(fig, out / f"ctl_{length}_{regime}_R{pressure:g}.png"))
        # NOTE: the remaining plots show the prefill-matched regime (TTST's), or the only one run, and the references
        shown = "prefill" if any(r.get("regime") == "prefill" for r in every) else next(
            (r.get("regime") for r in every if r["link_gbps"]), "prefill")
        at = [r for r in every if r.get("regime", "prefill") == shown or not r["link_gbps"]]
        pressures = sorted({r["pressure"] for r in at if r["pressure"]})
        if pressures:  # TTST per mode against R
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for mode in dict.fromkeys(r["mode"] for r in at):
                points = sorted((r["pressure"], r["ttst_p50_s"]) for r in at if r["mode"] == mode and r["pressure"])
                if points:
                    ax.plot([p for p, _ in points], [t for _, t in points], marker="o", label=mode)
                else:  # unpaced reference: a horizontal line
                    ref = next(r for r in at if r["mode"] == mode)
                    ax.axhline(ref["ttst_p50_s"], linestyle="--", linewidth=1, label=f"{mode} (no transfer)")
            ax.set(xlabel="R = T_full_transfer / T_prefill", ylabel="TTST p50 (s)", yscale="log", title=f"TTST, {length} tokens")
            ax.legend(fontsize=7)
            written.append(_save(fig, out / f"ttst_by_pressure_{length}.png"))
        bars = [r for r in at if r["mode"] in ABLATIONS]
        if bars:  # ablation bars
            fig, axes = plt.subplots(1, 2, figsize=(10, 4))
            for ax, key, label in ((axes[0], "ttst_p50_s", "TTST p50 (s)"), (axes[1], "tbt_mean_s", "TBT (s)")):
                for i, pressure in enumerate(pressures):
                    rows = [r for r in bars if r["pressure"] == pressure]
                    ax.bar([j + i * 0.4 for j in range(len(rows))], [r[key] or 0 for r in rows], width=0.4, label=f"R = {pressure:g}")
                    ax.set_xticks(range(len(rows)), [r["mode"].replace("smartgen-", "") for r in rows], fontsize=8)
                ax.set(ylabel=label)
                ax.legend(fontsize=7)
            fig.suptitle(f"Ablation, {length} tokens")
            written.append(_save(fig, out / f"ablation_{length}.png"))
        front = [r for r in every if r.get("kl_mean") is not None and r.get("ctl64_mean_s")]
        for _, regime, pressure in [t for t in _tables(runs) if t[0] == length]:  # CTL64 against KL: the front
            points = [r for r in front if (r["pressure"] == pressure and r.get("regime") == regime) or not r["link_gbps"]]
            if points:
                fig, ax = plt.subplots(figsize=(6, 4.5))
                for r in points:
                    ax.scatter(r["kl_mean"] + 1e-5, r["ctl64_mean_s"], marker="o" if r["link_gbps"] else "x")
                    ax.annotate(r["mode"], (r["kl_mean"] + 1e-5, r["ctl64_mean_s"]), fontsize=7)
                ax.set(xscale="log", xlabel="KL vs dense (nats per token, +1e-5)", ylabel="CTL64 mean (s)",
                       title=f"Latency × quality, {length} tokens, R = {pressure:g}, {regime}-matched")
                written.append(_save(fig, out / f"pareto_{length}_{regime}_R{pressure:g}.png"))
        fig, ax = plt.subplots(figsize=(9, 4.5))  # bytes per path
        rows = [r for r in at if r["kv_bytes"]]
        bottom = [0.0] * len(rows)
        for path in PATHS:
            heights = [(r["kv_bytes"].get(path) or 0) / 1e6 for r in rows]
            if any(heights):
                ax.bar(range(len(rows)), heights, bottom=bottom, label=path)
                bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(range(len(rows)), [f"{r['mode']}\nR={_f(r['pressure'], 1)}" for r in rows], fontsize=6, rotation=45)
        ax.set(ylabel="MB per request", title=f"Bytes per path, {length} tokens")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / f"bytes_{length}.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write(report: dict, out: Path) -> str:
    add_ratios(report["runs"])
    text = markdown(report)
    (out / "report.md").write_text(text)
    plots(report, out)
    return text


def write_concurrency(reports: dict[int, dict], out: Path) -> str:
    """The batch-size table and figure of a run at several concurrencies (`bench serve --concurrency 1,2,4,8`):
    per mode and setting, output tokens/s, TTST and TBT p50 at each concurrency, and their ratios to the lowest.
    Writes concurrency.md and batch_size.png into `out`; returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted(reports)
    settings: dict[tuple, dict[int, dict]] = {}
    for level in levels:
        for r in reports[level]["runs"]:
            settings.setdefault((r["mode"], r["prompt_tokens_asked"], r.get("regime"), r["pressure"]), {})[level] = r
    lines = [f"Concurrency {', '.join(map(str, levels))}: each a whole run (c<C>/report.md); ratios against "
             f"concurrency {levels[0]} in the same stack.", "",
             "| mode | prompt | regime | R | concurrency | n | output tok/s | ÷ lowest | TTST p50 s | TBT p50 s | ÷ lowest |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (mode, length, regime, pressure), by_level in sorted(settings.items(), key=lambda kv: tuple(map(str, kv[0]))):
        base = by_level.get(levels[0])
        for level in levels:
            r = by_level.get(level)
            if r is None:
                continue
            tput, tbt = r.get("output_tokens_per_s"), r.get("tbt_p50_s")
            lines.append(f"| {mode} | {length} | {regime} | {_f(pressure, 2)} | {level} | {r['n']} | {_f(tput, 1)} | "
                         f"{_f(tput / base['output_tokens_per_s'], 2) if base and tput and base.get('output_tokens_per_s') else '—'} | "
                         f"{_f(r.get('ttst_p50_s'))} | {_f(tbt)} | "
                         f"{_f(tbt / base['tbt_p50_s'], 2) if base and tbt and base.get('tbt_p50_s') else '—'} |")
        label = f"{mode} {length} R={_f(pressure, 2)}" + (f" ({regime})" if pressure else "")
        xs = [lv for lv in levels if lv in by_level]
        axes[0].plot(xs, [by_level[lv].get("output_tokens_per_s") or 0 for lv in xs], marker="o", label=label)
        axes[1].plot(xs, [by_level[lv].get("tbt_p50_s") or 0 for lv in xs], marker="o", label=label)
    for ax, title in zip(axes, ("output tokens/s", "TBT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(lv) for lv in levels])
        ax.set_xlabel("requests in flight")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    _save(fig, out / "batch_size.png")
    text = "\n".join(lines) + "\n"
    (out / "concurrency.md").write_text(text)
    return text
