"""The call trees `smartgen walk` counts (tools/walk.py's docstring says what is traced and how it is counted): the
profile hook that records every project function entered on behalf of a watched handler (`Tracer`), and the walk
over one tree's window (`walk_of`)."""
from __future__ import annotations

import contextvars
import dis
import functools
import itertools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PROJECT_DIRS = ("services", "shared", "schemas")
WATCHED = ("decode.generate", "prefill.prefill", "decode.open")  # role.verb: the walks reported
STEADY_STEP = 2  # the steady decode step: the calls between TokenEvent STEADY_STEP and STEADY_STEP + 1
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
