"""`smartgen loadtest`: many streaming clients for a fixed time against a stack on this machine, then what
failed and how, latency percentiles, throughput, every process's memory, and what the workers still hold.

    smartgen loadtest [--url URL | --model PATH --prefill N --decode M] [--concurrency 16] [--duration 300]
                      [--max-tokens 32] [--prompt-tokens 256] [--transfer-mode MODE …] [--grace 10] [--json PATH]

1. Starts its own stack unless --url names a running gateway. It only talks to loopback: the gateway URL and
   the admin ports /workers lists (read only: /workers, /stats, /transfers).
2. Each of `concurrency` clients (asyncio tasks on one aiohttp session) loops until the deadline: one
   streaming /v1/completions (`ignore_eos`: every request generates `max_tokens`; transfer modes in turn),
   read the SSE events to [DONE], record the outcome (client.py); after a failure it waits as a
   polite client does (a refusal's Retry-After, else 0.1 s). Prompts are cut from the Python standard library's
   source at random places; `prompt_tokens` is approximate (≈ 3.5 characters a token), the report gives the
   real mean.
3. At the deadline requests in flight get `grace` seconds, then are cancelled: their connections close, which
   the gateway must turn into aborts (counted apart from errors; the leak check shows whether it did).
4. RSS of every process at the start, after the warm-up (a tenth of the run in), every `sample_every_s` (the max)
   and at the end (service_memory.py);
   after the run the stack's leak check (tools/leaks.py). Progress on stderr, a Markdown report on stdout
   (loadtest_report.py), everything as JSON with --json.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import sys
import tempfile
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from schemas import DEFAULT_SELECTOR, SERVABLE_TRANSFER_MODES, mode_of
from tools.workloads import stdlib_files
from tools import loadtest_report
from tools.args import add_json, add_model
from tools.client import ABORTED, OK, Outcome, get_json, list_workers, stream_completion
from tools.leaks import find_leaks
from tools.service_memory import MIB, StackMemory

if TYPE_CHECKING:  # NOTE: aiohttp loads when the clients start, so `smartgen --help` starts fast
    import aiohttp

    from tools.stack import Stack

CHARS_PER_TOKEN = 3.5  # SmolLM2's tokenizer on Python source, roughly
ERROR_PAUSE_S = 0.1  # a client waits this long after a failed request, so a dead stack is not a busy loop…
MAX_PAUSE_S = 10.0  # …or what the refusal's Retry-After says, up to this (and never past the deadline)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `loadtest` to the `smartgen` sub-commands."""
    load = subparsers.add_parser("loadtest", help="concurrent streaming clients for a fixed time: errors, latency, memory, leaks")
    load.add_argument("--url", default="", help="a running gateway on this machine (default: start a stack)")
    add_model(load, "the started stack's model")
    load.add_argument("--prefill", type=int, default=1, metavar="N", help="the started stack's prefill replicas")
    load.add_argument("--decode", type=int, default=1, metavar="M", help="the started stack's decode replicas")
    load.add_argument("--concurrency", type=int, default=16, help="clients, one streaming request in flight each")
    load.add_argument("--duration", type=float, default=300, help="seconds")
    load.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    load.add_argument("--prompt-tokens", type=int, default=256, help="approximate prompt length")
    load.add_argument("--transfer-mode", nargs="+", default=[], choices=SERVABLE_TRANSFER_MODES, help="used in turn")
    load.add_argument("--grace", type=float, default=10, help="seconds in-flight requests get after the deadline")
    load.add_argument("--failure-policy", choices=["fail", "recompute"], default="", help="sent with every request")
    load.add_argument("--kill-decode-every", type=float, default=0, metavar="S",
                      help="chaos: SIGKILL one live decode worker every S seconds (run it against `smartgen up`, "
                           "which restarts it); reports how long each took to come back")
    load.add_argument("--check-tokens", type=int, default=0, metavar="N",
                      help="draw prompts from a pool of N, first answered alone in colocated mode (with the load's "
                           "selector for selective modes): every completion must have exactly those tokens")
    add_json(load, "also write the full result here")
    load.set_defaults(run=command)


@dataclass
class LoadConfig:
    url: str = ""  # a running gateway on loopback; "" = start a stack
    model: str = ""  # for the stack it starts ("" = the default SmolLM2)
    num_prefill: int = 1
    num_decode: int = 1
    concurrency: int = 16  # clients, each with one request in flight
    duration_s: float = 300.0
    max_tokens: int = 32
    prompt_tokens: int = 256  # approximate
    transfer_modes: list[str] = field(default_factory=list)  # used in turn; [] = the gateway's default
    grace_s: float = 10.0  # after the deadline, before in-flight requests are cancelled
    request_timeout_s: float = 120.0  # one request, whole
    failure_policy: str = ""  # sent with every request ("" = the gateway's default, fail)
    kill_decode_every_s: float = 0.0  # chaos: SIGKILL a live decode worker this often (0 = never)
    check_tokens: int = 0  # > 0: prompts from a pool of this many, each request's tokens held against a reference
    sample_every_s: float = 2.0  # RSS sampling period
    leak_timeout_s: float = 10.0
    json_path: str = ""
    progress: bool = True


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Prompts:
    """Varied prompts: a random standard-library file, a random place in it, about `prompt_tokens` long."""

    def __init__(self, prompt_tokens: int, seed: int = 0):
        self.num_chars = int(prompt_tokens * CHARS_PER_TOKEN)
        self.texts = [p.read_text(errors="replace") for p in stdlib_files(min_chars=self.num_chars)]
        self.rng = random.Random(seed)
        self.num_made = 0

    def next(self) -> str:
        text = self.rng.choice(self.texts)
        start = self.rng.randrange(max(1, len(text) - self.num_chars))
        self.num_made += 1
        return f"# request {self.num_made}\n{text[start:start + self.num_chars]}"


WRONG_TOKENS = "wrong tokens"  # an outcome kind: completed, but not with the reference's tokens
# A completion that first differs from its reference where the reference's two most likely tokens were within
# this many nats is a near-tie flip, not a wrong token: a batch of other sizes adds in another order (fp32
# rounding, ~1e-5 relative), which can swap a near-tie. It is counted apart (kept `ok`), and reported.
NEAR_TIE_NATS = 0.01


class Load:
    """The clients of one run and what they have seen so far."""

    def __init__(self, cfg: LoadConfig, url: str):
        self.cfg, self.url = cfg, url.rstrip("/")
        self.prompts = Prompts(cfg.prompt_tokens)
        self.pool = [self.prompts.next() for _ in range(cfg.check_tokens)]  # --check-tokens: the prompts
        self.references: dict[tuple[int, bool], list[int]] = {}  # (pool index, selective) → the tokens alone
        self.margins: dict[tuple[int, bool], list[float]] = {}  # … → per token, the top-2 log-probability margin
        self.outcomes: list[Outcome] = []
        self.num_in_flight = 0
        self.kills: list[dict] = []  # chaos: {"at_s", "worker_id", "back_after_s"}
        self.mismatches: list[dict] = []  # --check-tokens: each completion that differed from its reference

    def next_body(self) -> tuple[dict, int]:
        """The next request's body, and its prompt's index in the pool (-1: not from the pool)."""
        index = self.prompts.num_made % len(self.pool) if self.pool else -1
        prompt = self.pool[index] if self.pool else self.prompts.next()
        if self.pool:
            self.prompts.num_made += 1
        body = {"prompt": prompt, "max_tokens": self.cfg.max_tokens, "temperature": 0, "ignore_eos": True}
        modes = self.cfg.transfer_modes
        if modes:
            body["transfer_mode"] = modes[self.prompts.num_made % len(modes)]
            if self.pool and mode_of(body["transfer_mode"]).push_bits:
                body["kv_bits"] = 0  # held to colocated's tokens: exact KV (smartgen moves K8V8 codes by default)
        if self.cfg.failure_policy:
            body["failure_policy"] = self.cfg.failure_policy
        return body, index

    async def reference(self, session: aiohttp.ClientSession, index: int, selective: bool) -> list[int]:
        """The pool prompt's tokens alone in colocated mode (with the selector the selective modes default to)."""
        key = (index, selective)
        if key not in self.references:
            body = {"prompt": self.pool[index], "max_tokens": self.cfg.max_tokens, "temperature": 0, "logprobs": 2,
                    "ignore_eos": True, "transfer_mode": "colocated", **({"selector": DEFAULT_SELECTOR} if selective else {})}
            async with session.post(self.url + "/v1/completions", json=body) as response:
                reply = await response.json()
                if response.status != 200:
                    raise SystemExit(f"smartgen loadtest: the reference for prompt {index} failed: {reply}")
            self.references[key] = reply["smartgen"]["token_ids"]
            tops = [sorted(top.values(), reverse=True) for top in reply["choices"][0]["logprobs"]["top_logprobs"]]
            self.margins[key] = [top[0] - top[1] if len(top) > 1 else float("inf") for top in tops]
        return self.references[key]

    def checked(self, outcome: Outcome, body: dict, index: int) -> Outcome:
        """`outcome`, or WRONG_TOKENS if its tokens are not its prompt's reference."""
        if index < 0 or outcome.kind != OK:
            return outcome
        selective = mode_of(body.get("transfer_mode", "full")).needs_selector
        expected = self.references[(index, selective)]
        if outcome.token_ids != expected:
            first = next((i for i, (a, b) in enumerate(zip(outcome.token_ids, expected)) if a != b),
                         min(len(outcome.token_ids), len(expected)))
            margins = self.margins.get((index, selective), [])
            margin = margins[first] if first < len(margins) else None
            near_tie = margin is not None and margin < NEAR_TIE_NATS
            if not near_tie:
                outcome.kind = WRONG_TOKENS
            self.mismatches.append({"prompt_index": index, "mode": body.get("transfer_mode", ""),
                                    "first_difference": first, "reference_margin": margin, "near_tie": near_tie,
                                    "expected": expected, "got": outcome.token_ids, "resumed": outcome.resumed})
        return outcome

    async def chaos(self, started: float, deadline: float) -> None:
        """Every `kill_decode_every_s`: SIGKILL one live decode worker (loopback pids from /workers), then time
        until as many decode workers are registered again as before the kill."""
        import signal

        while time.monotonic() + self.cfg.kill_decode_every_s < deadline:
            await asyncio.sleep(self.cfg.kill_decode_every_s)
            decode = [w for w in list_workers(self.url) if w["role"] == "decode"]
            if not decode:
                continue
            victim, killed_at = decode[0], time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            kill = {"at_s": round(killed_at - started, 1), "worker_id": victim["id"], "back_after_s": None}
            self.kills.append(kill)
            print(f"\nloadtest: killed {victim['id']} (pid {victim['pid']}) at {kill['at_s']} s", file=sys.stderr)
            while time.monotonic() < deadline + self.cfg.grace_s:
                await asyncio.sleep(0.5)
                now = [w for w in list_workers(self.url) if w["role"] == "decode"]
                if len(now) >= len(decode) and victim["id"] not in {w["id"] for w in now}:
                    kill["back_after_s"] = round(time.monotonic() - killed_at, 1)
                    break

    async def client(self, session: aiohttp.ClientSession, deadline: float) -> None:
        while time.monotonic() < deadline:
            (body, index), started = self.next_body(), time.monotonic()
            self.num_in_flight += 1
            try:
                outcome = self.checked(await stream_completion(session, self.url, body, self.cfg.request_timeout_s),
                                       body, index)
            except asyncio.CancelledError:  # the hard stop: leaving the `async with` closes the connection
                self.outcomes.append(Outcome(ABORTED, body.get("transfer_mode", ""), time.monotonic() - started))
                raise
            finally:
                self.num_in_flight -= 1
            outcome.finished_at_s = round(time.monotonic() - (deadline - self.cfg.duration_s), 2)
            self.outcomes.append(outcome)
            if outcome.kind != OK:
                pause = ERROR_PAUSE_S if outcome.retry_after_s is None else min(outcome.retry_after_s, MAX_PAUSE_S)
                await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))

    async def watch(self, memory: StackMemory, started: float, bar) -> None:
        """Progress every second; an RSS sample every `sample_every_s`."""
        rss, next_sample = 0, started  # the first sample, now, gives the start figures
        warm_at: float | None = started + self.cfg.duration_s / 10  # the first sample from then on is the warm one
        while True:
            now = time.monotonic()
            if now >= next_sample:
                is_warm_mark = warm_at is not None and now >= warm_at
                rss, next_sample = memory.sample(is_warm_mark), now + self.cfg.sample_every_s
                warm_at = None if is_warm_mark else warm_at
            num_ok = sum(o.kind == OK for o in self.outcomes)
            num_errors = sum(o.kind not in (OK, ABORTED) for o in self.outcomes)
            bar.n = min(bar.total, round(now - started))
            bar.set_postfix_str(f"ok {num_ok}  errors {num_errors}  in flight {self.num_in_flight}  RSS {rss / MIB:,.0f} MiB")
            await asyncio.sleep(1.0)

    async def drive(self, memory: StackMemory) -> float:
        """Run every client to the deadline (+ grace, then cancel). Returns the elapsed time in seconds."""
        import aiohttp
        from tqdm import tqdm

        cfg = self.cfg
        bar = tqdm(total=round(cfg.duration_s), desc="loadtest", unit="s", disable=not cfg.progress,
                   bar_format="{desc} {bar} {n}/{total} s{postfix}")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=cfg.concurrency)) as session:
            for index in range(len(self.pool)):  # --check-tokens: each prompt alone first, in each kind of mode
                for selective in {mode_of(m).needs_selector for m in cfg.transfer_modes or ["full"]}:
                    await self.reference(session, index, selective)
            started = time.monotonic()
            watcher = asyncio.create_task(self.watch(memory, started, bar))
            chaos = asyncio.create_task(self.chaos(started, started + cfg.duration_s)) if cfg.kill_decode_every_s else None
            clients = [asyncio.create_task(self.client(session, started + cfg.duration_s)) for _ in range(cfg.concurrency)]
            _, late = await asyncio.wait(clients, timeout=cfg.duration_s + cfg.grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
            elapsed = time.monotonic() - started
            watcher.cancel()
            if chaos is not None:
                chaos.cancel()
                await asyncio.gather(chaos, return_exceptions=True)
        bar.close()
        return elapsed


def run(cfg: LoadConfig) -> dict:
    """The whole load test; prints the report and returns the result (see loadtest_report.summarize)."""
    if cfg.check_tokens and "auto" in cfg.transfer_modes:
        raise SystemExit("smartgen loadtest: --check-tokens cannot hold auto to one reference (it may run dense or selective)")
    if cfg.url and not is_loopback(cfg.url):
        raise SystemExit(f"smartgen loadtest: {cfg.url} is not a loopback address; it only drives a stack on this machine")
    with _own_stack(cfg) if not cfg.url else nullcontext() as stack:
        url = cfg.url or stack.gateway_url
        try:
            health = get_json(url + "/health")
        except OSError as exc:
            raise SystemExit(f"smartgen loadtest: no gateway answers at {url} ({exc})") from None
        if health.get("status") != "ok":
            raise SystemExit(f"smartgen loadtest: the gateway at {url} is not ready: {health}")
        workers = list_workers(url)
        remote = [w["id"] for w in workers if not is_loopback(w["admin_url"])]
        if remote:
            raise SystemExit(f"smartgen loadtest: admin ports not on loopback ({', '.join(remote)}); "
                             "it only reads a stack on this machine")
        memory = StackMemory.discover(url, stack.nats.process.pid if stack and stack.nats else None)
        load = Load(cfg, url)
        elapsed = asyncio.run(load.drive(memory))
        leaks = find_leaks(url, cfg.leak_timeout_s)
        memory.finish()
    result = {"config": asdict(cfg), "url": url, "elapsed_s": elapsed, **loadtest_report.summarize(load.outcomes, elapsed),
              "by_mode": {m: loadtest_report.summarize([o for o in load.outcomes if o.mode == m], elapsed)
                          for m in cfg.transfer_modes} if len(cfg.transfer_modes) > 1 else {},
              "memory": memory.as_dict(), "memory_timeline": memory.timeline, "leaks": leaks,
              "kills": load.kills, "mismatches": load.mismatches, "num_resumed": sum(o.resumed for o in load.outcomes),
              "num_checked": sum(o.kind in (OK, WRONG_TOKENS) for o in load.outcomes) if cfg.check_tokens else 0,
              "requests": [asdict(o) for o in load.outcomes]}
    print(loadtest_report.markdown(result))
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(result, indent=1))
        print(f"\nwrote {cfg.json_path}")
    return result


def _own_stack(cfg: LoadConfig) -> AbstractContextManager[Stack]:
    """A stack of the configured size started for the run (stopped on exit), logging to a file in the temp folder."""
    from shared.runtime.models import prepare_default_model
    from tools.nats_server import free_port
    from tools.stack import StackSpec, started_stack

    if not cfg.model:
        prepare_default_model()
    log_file = Path(tempfile.gettempdir()) / f"smartgen-loadtest-{os.getpid()}.log"
    print(f"loadtest: starting NATS, {cfg.num_prefill} prefill + {cfg.num_decode} decode workers (log: {log_file})",
          file=sys.stderr, flush=True)
    # NOTE: no per-client cap: the load test is one client measuring the whole server
    spec = StackSpec(cfg.num_prefill, cfg.num_decode, cfg.model, (cfg.transfer_modes or ["full"])[0], free_port(),
                     log_file=log_file,
                     env={"SMARTGEN_MAX_RUNNING_PER_CLIENT": "0", "SMARTGEN_MAX_WAITING_PER_CLIENT": "0"})
    return started_stack(spec, 300)


def command(args: argparse.Namespace) -> int:
    """`smartgen loadtest`: exit code 1 when a request failed or state leaked, else 0."""
    cfg = LoadConfig(url=args.url, model=args.model, num_prefill=args.prefill, num_decode=args.decode,
                     concurrency=args.concurrency, duration_s=args.duration, max_tokens=args.max_tokens,
                     prompt_tokens=args.prompt_tokens, transfer_modes=args.transfer_mode, grace_s=args.grace,
                     failure_policy=args.failure_policy, kill_decode_every_s=args.kill_decode_every,
                     check_tokens=args.check_tokens, json_path=args.json or "")
    result = run(cfg)
    return 1 if result["num_errors"] or result["leaks"] else 0
