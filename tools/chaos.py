"""`smartgen chaos`: SIGKILL a decode worker on a clock while streams run, and check that no request is lost, every
one has its reference tokens, each killed worker is back within 30 s and nothing leaks (issue #35's chaos goal).

    smartgen chaos [--model PATH] [--decode 2] [--streams 8] [--kill-every 120] [--duration 600] [--max-tokens 48]
                   [--json PATH]

The stack, the clients, their reference tokens and the leak check are `smartgen rolling-restart`'s
(tools/rolling_restart.py, `run_under_load`): a supervised stack (one gateway and one prefill worker, as
`smartgen up --decode 2`), `streams` streaming clients under failure policy `recompute`, each completion held to its
prompt's colocated reference. What differs is the disruption:
1. Every `kill_every_s`, for `duration_s`, the next decode worker in turn (decode-0, decode-1, decode-0, …) gets
   SIGKILL: no drain, its requests die with it and the gateway resumes them on the other worker.
2. Each kill is timed until the supervisor's new process serves (registered with a gateway, hence heartbeating).
   NOTE: a kill waits for the last killed worker to be back first, so one decode worker always serves (the goal's
   "one decode worker SIGKILLed"); the wait is reported as the kill's `delayed_s`.
3. After the last period, every killed worker must be back; the clients finish the request they hold; the leak check.
Exit code 0 only if no request was lost or got other tokens, every killed worker was back within `back_within_s`,
and nothing leaked.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass

from tools.args import add_json, add_model
from tools.rolling_restart import Restart, Roll, StreamsConfig, _sleep, _wait_back, run_under_load, summarize

GOAL_BACK_S = 30.0  # issue #35: a killed worker serves again within this


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `chaos` to the `smartgen` sub-commands."""
    chaos = subparsers.add_parser("chaos", help="SIGKILL a decode worker on a clock under streaming load: no request "
                                  "may be lost or get other tokens, each worker back within 30 s, nothing leaked")
    add_model(chaos, "the stack's model (default: a tiny random-weight model made for the run)")
    chaos.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill replicas (default 1)")
    chaos.add_argument("--decode", type=int, default=2, metavar="M", help="decode replicas, killed in turn (default 2)")
    chaos.add_argument("--streams", type=int, default=8, help="concurrent streaming clients (default 8)")
    chaos.add_argument("--max-tokens", type=int, default=48, help="tokens per completion (default 48)")
    chaos.add_argument("--kill-every", type=float, default=120.0, metavar="S",
                       help="seconds between kills (default 120)")
    chaos.add_argument("--duration", type=float, default=600.0, metavar="S",
                       help="seconds of load; a kill at each period's end before it (default 600: 4 kills)")
    add_json(chaos, "also write the full result here")
    chaos.set_defaults(run=command)


@dataclass
class ChaosConfig(StreamsConfig):
    num_prefill: int = 1
    num_decode: int = 2
    num_gateway: int = 1
    kill_every_s: float = 120.0
    duration_s: float = 600.0  # kills at kill_every_s, 2 × kill_every_s, … before this: 600 / 120 s, 4 kills

    @property
    def num_kills(self) -> int:
        return math.ceil(self.duration_s / self.kill_every_s) - 1
    back_within_s: float = GOAL_BACK_S  # the pass mark for each kill's `back_s`


@dataclass
class Kill(Restart):
    """One SIGKILL: `Restart`'s fields (exit_code -9, drained_s the time to reap it, back_s kill → new process
    registered), and when and on what it fell."""

    at_s: float = 0.0  # from the start of the load
    delayed_s: float = 0.0  # past its slot, waiting for the last killed worker to be back
    held: int | None = None  # requests the victim held just before the kill (its /stats), None if it did not answer


async def kill_on_a_clock(stack, supervisor, roll: Roll, cfg: ChaosConfig) -> None:
    """SIGKILL the decode workers in turn every `kill_every_s` for `duration_s`, each timed until it serves again
    (in the background: the clock does not wait for it, only the next kill does); then wait until all are back."""
    victims = [n for n in stack.processes if n.rpartition("-")[0] == "decode"]
    started = time.monotonic()
    back: asyncio.Task | None = None  # the last kill's wait for its worker to serve again
    for turn in range(cfg.num_kills):
        await _sleep(supervisor, started + (turn + 1) * cfg.kill_every_s - time.monotonic())
        if back is not None and not await back:
            return  # a killed worker did not come back: the run has failed, kill no other
        name = victims[turn % len(victims)]
        back = asyncio.create_task(_kill(stack, supervisor, roll, cfg, name, started, turn))
    if back is not None:
        await back
    await _sleep(supervisor, started + cfg.duration_s - time.monotonic())


async def _kill(stack, supervisor, roll: Roll, cfg: ChaosConfig, name: str, started: float, turn: int) -> bool:
    """SIGKILL `name` now and wait until its new process serves; False if it did not within the time allowed."""
    process = stack.processes[name]
    held = await asyncio.to_thread(_held, stack, process.pid)
    killed_at = time.monotonic()
    kill = Kill(name, roll.num_in_flight, at_s=round(killed_at - started, 2), held=held,
                delayed_s=round(max(0.0, killed_at - started - (turn + 1) * cfg.kill_every_s), 2))
    roll.restarts.append(kill)
    print(f"chaos: SIGKILL {name} (pid {process.pid}, holding {held} requests) at {kill.at_s} s, "
          f"{kill.in_flight} streams in flight", file=sys.stderr, flush=True)
    process.send_signal(signal.SIGKILL)
    while process.poll() is None:
        await asyncio.sleep(0.01)
    kill.exit_code, kill.drained_s = process.returncode, round(time.monotonic() - killed_at, 2)
    return await _wait_back(stack, supervisor, cfg, [(kill, process, killed_at)])


def _held(stack, pid: int) -> int | None:
    """Requests the worker with `pid` holds (its /stats' active_requests), None if it is not listed or silent."""
    from tools.client import get_json, list_workers

    try:
        worker = next(w for w in list_workers(stack.gateway_url, stack.admin_token) if w["pid"] == pid)
        return get_json(worker["admin_url"] + "/stats")["active_requests"]
    except (OSError, StopIteration, KeyError):
        return None


def gateway_counter(stack, name: str) -> float:
    """A counter summed over every gateway's /metrics (its labels added up)."""
    from shared.runtime.admin_auth import admin_headers

    total = 0.0
    for url in stack.gateway_urls:
        request = urllib.request.Request(url + "/metrics", headers=admin_headers(stack.admin_token))
        text = urllib.request.urlopen(request, timeout=5).read().decode()
        total += sum(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith((name + " ", name + "{")))
    return total


def report(cfg: ChaosConfig, stack, roll: Roll, leaks: dict) -> dict:
    """rolling-restart's summary (outcomes, lost by kind and by kill, near-ties, leaks) with the kills' figures."""
    result = summarize(roll, leaks)
    del result["all_drained"]  # a SIGKILL does not drain
    result["kills"] = result.pop("restarts")
    backs = [k["back_s"] for k in result["kills"]]
    log = stack.spec.log_file.read_text(errors="replace") if stack.spec.log_file else ""
    result.update({
        "completed_pct": round(100 * result["num_ok"] / result["num_requests"], 2) if result["num_requests"] else 0.0,
        "num_wrong_tokens": result["outcomes"].get("wrong tokens", 0),
        "back_s_max": max((b for b in backs if b is not None), default=None),
        "all_back_within": bool(backs) and all(b is not None and b <= cfg.back_within_s for b in backs),
        # the gateway's count of requests resumed on another decode worker (smartgen_migrations_total), and its
        # log's count of requests whose decode worker died after their last token (they stand as they are)
        "num_migrations": int(gateway_counter(stack, "smartgen_migrations_total")),
        "num_lost_after_last_token": log.count("decode_lost_after_last_token"),
    })
    result["passed"] = (result["num_requests"] > 0 and result["num_lost"] == 0 and len(result["kills"]) == cfg.num_kills
                        and result["all_back_within"] and not leaks)
    return result


def run(cfg: ChaosConfig) -> dict:
    """Start the stack, kill on the clock, check for leaks; returns the result (printed as JSON on stdout)."""
    def disrupt(stack, supervisor, roll: Roll):
        return kill_on_a_clock(stack, supervisor, roll, cfg)

    return run_under_load(cfg, "chaos", disrupt, lambda stack, roll, leaks: report(cfg, stack, roll, leaks))


def command(args: argparse.Namespace) -> int:
    """`smartgen chaos`: exit code 1 when a request was lost or got other tokens, a killed worker was not back
    within 30 s, or state leaked."""
    if args.decode < 2:
        raise SystemExit("smartgen chaos: --decode must be at least 2 (one serves while the other is killed)")
    if not 0 < args.kill_every < args.duration:
        raise SystemExit("smartgen chaos: --kill-every must be more than 0 and less than --duration "
                         "(no kill otherwise)")
    cfg = ChaosConfig(model=args.model or "", num_prefill=args.prefill, num_decode=args.decode, streams=args.streams,
                      max_tokens=args.max_tokens, kill_every_s=args.kill_every, duration_s=args.duration,
                      json_path=args.json or "")
    return 0 if run(cfg)["passed"] else 1
