"""`smartgen rolling-restart`: SIGTERM every service of a stack in turn while streams run, and check that no
request is lost and every one has its reference tokens (issue #35's goal; docs/failures.md, first row).

    smartgen rolling-restart [--model PATH] [--prefill 2] [--decode 2] [--gateways 2] [--streams 8]
                             [--max-tokens 48] [--services gateway,prefill,decode,broker,kvprofile] [--json PATH]

1. Starts its own stack (tools/stack.py; the tiny random-weight model unless --model names one) with two
   gateways, and a Supervisor (tools/supervisor.py) that starts each stopped service again, as `smartgen up` does.
2. Asks each of `streams` prompts alone in colocated mode (greedy): its reference tokens.
3. `streams` clients loop: a streamed full-mode completion under `failure_policy` `recompute`, held to its
   prompt's reference (tools/loadtest.py's check, near-tie flips of a batched fp32 sum reported apart).
   The clients are their own load balancer over the gateways: a request that a gateway refuses before it is
   admitted (a 503 — `draining` while that gateway stops — or a refused connection while it is down) goes to
   the next gateway, as docs/api.md asks of a client given a 503 with Retry-After. Such a retry is counted,
   never hidden; a request that fails after it was admitted is lost.
4. With every stream in flight, each service in turn (gateways, prefill and decode replicas, broker, kvprofile;
   not NATS) gets SIGTERM; the tool times its drain (SIGTERM → exit, whose code must be 0), waits until the
   supervisor's new process serves (registered, or the gateway's /ready), lets the streams run `settle_s`,
   and goes on to the next.
5. Then the clients finish the request they hold, and the stack's leak check runs (tools/leaks.py).
Exit code 0 only if no request was lost or got other tokens, every service drained with exit code 0 and came
back, and nothing leaked.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tools.args import add_json, add_model

ROLES = ("gateway", "prefill", "decode", "broker", "kvprofile")
# Refusals before admission that a client sends to another gateway (docs/api.md: a 503 says when to retry)
# "before a response": a refused connection, or a pooled keep-alive connection the stopping gateway closed as the
# request went out (the HTTP/1.1 race no server can close: clients retry it, as the openai SDK does by default)
RETRYABLE_PREFIXES = ("http 503", "connection error before a response")
RETRY_PAUSE_S = 0.1
MAX_RETRIES = 600  # ~a minute of refusals for one request: then it counts as lost


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `rolling-restart` to the `smartgen` sub-commands."""
    roll = subparsers.add_parser("rolling-restart", help="SIGTERM every service in turn under streaming load: "
                                 "no request may be lost or get other tokens")
    add_model(roll, "the stack's model (default: a tiny random-weight model made for the run)")
    roll.add_argument("--prefill", type=int, default=2, metavar="N", help="prefill replicas (default 2)")
    roll.add_argument("--decode", type=int, default=2, metavar="M", help="decode replicas (default 2)")
    roll.add_argument("--gateways", type=int, default=2, metavar="G", help="gateways (default 2)")
    roll.add_argument("--streams", type=int, default=8, help="concurrent streaming clients (default 8)")
    roll.add_argument("--max-tokens", type=int, default=48, help="tokens per completion (default 48)")
    roll.add_argument("--services", default=",".join(ROLES),
                      help=f"what to restart, in this order: roles (every replica) or processes such as decode-0 "
                           f"(default {','.join(ROLES)})")
    add_json(roll, "also write the full result here")
    roll.set_defaults(run=command)


@dataclass
class StreamsConfig:
    """A supervised stack and the streaming clients that `run_under_load` drives against it."""

    model: str = ""  # "" = a tiny random-weight model (tools/tiny_model.py), made in a temp folder
    num_prefill: int = 2
    num_decode: int = 2
    num_gateway: int = 2
    streams: int = 8
    max_tokens: int = 48
    prompt_tokens: int = 96  # approximate
    failure_policy: str = "recompute"
    back_timeout_s: float = 90.0  # a restarted service must serve again within this (after its drain)
    drain_s: float = 30.0  # SMARTGEN_DRAIN_S of every service
    worker_ttl_s: float = 2.0  # SMARTGEN_WORKER_TTL_S: how soon a gateway drops a worker gone quiet
    log_file: str = ""  # "" = a file in the temp folder
    json_path: str = ""


@dataclass
class RollConfig(StreamsConfig):
    services: tuple[str, ...] = ROLES  # roles (every replica, in the stack's order) or process names ("decode-0")
    settle_s: float = 1.0  # the streams run this long after a restarted service is back, before the next SIGTERM
    # False: the next SIGTERM as soon as the last service has exited (and `settle_s`), while it starts again; every
    # one must be back at the end. Shorter (a start is seconds of imports), and a restart meets another's start
    wait_back: bool = True


@dataclass
class Restart:
    """One service's SIGTERM, as the tool saw it. Times in seconds from the SIGTERM."""

    name: str
    in_flight: int  # streams in flight at the SIGTERM
    exit_code: int | None = None
    drained_s: float | None = None  # SIGTERM → the process exited
    back_s: float | None = None  # SIGTERM → its new process serves
    retries: dict[str, int] = field(default_factory=dict)  # refusals sent to the next gateway, SIGTERM → next SIGTERM
    lost: dict[str, int] = field(default_factory=dict)  # requests that failed (by kind), SIGTERM → next SIGTERM


@dataclass
class Roll:
    """The clients and the restarts of one run, and what they have seen."""

    outcomes: list = field(default_factory=list)  # tools.client.Outcome of each request, after any retries
    retries: dict[str, int] = field(default_factory=dict)  # refusal kind → times a request went to the next gateway
    restarts: list[Restart] = field(default_factory=list)
    num_in_flight: int = 0


async def client(index: int, load, roll: Roll, session, urls: list[str], stop: asyncio.Event) -> None:
    """One stream at a time until `stop`; a refusal before admission goes to the next gateway."""
    from tools.client import OK, stream_completion

    turn = index
    while not stop.is_set():
        body, prompt_index = load.next_body()
        roll.num_in_flight += 1
        try:
            for _ in range(MAX_RETRIES):
                outcome = await stream_completion(session, urls[turn % len(urls)], body, 120.0)
                turn += 1
                if not outcome.kind.startswith(RETRYABLE_PREFIXES):
                    break
                for counts in (roll.retries, *([roll.restarts[-1].retries] if roll.restarts else [])):
                    counts[outcome.kind] = counts.get(outcome.kind, 0) + 1
                await asyncio.sleep(RETRY_PAUSE_S)
        finally:
            roll.num_in_flight -= 1
        outcome = load.checked(outcome, body, prompt_index)
        roll.outcomes.append(outcome)
        if outcome.kind != OK and roll.restarts:
            lost = roll.restarts[-1].lost
            lost[outcome.kind] = lost.get(outcome.kind, 0) + 1


async def restart_each(stack, supervisor, roll: Roll, cfg: RollConfig, names: list[str]) -> None:
    """SIGTERM each of `names` in turn with every stream in flight; wait until it drained and (`wait_back`, else at
    the end) serves again."""
    pending: list[tuple[Restart, object, float]] = []  # (restart, its old process, its SIGTERM's time)
    for name in names:
        while roll.num_in_flight < cfg.streams:
            await _sleep(supervisor, 0.05)
        await _sleep(supervisor, 0.3)  # into the streams' decoding, not their admission
        process, started = stack.processes[name], time.monotonic()
        restart = Restart(name, roll.num_in_flight)
        roll.restarts.append(restart)
        print(f"rolling-restart: SIGTERM {name} (pid {process.pid}), {restart.in_flight} streams in flight",
              file=sys.stderr, flush=True)
        process.send_signal(signal.SIGTERM)
        while process.poll() is None:
            await _sleep(supervisor, 0.05)
        restart.exit_code, restart.drained_s = process.returncode, round(time.monotonic() - started, 2)
        pending.append((restart, process, started))
        if cfg.wait_back and not await _wait_back(stack, supervisor, cfg, pending):
            return  # a service that did not come back: the run has failed, stop restarting others
        await _sleep(supervisor, cfg.settle_s)
    await _wait_back(stack, supervisor, cfg, pending)


async def _sleep(supervisor, seconds: float) -> None:
    """Sleep, the supervisor starting again what has exited meanwhile (others may be down: wait_back False)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        supervisor.poll()
        await asyncio.sleep(min(left, 0.05))


async def _wait_back(stack, supervisor, cfg: StreamsConfig, pending: list) -> bool:
    """Wait until each restart in `pending` serves again (its new process), emptying it; False if one did not."""
    while pending:
        restart, process, started = pending[0]
        name, deadline = restart.name, started + cfg.drain_s + cfg.back_timeout_s
        while time.monotonic() < deadline:
            supervisor.poll()
            if stack.processes[name] is not process and await asyncio.to_thread(_serves, stack, name):
                restart.back_s = round(time.monotonic() - started, 2)
                break
            await asyncio.sleep(0.2)
        print(f"{name} exited {restart.exit_code} after {restart.drained_s} s, "
              f"serving again after {restart.back_s} s", file=sys.stderr, flush=True)
        if restart.back_s is None:
            return False
        pending.pop(0)
    return True


def _serves(stack, name: str) -> bool:
    """The new process of `name` serves: a gateway answers /ready; any other service is registered (its pid in a
    live gateway's /workers) and not draining."""
    from tools.client import list_workers, request

    pid = stack.processes[name].pid
    if name == "gateway" or name.startswith("gateway-"):
        url = stack.gateway_urls[[n for n in stack.processes if n == "gateway" or n.startswith("gateway-")].index(name)]
        try:
            return request(url + "/ready", timeout=2).status == 200
        except OSError:
            return False
    for url in stack.gateway_urls:
        try:
            return any(w["pid"] == pid and not w.get("draining") for w in list_workers(url, stack.admin_token))
        except OSError:
            continue
    return False


# What a run does to the stack while the clients stream: (stack, supervisor, roll) → when it returns, the clients
# finish the request they hold (rolling-restart: `restart_each`; tools/chaos.py: SIGKILLs on a clock)
Disrupt = Callable[[object, object, Roll], Awaitable[None]]


async def drive(stack, cfg: StreamsConfig, disrupt: Disrupt) -> Roll:
    """References first, then the clients and `disrupt`; the clients finish the request they hold."""
    import aiohttp

    from tools.loadtest import LoadConfig, Load
    from tools.supervisor import Supervisor

    load = Load(LoadConfig(max_tokens=cfg.max_tokens, prompt_tokens=cfg.prompt_tokens, transfer_modes=["full"],
                           failure_policy=cfg.failure_policy, check_tokens=cfg.streams), stack.gateway_url)
    supervisor = Supervisor(stack, say=lambda text: print(f"supervisor: {text}", file=sys.stderr, flush=True))
    roll, stop = Roll(), asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=cfg.streams * 2)) as session:
        for index in range(cfg.streams):
            await load.reference(session, index, selective=False)
        clients = [asyncio.create_task(client(i, load, roll, session, stack.gateway_urls, stop))
                   for i in range(cfg.streams)]
        try:
            await disrupt(stack, supervisor, roll)
        finally:
            stop.set()
            await asyncio.gather(*clients)
    roll.mismatches = load.mismatches  # type: ignore[attr-defined]
    return roll


def _names(stack, services: tuple[str, ...]) -> list[str]:
    """The processes to restart, in turn: each of `services` a role (all its replicas) or a process name."""
    return [n for service in services for n in stack.processes if n == service or n.rpartition("-")[0] == service]


def summarize(roll: Roll, leaks: dict) -> dict:
    from tools.client import OK

    kinds: dict[str, int] = {}
    for outcome in roll.outcomes:
        kinds[outcome.kind] = kinds.get(outcome.kind, 0) + 1
    num_ok = kinds.get(OK, 0)
    restarts = [asdict(r) for r in roll.restarts]
    return {"num_requests": len(roll.outcomes), "num_ok": num_ok, "num_lost": len(roll.outcomes) - num_ok,
            "outcomes": kinds, "num_resumed": sum(o.resumed for o in roll.outcomes),
            "num_recomputed": sum(o.recomputed for o in roll.outcomes), "retries": roll.retries,
            "near_ties": [m for m in getattr(roll, "mismatches", []) if m["near_tie"]], "restarts": restarts,
            "all_drained": all(r["exit_code"] == 0 for r in restarts), "all_back": all(r["back_s"] for r in restarts),
            "leaks": leaks}


def passed(result: dict, num_services: int) -> bool:
    return (result["num_lost"] == 0 and result["num_requests"] > 0 and result["all_drained"] and result["all_back"]
            and len(result["restarts"]) == num_services and not result["leaks"])


def run(cfg: RollConfig) -> dict:
    """Start the stack, roll it, check for leaks; returns the result (printed as JSON on stdout)."""
    def disrupt(stack, supervisor, roll: Roll) -> Awaitable[None]:
        return restart_each(stack, supervisor, roll, cfg, _names(stack, cfg.services))

    def report(stack, roll: Roll, leaks: dict) -> dict:
        result = summarize(roll, leaks)
        return {**result, "passed": passed(result, len(_names(stack, cfg.services)))}

    return run_under_load(cfg, "rolling-restart", disrupt, report)


def run_under_load(cfg: StreamsConfig, tool: str, disrupt: Disrupt,
                   report: Callable[[object, Roll, dict], dict]) -> dict:
    """Start a supervised stack as `cfg` says, `drive` its clients while `disrupt` runs, check for leaks, and return
    {"config", "elapsed_s", **report(stack, roll, leaks)}, also printed as JSON on stdout (and written to
    cfg.json_path); `report`'s dict says "passed", and the log's tail is added when it did not."""
    from shared.runtime.models import prepare_default_model
    from tools.leaks import find_leaks
    from tools.nats_server import free_port
    from tools.stack import StackSpec, started_stack
    from tools.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix=f"smartgen-{tool}-") as folder:
        model = cfg.model or str(make_tiny_model(Path(folder) / "tiny", tokenizer_from=prepare_default_model()))
        log_file = Path(cfg.log_file or Path(folder) / "stack.log")
        print(f"{tool}: starting the stack (log: {log_file})", file=sys.stderr, flush=True)
        # NOTE: no per-client limits: the tool's streams are one client, and every one of them must be in flight
        spec = StackSpec(cfg.num_prefill, cfg.num_decode, model, "full", free_port(), num_gateway=cfg.num_gateway,
                         log_file=log_file, env={"SMARTGEN_MAX_RUNNING_PER_CLIENT": "0",
                                                 "SMARTGEN_MAX_WAITING_PER_CLIENT": "0",
                                                 "SMARTGEN_KV_CACHE_MB": "64", "SMARTGEN_TORCH_THREADS": "1",
                                                 "SMARTGEN_DRAIN_S": str(cfg.drain_s),
                                                 "SMARTGEN_WORKER_TTL_S": str(cfg.worker_ttl_s)})
        names_in_turn = set()
        with started_stack(spec, 180, may_die=names_in_turn) as stack:
            names_in_turn.update(stack.processes)  # each may be stopped on purpose
            started = time.monotonic()
            roll = asyncio.run(drive(stack, cfg, disrupt))
            elapsed = time.monotonic() - started
            result = {"config": asdict(cfg), "elapsed_s": round(elapsed, 1),
                      **report(stack, roll, find_leaks(stack.gateway_url, 10.0, stack.admin_token))}
        if not result["passed"]:
            result["log_tail"] = log_file.read_text(errors="replace")[-4000:] if log_file.is_file() else ""
    print(json.dumps({k: v for k, v in result.items() if k != "log_tail"}, indent=1))
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(result, indent=1))
    return result


def command(args: argparse.Namespace) -> int:
    """`smartgen rolling-restart`: exit code 1 when a request was lost, a service did not drain or come back, or
    state leaked."""
    services = tuple(r.strip() for r in args.services.split(",") if r.strip())
    unknown = [r for r in services if r.rpartition("-")[0] not in ROLES and r not in ROLES]
    if unknown:
        raise SystemExit(f"smartgen rolling-restart: unknown service {unknown[0]!r}: name a role "
                         f"({', '.join(ROLES)}) or a process (decode-0, gateway-1…)")
    cfg = RollConfig(model=args.model or "", num_prefill=args.prefill, num_decode=args.decode,
                     num_gateway=args.gateways, streams=args.streams, max_tokens=args.max_tokens, services=services,
                     json_path=args.json or "")
    return 0 if run(cfg)["passed"] else 1
