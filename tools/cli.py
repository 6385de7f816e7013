"""The `smartgen` command.

    smartgen up [--prefill N] [--decode M] [--model PATH] [--transfer-mode MODE] [--link-gbps X]
    smartgen bench transport|decode-step|serve [--json PATH]
    smartgen loadtest [--url URL | --model PATH --prefill N --decode M] [--concurrency 16] [--duration 300] …
    smartgen prepare-selectors [--selector all|infinigen|hata]
    smartgen profile build|list|show|delete [--selector S] [--prompt-tokens L] [KEY]
    smartgen eval fidelity [--selector S…] [--budget B…] [--json PATH]
    smartgen model prepare | path
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from schemas import SERVABLE_TRANSFER_MODES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="smartgen", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start NATS and all five services; Ctrl-C stops everything")
    up.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill replicas (default 1)")
    up.add_argument("--decode", type=int, default=1, metavar="M", help="decode replicas (default 1)")
    up.add_argument("--model", default=os.environ.get("SMARTGEN_MODEL", ""), help="a transformers model folder (default: SmolLM2-135M-Instruct)")
    up.add_argument("--transfer-mode", default=os.environ.get("SMARTGEN_TRANSFER_MODE", "full"), choices=SERVABLE_TRANSFER_MODES)
    up.add_argument("--link-gbps", type=float, default=float(os.environ.get("SMARTGEN_LINK_GBPS", "0")),
                    help="pace every data-plane link to this many Gbit/s (emulates a slow NIC; 0 = unpaced)")
    up.add_argument("--port", type=int, default=int(os.environ.get("SMARTGEN_GATEWAY_PORT", "8000")), help="gateway port")
    bench = sub.add_parser("bench", help="measurements (not tests); each accepts --json PATH")
    what = bench.add_subparsers(dest="what", required=True)
    transport = what.add_parser("transport", help="data-plane throughput, scattered reads, lanes, pacing (~30 s)")
    transport.add_argument("--json", metavar="PATH", help="also write the results here")
    step = what.add_parser("decode-step", help="decode-step time, dense against each selector")
    step.add_argument("--json", metavar="PATH")
    step.add_argument("--context", type=int, default=4096, help="context length")
    step.add_argument("--budget", type=float, default=0.1, help="KV budget")
    serve = what.add_parser("serve", help="every transfer mode through the OpenAI API at chosen link pressures")
    serve.add_argument("--modes", type=_csv(str), default=None, help="comma-separated (default: all but auto)")
    serve.add_argument("--pressure", type=_csv(float), default=[2.0, 6.5], metavar="R[,R…]",
                       help="R = T_full_transfer / T_prefill, measured here (default 2,6.5)")
    serve.add_argument("--link-gbps", type=_csv(float), default=[], metavar="X[,X…]", help="explicit rates instead")
    serve.add_argument("--prompt-tokens", type=_csv(int), default=[2048, 4096], metavar="L[,L…]")
    serve.add_argument("--requests", type=int, default=3, help="requests per mode and setting")
    serve.add_argument("--concurrency", type=int, default=1)
    serve.add_argument("--selector", default="quest")
    serve.add_argument("--kv-budget", type=float, default=0.1)
    serve.add_argument("--max-tokens", type=int, default=64)
    serve.add_argument("--tasks", type=_csv(str), default=None, help="workloads (default: all five LongBench stand-ins)")
    serve.add_argument("--url", default="", help="a running gateway (default: start a stack)")
    serve.add_argument("--model", default=os.environ.get("SMARTGEN_MODEL", ""))
    serve.add_argument("--out", default="bench-out", help="folder for runs.json, report.md and the plots")
    serve.add_argument("--json", metavar="PATH", help="runs.json somewhere else")
    serve.add_argument("--profile-prompts", type=int, default=0, metavar="N",
                       help="first build the selector's profile per prompt length from N calibration prompts "
                            "(default 0: the stack's stored profiles, or the positional fallback)")
    load = sub.add_parser("loadtest", help="concurrent streaming clients for a fixed time: errors, latency, memory, leaks")
    load.add_argument("--url", default="", help="a running gateway on this machine (default: start a stack)")
    load.add_argument("--model", default=os.environ.get("SMARTGEN_MODEL", ""), help="the started stack's model")
    load.add_argument("--prefill", type=int, default=1, metavar="N", help="the started stack's prefill replicas")
    load.add_argument("--decode", type=int, default=1, metavar="M", help="the started stack's decode replicas")
    load.add_argument("--concurrency", type=int, default=16, help="clients, one streaming request in flight each")
    load.add_argument("--duration", type=float, default=300, help="seconds")
    load.add_argument("--max-tokens", type=int, default=32)
    load.add_argument("--prompt-tokens", type=int, default=256, help="approximate prompt length")
    load.add_argument("--transfer-mode", nargs="+", default=[], choices=SERVABLE_TRANSFER_MODES, help="used in turn")
    load.add_argument("--grace", type=float, default=10, help="seconds in-flight requests get after the deadline")
    load.add_argument("--json", metavar="PATH", help="also write the full result here")
    prep = sub.add_parser("prepare-selectors", help="offline preparation for infinigen and hata, next to the model")
    prep.add_argument("--selector", choices=["all", "infinigen", "hata"], default="all")
    prep.add_argument("--model", default=os.environ.get("SMARTGEN_MODEL", ""), help="model folder (default SmolLM2)")
    prep.add_argument("--num-prompts", type=int, default=4)
    prep.add_argument("--prompt-tokens", type=int, default=1024)
    prep.add_argument("--out", help="write here instead of <model>/smartgen-selectors")
    prof = sub.add_parser("profile", help="positional importance profiles in a running stack's kvprofile service")
    prof.add_argument("action", choices=["build", "list", "show", "delete"])
    prof.add_argument("key", nargs="?", help="show/delete: the profile key (see `smartgen profile list`)")
    prof.add_argument("--selector", default="quest")
    prof.add_argument("--prompt-tokens", type=int, default=2048, help="calibration prompt length (sets the bucket)")
    prof.add_argument("--num-prompts", type=int, default=4)
    prof.add_argument("--decode-steps", type=int, default=16)
    prof.add_argument("--kv-budget", type=float, default=0.1)
    ev = sub.add_parser("eval", help="quality evaluations; each accepts --json PATH")
    which = ev.add_subparsers(dest="what", required=True)
    fid = which.add_parser("fidelity", help="each selector against dense attention, all KV local (in process)")
    fid.add_argument("--selector", nargs="+", default=["oracle", "infinigen", "hata", "quest", "positional"])
    fid.add_argument("--budget", nargs="+", type=float, default=[0.05, 0.1, 0.2])
    fid.add_argument("--model", default=os.environ.get("SMARTGEN_MODEL", ""))
    fid.add_argument("--num-docs", type=int, default=2)
    fid.add_argument("--prompt-tokens", type=int, default=2048)
    fid.add_argument("--tokens", type=int, default=64, help="teacher-forced continuation tokens per document")
    fid.add_argument("--tasks", nargs="+", default=["lcc_stdlib", "needle", "squad_docqa", "aclsum_report"])
    fid.add_argument("--json", metavar="PATH")
    acc = which.add_parser("accuracy", help="LongBench task scores through the serving path, per mode and selector")
    acc.add_argument("--modes", type=_csv(str), default=None, help="comma-separated (default: every mode but the ablations)")
    acc.add_argument("--selector", nargs="+", default=["quest"], help="for the selective modes")
    acc.add_argument("--kv-budget", type=float, default=0.1)
    acc.add_argument("--tasks", nargs="+", default=None, help="workloads (default: all five LongBench stand-ins)")
    acc.add_argument("--samples", type=int, default=4, help="samples per task")
    acc.add_argument("--prompt-tokens", type=int, default=2048)
    acc.add_argument("--link-gbps", type=float, default=0.0, help="pace the data plane (0 = unpaced; tokens do not depend on it)")
    acc.add_argument("--url", default="", help="a running gateway (default: start a stack)")
    acc.add_argument("--model", default=os.environ.get("SMARTGEN_MODEL", ""))
    acc.add_argument("--out", default="eval-out")
    acc.add_argument("--json", metavar="PATH")
    sim = sub.add_parser("simulate", help="project TTST/TBT/CTL to the paper's GPU cluster from a local bench run")
    sim.add_argument("--runs", metavar="RUNS_JSON", help="a `bench serve` runs.json to calibrate local hit rates with")
    sim.add_argument("--models", type=_csv(str), default=["Llama-3.1-8B", "Qwen3-14B"])
    sim.add_argument("--gbps", type=_csv(float), default=[15.0, 25.0, 32.0])
    sim.add_argument("--prompt-tokens", type=_csv(int), default=[8192, 16384, 32768, 49152])
    sim.add_argument("--batch", type=_csv(int), default=[1, 6])
    sim.add_argument("--prefix-hit", type=float, default=0.0, help="share of each prompt served by a prefix cache")
    sim.add_argument("--kv-budget", type=float, default=0.1)
    sim.add_argument("--json", metavar="PATH")
    model = sub.add_parser("model", help="the default model's cached safetensors folder")
    model.add_argument("action", choices=["prepare", "path"])
    model.add_argument("--force", action="store_true", help="convert again even if the folder exists")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so a benchmark's own stack is stopped by its `finally` (`up` has its own handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.command == "up":
        sys.exit(_up(args))
    if args.command == "bench":
        if args.what == "transport":
            from tools.bench import transport

            transport.run(args.json)
        elif args.what == "decode-step":
            from tools.bench import decode_step

            decode_step.run(context=args.context, budget=args.budget, json_path=args.json)
        else:
            from tools.bench import serve

            cfg = serve.BenchConfig(pressures=args.pressure, link_gbps=args.link_gbps, prompt_tokens=args.prompt_tokens,
                                    requests=args.requests, concurrency=args.concurrency, selector=args.selector,
                                    kv_budget=args.kv_budget, max_tokens=args.max_tokens, url=args.url, model=args.model,
                                    out=args.out, json_path=args.json or "", profile_prompts=args.profile_prompts)
            if args.modes:
                cfg.modes = args.modes
            if args.tasks:
                cfg.tasks = args.tasks
            serve.run(cfg)
        return
    if args.command == "loadtest":
        from tools import loadtest

        sys.exit(loadtest.main(args))
    if args.command == "eval":
        if args.what == "fidelity":
            from tools.eval import fidelity

            fidelity.run(args)
        else:
            from tools.eval import accuracy

            accuracy.run(args.modes or list(accuracy.DEFAULT_MODES), args.selector, args.kv_budget,
                         args.tasks or list(accuracy.DEFAULT_TASKS), args.samples, args.prompt_tokens, args.link_gbps,
                         args.url, args.model, args.out, args.json or "")
        return
    if args.command == "simulate":
        from tools.bench import simulate

        simulate.run(args.runs, args.models, args.gbps, args.prompt_tokens, args.batch, args.prefix_hit, args.kv_budget,
                     args.json)
        return
    if args.command == "profile":
        from tools import profiles

        sys.exit(profiles.run(args))
    if args.command == "prepare-selectors":
        from tools import prepare_selectors

        prepare_selectors.run(args.model, args.selector, args.num_prompts, args.prompt_tokens, args.out)
        return
    if args.command == "model":
        from shared.models import default_model_path, prepare_default_model

        print(prepare_default_model(force=args.force) if args.action == "prepare" else default_model_path())


def _csv(kind):
    """argparse type: "a,b,c" → [kind(a), kind(b), kind(c)]."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None
    return parse


def _up(args: argparse.Namespace) -> int:
    from shared.models import ModelNotFound, prepare_default_model, resolve_model
    from tools.stack import Stack, StackSpec

    if args.prefill < 1 or args.decode < 1:
        print("smartgen up: --prefill and --decode must be at least 1", file=sys.stderr)
        return 2
    try:
        if not args.model:
            prepare_default_model()
        resolve_model(args.model)
    except ModelNotFound as exc:
        print(f"smartgen up: {exc}", file=sys.stderr)
        return 2
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    env = {"SMARTGEN_LINK_GBPS": str(args.link_gbps)} if args.link_gbps else {}
    stack = Stack(StackSpec(args.prefill, args.decode, args.model, args.transfer_mode, args.port,
                            nats_url=os.environ.get("SMARTGEN_NATS_URL", ""), env=env))
    stack.start()
    print(f"smartgen: NATS at {stack.nats_url}; starting {args.prefill} prefill + {args.decode} decode workers…", flush=True)
    # NOTE: paths to the secrets (mode 0600), never the secrets: tools and admin routes need these settings
    print("smartgen: for tools and admin routes: export " + " ".join(f"{k}={v}" for k, v in stack.client_env().items()),
          flush=True)
    code = 0
    try:
        ready = False
        while not stop["now"]:
            dead = stack.dead()
            if dead:
                print(f"smartgen: {', '.join(dead)} exited; stopping the stack", file=sys.stderr, flush=True)
                code = 1
                break
            if not ready and stack.health().get("status") == "ok":
                ready = True
                print(f"smartgen: ready — OpenAI API at {stack.gateway_url}/v1 (Ctrl-C stops)", flush=True)
            time.sleep(0.25)
    finally:
        print("smartgen: stopping…", flush=True)
        codes = stack.stop()
        print("smartgen: stopped " + ", ".join(f"{k}={v}" for k, v in codes.items()), flush=True)
    return code
