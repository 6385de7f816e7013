"""The resident memory (RSS) of a running stack's processes, for `smartgen loadtest`.

The services come from the gateway's GET /workers (role, id, pid, host); the gateway lists itself there too.
NATS is found as the `nats-server` process listening on a port the gateway is connected to (needs psutil;
without it NATS is left out, and said so). RSS is VmRSS from /proc/<pid>/status.
NOTE: a pid means something only on its own machine (and in its own PID namespace): services whose `host`
is not this machine's name, or whose pid is not alive here, are listed with no figures and a note.
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.client import list_workers

MIB = 1024 * 1024


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a live process on this machine, in bytes; None when it is gone or not readable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class ProcessMemory:
    """One process's RSS over a run, in bytes (None = not measurable here)."""

    name: str  # the worker id, or "nats-server"
    role: str
    pid: int | None
    start: int | None = None
    warm: int | None = None  # after the warm-up (the first tenth of the run): growth from here on suggests a leak
    max: int | None = None
    end: int | None = None
    note: str = ""

    def sample(self) -> int | None:
        rss = rss_bytes(self.pid) if self.pid else None
        if rss is not None:
            self.start = rss if self.start is None else self.start
            self.max = max(self.max or 0, rss)
        return rss

    def as_dict(self) -> dict:
        mib = lambda b: None if b is None else round(b / MIB, 1)  # noqa: E731
        return {"role": self.role, "pid": self.pid, "start_mib": mib(self.start), "warm_mib": mib(self.warm),
                "max_mib": mib(self.max), "end_mib": mib(self.end), "note": self.note}


@dataclass
class StackMemory:
    """Every process of the stack, sampled together."""

    processes: list[ProcessMemory] = field(default_factory=list)
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (seconds since the first sample, total MiB)
    _first_sample_at: float | None = None

    @classmethod
    def discover(cls, gateway_url: str, nats_pid: int | None = None) -> "StackMemory":
        """From /workers (and the NATS process: `nats_pid` when the caller started it, else looked up)."""
        here = socket.gethostname()
        processes, gateway_pid = [], None
        for w in list_workers(gateway_url):
            local = w.get("host") in (here, "", None) and rss_bytes(w["pid"]) is not None
            note = "" if local else f"not on this machine (host {w.get('host')!r}, pid {w['pid']})"
            processes.append(ProcessMemory(w["id"], w["role"], w["pid"] if local else None, note=note))
            if w["role"] == "gateway" and local:
                gateway_pid = w["pid"]
        if not any(p.role == "gateway" for p in processes):
            processes.append(ProcessMemory("gateway", "gateway", None, note="the gateway is not in /workers"))
        nats_pid, note = (nats_pid, "") if nats_pid else _find_nats(gateway_pid)
        processes.append(ProcessMemory("nats-server", "nats", nats_pid, note=note))
        return cls(sorted(processes, key=lambda p: (p.role, p.name)))

    def sample(self, is_warm_mark: bool = False) -> int:
        """Sample every process (the warm-up figures too if `is_warm_mark`); returns the total RSS now, in bytes."""
        total = 0
        for p in self.processes:
            rss = p.sample()
            total += rss or 0
            if is_warm_mark:
                p.warm = rss
        now = time.monotonic()
        self._first_sample_at = self._first_sample_at if self._first_sample_at is not None else now
        self.timeline.append((round(now - self._first_sample_at, 1), round(total / MIB, 1)))
        return total

    def finish(self) -> None:
        """The end figures: one last sample."""
        for p in self.processes:
            p.end = p.sample()

    def as_dict(self) -> dict[str, dict]:
        return {p.name: p.as_dict() for p in self.processes}


def _find_nats(gateway_pid: int | None) -> tuple[int | None, str]:
    """(pid, note) of the nats-server the gateway is connected to."""
    if gateway_pid is None:
        return None, "not found: the gateway is not on this machine"
    try:
        import psutil  # a test extra: only this lookup needs it
    except ImportError:
        return None, "not looked up: needs psutil (pip install psutil)"
    try:
        peer_ports = {c.raddr.port for c in psutil.Process(gateway_pid).net_connections("tcp") if c.raddr}
        for proc in psutil.process_iter(["name"]):
            if "nats-server" not in (proc.info["name"] or ""):
                continue
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port in peer_ports for c in proc.net_connections("tcp")):
                    return proc.pid, ""
            except psutil.Error:
                continue
    except psutil.Error as exc:
        return None, f"not found: {exc}"
    return None, "not found on this machine (a NATS of its own elsewhere?)"
