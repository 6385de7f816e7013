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
    up.add_argument("--config", metavar="PATH", help="a TOML settings file for every service (also SMARTGEN_CONFIG; "
                    "`smartgen config show` prints what it sets); these flags and SMARTGEN_* env win over it")
    # NOTE: None = not given: the services then take SMARTGEN_* env, else the settings file, else their default
    up.add_argument("--transfer-mode", choices=SERVABLE_TRANSFER_MODES,
                    help="the mode of requests that name none (SMARTGEN_TRANSFER_MODE; default full)")
    up.add_argument("--link-gbps", type=float, help="pace every data-plane link to this many Gbit/s (emulates a slow "
                                                    "NIC; SMARTGEN_LINK_GBPS; default 0 = unpaced)")
    up.add_argument("--port", type=int, help="the gateway's port, the OpenAI API (SMARTGEN_GATEWAY_PORT; default 8000)")
    up.add_argument("--vllm-metrics", action="store_true", default=None,
                    help="the gateway's /metrics also under vLLM's names (vllm:*), for vLLM's dashboards "
                         "(SMARTGEN_VLLM_METRICS; default off)")
    up.add_argument("--prefix-cache-mb", type=int, default=None, metavar="MB",
                    help="host memory for each prefill worker's prefix cache (KV of earlier prompts' pages, reused by "
                         "prompts that start the same way); 0 turns it off (SMARTGEN_PREFIX_CACHE_MB; default 1024)")
    up.add_argument("--decode-prefix-cache-mb", type=int, default=None, metavar="MB",
                    help="host memory for each decode worker's prefix cache (KV of finished full-mode requests' prompts, so "
                         "a conversation's next turn moves only its latest answer and question); 0 turns it off "
                         "(SMARTGEN_DECODE_PREFIX_CACHE_MB; default 1024)")
    up.add_argument("--api-key", default="", help="require this key on the OpenAI API (/v1: 'Authorization: Bearer "
                                                  "<key>', the openai SDK's api_key); SMARTGEN_API_KEY or "
                                                  "SMARTGEN_API_KEY_FILE work too (default: open)")
    up.add_argument("--metrics-port", type=int, default=None, metavar="P",
                    help="where `smartgen up` serves its supervisor's /metrics: each service up, given up on, its "
                         "backoff and restarts (SMARTGEN_SUPERVISOR_METRICS_PORT; default 0 = a free port, on loopback; "
                         "the stack_ready event gives the URL)")
    up.set_defaults(run=command)


def command(args: argparse.Namespace) -> int:
    """Run the stack until Ctrl-C/SIGTERM (exit code 0) or until the supervisor gives up on a service that keeps
    dying at start-up (1); 2 for bad arguments or a missing model."""
    from shared.runtime.config import CONFIG_ENV, ConfigError, write_secret_file
    from shared.runtime.logging import setup_logging
    from shared.runtime.models import ModelNotFound, prepare_default_model, resolve_model
    from shared.runtime.service import SHUTDOWN_GRACE_S
    from tools.settings import checked_settings
    from tools.stack import Stack, StackSpec
    from tools.supervisor import Supervisor
    from tools.supervisor_metrics import serve_metrics

    # NOTE: this process's own lines are JSON events too, as the services' are: the whole stack's output parses
    log = setup_logging("smartgen", "up")
    if args.prefill < 1 or args.decode < 1:
        log.error("bad_arguments", message="--prefill and --decode must be at least 1")
        return 2
    config_path = str(Path(args.config).resolve()) if args.config else os.environ.get(CONFIG_ENV, "")
    try:
        if config_path:  # every role's check, before anything starts (a service alone checks only its own)
            checked_settings({**os.environ, CONFIG_ENV: config_path})
        model = args.model or _setting(config_path, "model", "")
        port = int(args.port or _setting(config_path, "gateway_port", 8000))
    except (ConfigError, ValueError) as exc:
        log.error("config_error", message=str(exc))
        return 2
    try:
        if not model:
            prepare_default_model()
        resolve_model(model)
    except ModelNotFound as exc:
        log.error("model_not_found", message=str(exc))
        return 2
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    env = {CONFIG_ENV: config_path} if config_path else {}
    if args.link_gbps is not None:
        env["SMARTGEN_LINK_GBPS"] = str(args.link_gbps)
    if args.vllm_metrics:
        env["SMARTGEN_VLLM_METRICS"] = "true"
    if args.prefix_cache_mb is not None:
        env["SMARTGEN_PREFIX_CACHE_MB"] = str(args.prefix_cache_mb)
    if args.decode_prefix_cache_mb is not None:
        env["SMARTGEN_DECODE_PREFIX_CACHE_MB"] = str(args.decode_prefix_cache_mb)
    if args.api_key:  # NOTE: to the gateway as a file (mode 0600), never in an environment or a command line
        key_file = Path(tempfile.mkdtemp(prefix="smartgen-api-")) / "api-key"
        write_secret_file(key_file, args.api_key)
        env["SMARTGEN_API_KEY_FILE"] = str(key_file)
    stack = Stack(StackSpec(args.prefill, args.decode, model, args.transfer_mode or "", port,
                            nats_url=os.environ.get("SMARTGEN_NATS_URL", ""), env=env))
    stack.start()
    log.info("stack_starting", nats_url=stack.nats_url, num_prefill=args.prefill, num_decode=args.decode)
    # NOTE: paths to the secrets (mode 0600), never the secrets: tools and admin routes need these settings
    exports = " ".join(f"{k}={v}" for k, v in stack.client_env().items())
    log.info("stack_client_env", env=stack.client_env(), message=f"for tools and admin routes: export {exports}")
    backoff = tuple(float(x) for x in os.environ.get("SMARTGEN_RESTART_BACKOFF_S", "").split(",") if x.strip())
    supervisor = Supervisor(stack, say=lambda text: log.warning("supervisor", message=text),
                            **({"backoff_s": backoff} if backoff else {}))
    metrics_port = args.metrics_port if args.metrics_port is not None \
        else int(os.environ.get("SMARTGEN_SUPERVISOR_METRICS_PORT") or 0)
    try:
        metrics_server = serve_metrics(supervisor, port=metrics_port)
    except OSError as exc:
        log.error("supervisor_metrics_port", message=f"cannot serve /metrics on port {metrics_port}: {exc}")
        stack.stop()
        return 2
    metrics_url = f"http://127.0.0.1:{metrics_server.server_address[1]}/metrics"
    log.info("supervisor_metrics", url=metrics_url)
    code = 0
    try:
        ready = False
        while not stop["now"]:
            if gave_up := supervisor.poll():
                log.error("stack_given_up", message=f"{gave_up}; stopping the stack")
                code = 1
                break
            if not ready and stack.health().get("status") == "ok":
                ready = True
                log.info("stack_ready", api_url=f"{stack.gateway_url}/v1", supervisor_metrics_url=metrics_url,
                         message="ready (Ctrl-C stops)")
            time.sleep(0.25)
    finally:
        log.info("stack_stopping")
        metrics_server.shutdown()
        codes = stack.stop(timeout_s=_drain_s(config_path) + SHUTDOWN_GRACE_S + 5)  # services drain first, then stop
        if args.api_key:
            shutil.rmtree(key_file.parent, ignore_errors=True)
        log.info("stack_stopped", exit_codes=codes)
    return code


def _drain_s(config_path: str) -> float:
    """How long the services may drain (ServiceConfig.drain_s: SMARTGEN_DRAIN_S, else the settings file, else its
    default)."""
    from shared.runtime.config import ServiceConfig

    default = next(f.default for f in dataclasses.fields(ServiceConfig) if f.name == "drain_s")
    try:
        return float(_setting(config_path, "drain_s", default))  # type: ignore[arg-type]
    except (TypeError, ValueError):  # the services refuse it themselves, with the reason
        return float(default)


def _setting(config_path: str, name: str, default: object) -> object:
    """A setting `smartgen up` itself needs (the model to check, the port to watch), as the gateway will read it:
    SMARTGEN_<NAME>, else the settings file (its [gateway] table, else its top level), else `default`."""
    from shared.runtime.config import env_name
    from shared.runtime.settings_file import read_settings_file

    if os.environ.get(env_name(name)):
        return os.environ[env_name(name)]
    data = read_settings_file(config_path) if config_path else {}
    return data.get("gateway", {}).get(name, data.get(name, default))
