"""How far one request walks through the code: stops, files and returns along the path a real request takes.

    smartgen walk [--mode full --mode smartgen] [--max-tokens 6] [--model PATH] [--functions] [--json PATH]
    python -m tools.walk --mode smartgen

Issue #32 counted by hand how many files a reader visits while following a request; this tool counts the same
thing on the code as it runs, so the number can be compared between commits.

How it runs. One process holds a nats-server (a child process) and the five services, each as
`shared.runtime.service.run_service` runs it, on one event loop, on the tiny random-weight model
(`tools/tiny_model.py`; `--model` for another). One completion goes through the gateway's HTTP API with
`transfer_mode` set to the mode measured; every mode gets a freshly started stack, so its request is the first
one its workers see (no prefix cache hit, the decode batcher's task is born inside the request).

What is traced. A `sys.setprofile` hook (on the event loop's thread and on each torch thread) records every call of
a project function (a file under services/, shared/ or schemas/; the standard library, third-party packages and
tools/ are skipped, and so are the frames they hold) made on behalf of a watched handler:
  decode.generate  from the decode worker receiving `generate` to the encoding of its final TokenEvent (the one
                   with `finish_reason`);
  prefill.prefill  from the prefill worker receiving `prefill` to the encoding of its PrefillDone reply;
  decode.open      (also reported) from receiving `open` to the encoding of its KvHandle.
"On behalf of" follows a context variable set when the handler that `Service.add_endpoints` registered for that
verb is entered (the tool wraps it; it depends on no function name inside a service): asyncio tasks and
callbacks inherit it, and the tool runs each torch-thread job (`TorchThread.run`) in a copy of its caller's
context, so the torch work counts too. Whatever another task does meanwhile (heartbeats, the data plane's
readers, the gateway) does not. Logging is not set up (`setup_logging`), so log calls stay in structlog.

The calls form a tree: a function's callee is its child; an asyncio task, a callback or a torch-thread job is a
child of the function that started it. A loop's repetitions are one visit: among a function's children, a
repeat of an earlier child (the same function called from the same line, or started as a task/job by the same
function) is dropped with its subtree, so the walk does not grow with layers or tokens and holds the first
decode step. A walk holds the calls entered between its start and its final message, plus the whole of every
task, callback or torch job started in that time (a push or a background read started before PrefillDone or the
final TokenEvent counts to its end): cutting those at the final message made the numbers depend on timing. The
steady decode step is reported apart: the same over the window between the encodings of TokenEvent 2 and 3.
Two runs on one tree give the same numbers (tests/integration/test_walk.py); a fresh stack's first request also
dials the data-plane link (the handshake is in the prefill's walk).

Definitions (counted over the collapsed tree, in call order):
  stop      entering a project function whose file differs from its parent's file (the previous project frame
            on its stack, or the function that started its task/job); the handler's first project frame is a stop;
  files     the distinct files of those stops;
  return    a stop into a file visited before and left (so returns = stops - files).
Against the issue's hand count ("70 stops in 16 files, 54 returns" for decode's generate, "14 stops in 5 files"
for the prefill): a reader skips what this tool counts: the wrappers a handler passes through
(shared/runtime/rpc.py, tracing.py), the schemas' encode/decode, small helpers and properties in other
files, and every branch the request really took; and counts what it does not take (other modes' branches,
error paths). Compare numbers from this tool with numbers from this tool.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tools.walk_trace import WATCHED, Tracer, Walk

PROMPT = "The history of the city begins with a small settlement on the river, where traders met. " * 8
# The bare selective budget, as tests/integration/conftest.py NO_FLOOR_ENV: without it a short prompt decodes
# densely (schemas/constants.py BudgetFloor) and smartgen's remote-read path would not run
NO_FLOOR_ENV = {"SMARTGEN_SELECTIVE_MIN_TOKENS": "0", "SMARTGEN_MIN_BUDGET_TOKENS": "1", "SMARTGEN_SINK_TOKENS": "0",
                "SMARTGEN_RECENT_TOKENS": "0"}


# --- running one request --------------------------------------------------------------------------------
def _install(tracer: Tracer) -> tuple[Any, Any]:
    """Wrap the watched verbs' handlers and run every torch job in its caller's context; returns what to undo."""
    from shared.runtime.service import Service
    from shared.runtime.torch_thread import TorchThread

    add_endpoints, run = Service.add_endpoints, TorchThread.run

    async def watched_add_endpoints(self: Service, micro: Any, **handlers: Any) -> None:
        handlers = {verb: tracer.watch(f"{self.role}.{verb}", h) if f"{self.role}.{verb}" in WATCHED else h
                    for verb, h in handlers.items()}
        await add_endpoints(self, micro, **handlers)

    async def run_in_context(self: TorchThread, fn: Any, *args: Any) -> Any:
        return await run(self, tracer.in_context(fn), *args)

    Service.add_endpoints, TorchThread.run = watched_add_endpoints, run_in_context
    return add_endpoints, run


def _uninstall(saved: tuple[Any, Any]) -> None:
    from shared.runtime.service import Service
    from shared.runtime.torch_thread import TorchThread

    Service.add_endpoints, TorchThread.run = saved


async def _one_request(model: str, mode: str, max_tokens: int, env: dict[str, str]) -> Tracer:
    """A fresh stack in this process, one completion in `mode` through it with the hook on; the tracer."""
    import secrets
    import threading

    from services.broker.config import BrokerConfig
    from services.broker.service import BrokerService
    from services.decode.config import DecodeConfig
    from services.decode.service import DecodeService
    from services.gateway.config import GatewayConfig
    from services.gateway.service import GatewayService
    from services.kvprofile.config import KvProfileConfig
    from services.kvprofile.service import KvProfileService
    from services.prefill.config import PrefillConfig
    from services.prefill.service import PrefillService
    from shared.runtime.config import resolve_config
    from shared.runtime.service import run_service
    from tools.client import get_json, post_json
    from tools.nats_server import NatsServer

    tracer = Tracer()
    saved = _install(tracer)
    with NatsServer() as nats_server:
        base = {**os.environ, **nats_server.client_env(), "SMARTGEN_MODEL": model, "SMARTGEN_KV_CACHE_MB": "64",
                "SMARTGEN_TORCH_THREADS": "1", "SMARTGEN_ADMIN_TOKEN": secrets.token_urlsafe(16),
                "SMARTGEN_CLUSTER_SECRET": secrets.token_urlsafe(16), "SMARTGEN_GATEWAY_PORT": "0",
                **NO_FLOOR_ENV, **env}
        services = [cls(resolve_config(config_cls, [], base, role)[0]) for cls, config_cls, role in (
            (BrokerService, BrokerConfig, "broker"), (KvProfileService, KvProfileConfig, "kvprofile"),
            (PrefillService, PrefillConfig, "prefill"), (DecodeService, DecodeConfig, "decode"),
            (GatewayService, GatewayConfig, "gateway"))]
        tasks: list[asyncio.Task] = []
        try:
            for service in services:  # NOTE: one at a time: transformers cannot load two models at once in a process
                tasks.append(asyncio.create_task(run_service(service)))
                await _started(service, tasks[-1])
            # NOTE: the gateway binds port 0 and says which it got: a port picked free before the other services
            # started could be handed to one of their sockets meanwhile (it was, once: EADDRINUSE)
            url = services[-1].admin_url
            for _ in range(600):
                if any(task.done() for task in tasks):
                    raise RuntimeError(f"a service stopped during start-up: {[t.exception() for t in tasks if t.done()]}")
                health = await asyncio.to_thread(_health, get_json, url)
                workers = health.get("workers", {})
                if health.get("status") == "ok" and workers.get("prefill", 0) and workers.get("decode", 0):
                    break
                await asyncio.sleep(0.2)
            else:
                raise TimeoutError(f"the stack was not ready in 120 s: {health}")
            threading.setprofile(tracer.profile)
            sys.setprofile(tracer.profile)
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "transfer_mode": mode,
                    "ignore_eos": True}
            status, reply = await asyncio.to_thread(post_json, url + "/v1/completions", body, 120.0)
            if status != 200:
                raise RuntimeError(f"the {mode} completion failed: {status} {reply}")
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # torch threads drop theirs with the services (their pools shut down)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            _uninstall(saved)
    return tracer


async def _started(service: Any, task: asyncio.Task, timeout_s: float = 120.0) -> None:
    """Until `service.start` has returned (its model loaded, its endpoints added)."""
    started = asyncio.Event()
    start = service.start

    async def start_then_tell(*args: Any) -> None:
        await start(*args)
        started.set()

    service.start = start_then_tell
    waiting = asyncio.create_task(started.wait())
    await asyncio.wait([waiting, task], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if not started.is_set():
        raise RuntimeError(f"{service.role} did not start: {task.exception() if task.done() else 'timed out'}")


def _health(get_json: Any, url: str) -> dict:
    try:
        return get_json(url + "/health", timeout=2)
    except OSError as exc:
        return {"status": str(exc)}


def measure(mode: str, model: str = "", max_tokens: int = 6, env: dict[str, str] | None = None) -> list[Walk]:
    """The walks of one `mode` request (on the tiny model unless `model` names a folder)."""
    import structlog

    logging = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only: no log lines per call
    try:
        with tempfile.TemporaryDirectory(prefix="smartgen-walk-") as folder:
            if not model:
                from tools.tiny_model import make_tiny_model

                model = str(make_tiny_model(Path(folder) / "tiny"))
            tracer = asyncio.run(_one_request(model, mode, max_tokens, env or {}))
    finally:
        structlog.configure(**logging)
    return tracer.walks()


# --- the command ---------------------------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `walk` to the `smartgen` commands."""
    parser = subparsers.add_parser("walk", help="count the files one request's handlers walk through (issue #32)")
    add_arguments(parser)
    parser.set_defaults(run=command)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tools.args import add_json

    parser.add_argument("--mode", action="append", help="transfer mode, repeatable (default: full and smartgen)")
    parser.add_argument("--max-tokens", type=int, default=6, help="completion tokens (≥ 4 for the steady step)")
    parser.add_argument("--model", default="", help="a model folder (default: a fresh tiny random-weight model)")
    parser.add_argument("--functions", action="store_true", help="also list every stop as file:function")
    add_json(parser)


def command(args: argparse.Namespace) -> None:
    results = {}
    for mode in args.mode or ["full", "smartgen"]:
        walks = measure(mode, args.model, args.max_tokens)
        results[mode] = [asdict(w) for w in walks]
        print(f"== {mode}")
        for walk in walks:
            print(walk.summary())
            print("   " + " → ".join(walk.path))
            if args.functions:
                print("\n".join("     " + f for f in walk.functions))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser(prog="python -m tools.walk", description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(main_parser)
    command(main_parser.parse_args())
