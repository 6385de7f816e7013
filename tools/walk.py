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
import contextvars
import dis
import functools
import itertools
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT_DIRS = ("services", "shared", "schemas")
WATCHED = ("decode.generate", "prefill.prefill", "decode.open")  # role.verb: the walks reported
STEADY_STEP = 2  # the steady decode step: the calls between TokenEvent STEADY_STEP and STEADY_STEP + 1
PROMPT = "The history of the city begins with a small settlement on the river, where traders met. " * 8
# The bare selective budget, as tests/integration/conftest.py NO_FLOOR_ENV: without it a short prompt decodes
# densely (schemas/constants.py BudgetFloor) and smartgen's remote-read path would not run
NO_FLOOR_ENV = {"SMARTGEN_SELECTIVE_MIN_TOKENS": "0", "SMARTGEN_MIN_BUDGET_TOKENS": "1", "SMARTGEN_SINK_TOKENS": "0",
                "SMARTGEN_RECENT_TOKENS": "0"}
_SUSPENDED_AT = dis.opmap["YIELD_VALUE"]  # a coroutine's 'return' event there is a suspension, not its end
_RESUMABLE = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR


@dataclass(eq=False)
class Call:
    """One project function entered on behalf of a watched handler."""
    file: str  # relative to the repository root; "" for a walk's root (the handler, entered from outside)
    function: str  # co_qualname
    line: int  # the parent's line that called it; -1 when it was started as a task, callback or torch job
    seq: int  # the order of entry over the whole run (all threads)
    parent: "Call | None" = field(default=None, repr=False)
    children: list["Call"] = field(default_factory=list, repr=False)
    end: "Marker | None" = field(default=None, repr=False)  # set on a walk's root: the encoding that ends it

    def last_seq(self) -> int:
        """The largest seq in this call's subtree."""
        return max([self.seq, *(child.last_seq() for child in self.children)])


@dataclass
class Marker:
    """An encoded message a walk is cut at."""
    kind: str  # the message's class name
    index: int  # TokenEvent.index, else 0
    final: bool  # the message ends its walk
    call: Call  # the `encode` call that encoded it


@dataclass
class Walk:
    """What a reader following the request would visit: the numbers of the module docstring."""
    name: str
    stops: int
    files: int
    returns: int
    path: list[str]  # the stops' files in order, consecutive repeats merged
    functions: list[str]  # the stops as file:function, in order

    def summary(self) -> str:
        return f"{self.name}: {self.stops} stops in {self.files} files, {self.returns} returns to a file already left"


_CURRENT: contextvars.ContextVar[Call | None] = contextvars.ContextVar("walk_current", default=None)


class Tracer:
    """The profile hook and the call trees it builds: one root per watched handler call."""

    def __init__(self) -> None:
        self.roots: dict[str, list[Call]] = {}  # "role.verb" → a root per handler call
        self.markers: list[Marker] = []
        self._seq = itertools.count()
        self._files: dict[Any, str | None] = {}  # code object → its project file, or None
        self._live: dict[int, tuple[Call, Any]] = {}  # id(frame) → (its call, its code): frames running or suspended
        self._prefixes = tuple(str(REPO_ROOT / d) + os.sep for d in PROJECT_DIRS)

    # --- what the tool wraps -----------------------------------------------------------------------------
    def watch(self, name: str, handler: Any) -> Any:
        """`handler` (a nats.micro handler) with each of its calls a new walk named `name`."""
        @functools.wraps(handler)
        async def watched(*args: Any) -> Any:
            root = Call("", name, -1, next(self._seq))
            self.roots.setdefault(name, []).append(root)
            token = _CURRENT.set(root)
            try:
                return await handler(*args)
            finally:
                _CURRENT.reset(token)
        return watched

    def in_context(self, fn: Any) -> Any:
        """`fn` to run on another thread in a copy of this context, with the hook installed on that thread."""
        context = contextvars.copy_context()

        def run(*args: Any) -> Any:
            if sys.getprofile() is not self.profile:
                sys.setprofile(self.profile)
            return context.run(fn, *args)
        return run

    # --- the hook ----------------------------------------------------------------------------------------
    def _file_of(self, code: Any) -> str | None:
        try:
            return self._files[code]
        except KeyError:
            name = code.co_filename
            rel = name[len(str(REPO_ROOT)) + 1:] if name.startswith(self._prefixes) else None
            self._files[code] = rel
            return rel

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event[1] == "_":  # c_call, c_return, c_exception: C functions are never project functions
            return
        current = _CURRENT.get()
        if current is None:
            return
        if event == "call":
            self._enter(frame, current)
        elif event == "return":
            live = self._live.get(id(frame))
            if live is not None and live[1] is frame.f_code:
                _CURRENT.set(live[0].parent)
                code = frame.f_code
                if not (code.co_flags & _RESUMABLE and code.co_code[frame.f_lasti] == _SUSPENDED_AT):
                    del self._live[id(frame)]

    def _enter(self, frame: Any, current: Call) -> None:
        code = frame.f_code
        rel = self._file_of(code)
        if rel is None:
            return
        live = self._live.get(id(frame))
        if live is not None and live[1] is code:  # a coroutine resumed
            _CURRENT.set(live[0])
            return
        caller = frame.f_back
        while caller is not None and self._file_of(caller.f_code) is None:
            caller = caller.f_back
        by_parent = caller is not None and self._live.get(id(caller), (None,))[0] is current
        call = Call(rel, code.co_qualname, caller.f_lineno if by_parent else -1, next(self._seq), current)
        current.children.append(call)
        self._live[id(frame)] = (call, code)
        _CURRENT.set(call)
        if rel == "schemas/codec.py" and code.co_name == "encode":
            self._mark(frame, call)

    def _mark(self, frame: Any, call: Call) -> None:
        from schemas import KvHandle, PrefillDone, TokenEvent

        message = frame.f_locals.get(frame.f_code.co_varnames[0])
        final = isinstance(message, (KvHandle, PrefillDone)) or (isinstance(message, TokenEvent) and bool(message.finish_reason))
        marker = Marker(type(message).__name__, getattr(message, "index", 0) if isinstance(message, TokenEvent) else 0,
                        final, call)
        self.markers.append(marker)
        root = call
        while root.parent is not None:
            root = root.parent
        if final and root.end is None:
            root.end = marker

    # --- the numbers -------------------------------------------------------------------------------------
    def walks(self) -> list[Walk]:
        """Each watched handler's first call, cut at its final message; decode's steady step apart."""
        out = []
        for name in WATCHED:
            roots = self.roots.get(name, [])
            if not roots:
                continue
            root = roots[0]
            if root.end is None:
                raise RuntimeError(f"{name}: the walk never reached its final message (did the request fail?)")
            out.append(walk_of(name, root, -1, root.end.call.last_seq()))
            if name == "decode.generate":
                steps = {m.index: m.call for m in self.markers if m.kind == "TokenEvent" and _root_of(m.call) is root}
                if STEADY_STEP + 1 in steps:
                    out.append(walk_of(f"{name} steady step (token {STEADY_STEP} sent → token {STEADY_STEP + 1} sent)",
                                       root, steps[STEADY_STEP].last_seq(), steps[STEADY_STEP + 1].last_seq()))
        return out


def _root_of(call: Call) -> Call:
    while call.parent is not None:
        call = call.parent
    return call


def walk_of(name: str, root: Call, after: int, until: int) -> Walk:
    """The walk over the calls of `root`'s tree entered with `after` < seq ≤ `until`, and all of every task, callback
    or torch job started in that window (its end may come later), repeats collapsed (module docstring)."""
    stops: list[Call] = []

    def visit(call: Call, whole: bool) -> None:
        seen: set[tuple[int, str, str]] = set()
        for child in call.children:
            inside = whole or after < child.seq <= until
            if not inside and child.seq > until:
                break  # children are in entry order
            if inside:
                key = (child.line, child.file, child.function)
                if key in seen:
                    continue
                seen.add(key)
                if child.file != call.file:
                    stops.append(child)
            visit(child, inside and child.line == -1 or whole)

    visit(root, False)
    visited: set[str] = set()
    returns = 0
    for stop in stops:
        returns += stop.file in visited
        visited.add(stop.file)
    path = [file for i, file in enumerate(s.file for s in stops) if i == 0 or stops[i - 1].file != file]
    return Walk(name, len(stops), len(visited), returns, path, [f"{s.file}:{s.function}" for s in stops])


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
