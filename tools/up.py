"""`smartgen up`: NATS (embedded unless SMARTGEN_NATS_URL names one) and all five services as local processes
(tools/stack.py), in the foreground until Ctrl-C or SIGTERM. A service that dies is restarted with backoff
while the rest keep serving (tools/supervisor.py); one that keeps dying at start-up stops the stack.

    smartgen up [--prefill N] [--decode M] [--model PATH] [--transfer-mode MODE] [--link-gbps X]
                [--prefix-cache-mb MB] [--decode-prefix-cache-mb MB] [--port P]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from schemas import SERVABLE_TRANSFER_MODES
from tools.args import add_model


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `up` to the `smartgen` sub-commands."""
    up = subparsers.add_parser("up", help="start NATS and all five services; Ctrl-C stops everything")
    up.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill replicas (default 1)")
    up.add_argument("--decode", type=int, default=1, metavar="M", help="decode replicas (default 1)")
    add_model(up, "a transformers model folder (default: SmolLM2-135M-Instruct)")
    up.add_argument("--transfer-mode", default=os.environ.get("SMARTGEN_TRANSFER_MODE", "full"),
                    choices=SERVABLE_TRANSFER_MODES)
    up.add_argument("--link-gbps", type=float, default=float(os.environ.get("SMARTGEN_LINK_GBPS", "0")),
                    help="pace every data-plane link to this many Gbit/s (emulates a slow NIC; 0 = unpaced)")
    up.add_argument("--prefix-cache-mb", type=int, default=None, metavar="MB",
                    help="host memory for each prefill worker's prefix cache (KV of earlier prompts' pages, reused by "
                         "prompts that start the same way); 0 turns it off (default: SMARTGEN_PREFIX_CACHE_MB, else 1024)")
    up.add_argument("--decode-prefix-cache-mb", type=int, default=None, metavar="MB",
                    help="host memory for each decode worker's prefix cache (KV of finished full-mode requests' prompts, so "
                         "a conversation's next turn moves only its latest answer and question); 0 turns it off (default: "
                         "SMARTGEN_DECODE_PREFIX_CACHE_MB, else 1024)")
    up.add_argument("--port", type=int, default=int(os.environ.get("SMARTGEN_GATEWAY_PORT", "8000")), help="gateway port")
    up.add_argument("--api-key", default="", help="require this key on the OpenAI API (/v1: 'Authorization: Bearer "
                                                  "<key>', the openai SDK's api_key); SMARTGEN_API_KEY or "
                                                  "SMARTGEN_API_KEY_FILE work too (default: open)")
    up.set_defaults(run=command)


def command(args: argparse.Namespace) -> int:
    """Run the stack until Ctrl-C/SIGTERM (exit code 0) or until the supervisor gives up on a service that keeps
    dying at start-up (1); 2 for bad arguments or a missing model."""
    from shared.runtime.models import ModelNotFound, prepare_default_model, resolve_model
    from shared.runtime.config import write_secret_file
    from shared.runtime.service import SHUTDOWN_GRACE_S
    from tools.stack import Stack, StackSpec
    from tools.supervisor import Supervisor

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
    if args.prefix_cache_mb is not None:
        env["SMARTGEN_PREFIX_CACHE_MB"] = str(args.prefix_cache_mb)
    if args.decode_prefix_cache_mb is not None:
        env["SMARTGEN_DECODE_PREFIX_CACHE_MB"] = str(args.decode_prefix_cache_mb)
    if args.api_key:  # NOTE: to the gateway as a file (mode 0600), never in an environment or a command line
        key_file = Path(tempfile.mkdtemp(prefix="smartgen-api-")) / "api-key"
        write_secret_file(key_file, args.api_key)
        env["SMARTGEN_API_KEY_FILE"] = str(key_file)
    stack = Stack(StackSpec(args.prefill, args.decode, args.model, args.transfer_mode, args.port,
                            nats_url=os.environ.get("SMARTGEN_NATS_URL", ""), env=env))
    stack.start()
    print(f"smartgen: NATS at {stack.nats_url}; starting {args.prefill} prefill + {args.decode} decode workers…", flush=True)
    # NOTE: paths to the secrets (mode 0600), never the secrets: tools and admin routes need these settings
    print("smartgen: for tools and admin routes: export " + " ".join(f"{k}={v}" for k, v in stack.client_env().items()),
          flush=True)
    backoff = tuple(float(x) for x in os.environ.get("SMARTGEN_RESTART_BACKOFF_S", "").split(",") if x.strip())
    supervisor = Supervisor(stack, say=lambda text: print(f"smartgen: {text}", file=sys.stderr, flush=True),
                            **({"backoff_s": backoff} if backoff else {}))
    code = 0
    try:
        ready = False
        while not stop["now"]:
            if gave_up := supervisor.poll():
                print(f"smartgen: {gave_up}; stopping the stack", file=sys.stderr, flush=True)
                code = 1
                break
            if not ready and stack.health().get("status") == "ok":
                ready = True
                print(f"smartgen: ready — OpenAI API at {stack.gateway_url}/v1 (Ctrl-C stops)", flush=True)
            time.sleep(0.25)
    finally:
        print("smartgen: stopping…", flush=True)
        codes = stack.stop(timeout_s=_drain_s() + SHUTDOWN_GRACE_S + 5)  # services drain first, then stop
        if args.api_key:
            shutil.rmtree(key_file.parent, ignore_errors=True)
        print("smartgen: stopped " + ", ".join(f"{k}={v}" for k, v in codes.items()), flush=True)
    return code


def _drain_s() -> float:
    """How long the services may drain (ServiceConfig.drain_s: SMARTGEN_DRAIN_S, else its default)."""
    from shared.runtime.config import ServiceConfig, env_name

    default = next(f.default for f in dataclasses.fields(ServiceConfig) if f.name == "drain_s")
    try:
        return float(os.environ.get(env_name("drain_s"), default))
    except ValueError:  # the services refuse it themselves, with the reason
        return float(default)
