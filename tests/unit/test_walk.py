"""tools/walk_trace.py's counting on hand-built call trees (the tracing itself runs in tests/integration/test_walk.py)."""
from __future__ import annotations

import itertools

from tools.walk_trace import Call, walk_of

_seq = itertools.count()


def call(parent: Call, file: str, function: str, line: int) -> Call:
    child = Call(file, function, line, next(_seq), parent)
    parent.children.append(child)
    return child


def test_stops_files_and_returns():
    """A → B → A' → C counts 4 stops in 3 files with 1 return; a callee in its caller's file is no stop."""
    root = Call("", "decode.generate", -1, next(_seq))
    a = call(root, "a.py", "handler", -1)
    call(a, "a.py", "helper", 3)  # same file: no stop
    b = call(a, "b.py", "f", 4)
    call(b, "a.py", "back", 9)  # into a.py again: a return
    call(a, "c.py", "g", 5)
    walk = walk_of("w", root, -1, 10**9)
    assert (walk.stops, walk.files, walk.returns) == (4, 3, 1)
    assert walk.path == ["a.py", "b.py", "a.py", "c.py"]
    assert walk.functions[0] == "a.py:handler"


def test_a_loop_is_one_visit():
    """The same callee from the same line (a loop) counts once; from another line it counts again."""
    root = Call("", "w", -1, next(_seq))
    a = call(root, "a.py", "run", -1)
    for _ in range(30):  # e.g. one call per layer
        call(call(a, "b.py", "step", 7), "c.py", "kernel", 2)
    call(a, "b.py", "step", 8)
    walk = walk_of("w", root, -1, 10**9)
    assert walk.functions == ["a.py:run", "b.py:step", "c.py:kernel", "b.py:step"]
    assert walk.returns == 1


def test_window_keeps_started_tasks_whole():
    """A window holds calls entered inside it, and all of a task started inside it, not a direct call after it."""
    root = Call("", "w", -1, next(_seq))
    a = call(root, "a.py", "run", -1)
    call(a, "b.py", "before", 2)
    start = next(_seq)
    task = call(a, "t.py", "task", -1)  # started inside the window
    end = next(_seq)
    call(task, "u.py", "later", 3)  # entered after the window: still the task's
    call(a, "c.py", "after", 4)  # a direct call after the window: out
    walk = walk_of("w", root, start, end)
    assert walk.functions == ["t.py:task", "u.py:later"]
