"""CPU seconds the stack's processes spent during one request's decode phase (from its second token to its last),
read from /proc: on a machine where the prefill worker, the decode worker and the rest share the cores (the
benchmark's: two), what the decode steps competed with; separate prefill and decode nodes would not share them.

Linux only (elsewhere every figure is None). Valid for requests served one at a time: a window counts whatever ran.
"""
from __future__ import annotations

import os
import threading

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def _process_cpu_s(pid: int) -> float | None:
    """Seconds `pid`'s threads ran, None if it is gone (or there is no /proc): the scheduler's runtime (schedstat,
    the clock of `time.thread_time`, to the nanosecond), not utime + stime, which count whole clock ticks."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
                continue
    except OSError:
        return None
    return total / 1e9


def _machine_busy_s() -> float | None:
    """CPU seconds the whole machine was busy (every CPU, /proc/stat: all but idle and iowait; clock ticks): what
    ran besides the stack (another job on the machine) shows here and in no role."""
    try:
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(values[:8]) - values[3] - values[4]) * _TICK_S


class DecodeCpu:
    """One request's decode-phase CPU by role: `on_token(i)` from the client as token i arrives starts the window at
    token 1 (the second token) and moves its end to each later token; `seconds()` once the stream is over."""

    def __init__(self, pids: dict[str, list[int]]):
        self.pids = pids  # role → its processes' pids
        self._lock = threading.Lock()
        self._start: dict[str, float | None] | None = None
        self._end: dict[str, float | None] | None = None

    def _sample(self) -> dict[str, float | None]:
        sample: dict[str, float | None] = {"machine": _machine_busy_s()}
        for role, pids in self.pids.items():
            times = [_process_cpu_s(pid) for pid in pids]
            sample[role] = None if any(t is None for t in times) else sum(t for t in times if t is not None)
        return sample

    def on_token(self, index: int) -> None:
        if index < 1:
            return
        sample = self._sample()
        with self._lock:
            if index == 1:
                self._start = sample
            else:
                self._end = sample

    def seconds(self) -> dict[str, float | None]:
        """role (and "machine") → CPU seconds between token 1 and the last token; {} if the stream had < 3 tokens."""
        if self._start is None or self._end is None:
            return {}
        return {role: (self._end[role] - start) if start is not None and self._end.get(role) is not None else None
                for role, start in self._start.items()}


def stack_pids(workers: list[dict]) -> dict[str, list[int]]:
    """role → pids of the gateway's worker list (`/workers`), for the processes on this machine."""
    pids: dict[str, list[int]] = {}
    for w in workers:
        if w.get("pid") and os.path.exists(f"/proc/{w['pid']}"):
            pids.setdefault(w["role"], []).append(int(w["pid"]))
    return pids
