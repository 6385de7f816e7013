"""Keeps a Stack's services running (`smartgen up`): a service that dies is started again, the rest keep serving.

- A death is logged with its exit code and how long the process lived, and the service is started again after
  a backoff: 1 s, then 2, 4, 8, 16, 30 s while it keeps dying soon after each start (back to 1 s once it
  has lived QUICK_DEATH_S). The new process gets SMARTGEN_RESTARTS (its `smartgen_service_restarts` metric).
- A service that dies within QUICK_DEATH_S of its start MAX_QUICK_DEATHS times in a row (after the whole backoff,
  up to 30 s) is crash-looping: it stays down, and the log says so. The stack goes on while its role has another
  replica running (a second decode worker serves); only when a role has no replica left, or NATS does not come
  back, `poll` returns a message saying why and the caller stops the stack (a bad setting will not fix itself).
- `smartgen up` serves this state as its own /metrics (tools/supervisor_metrics.py): a replica that is down
  has no /metrics of its own to say so.
- The embedded NATS server is restarted the same way, on the same port with the same token and store, so the
  services reconnect by themselves.
While a decode or prefill worker is away the gateway routes around it: its heartbeats stop, the registry drops
it, and requests go to the replicas left (or get a 503 naming the missing role when there is none).
"""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from tools.stack import Stack

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # by the number of quick deaths in a row, less one
QUICK_DEATH_S = 60.0  # a death this soon after a start counts toward giving up (a model loads in ~10 s)
MAX_QUICK_DEATHS = len(BACKOFF_S) + 1  # so the backoff reaches its 30 s before a service is given up on
NATS = "nats"  # the embedded server's name in messages


@dataclass
class _Service:
    started: float  # monotonic seconds
    restarts: int = 0
    quick_deaths: int = 0  # deaths in a row, each within QUICK_DEATH_S of its start
    restart_at: float | None = None  # set while the service is dead and waiting out its backoff
    given_up: bool = False  # crash-looping: left down


class Supervisor:
    def __init__(self, stack: Stack, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 backoff_s: tuple[float, ...] = BACKOFF_S):
        """`backoff_s`: the pauses before each restart of a service that keeps dying soon after starting (it is
        given up on after len(backoff_s) + 1 such deaths; SMARTGEN_RESTART_BACKOFF_S sets them in `smartgen up`)."""
        self.stack, self.say, self.clock, self.backoff_s = stack, say, clock, backoff_s
        self.max_quick_deaths = len(backoff_s) + 1
        now = clock()
        self.services = {name: _Service(now) for name in [*stack.processes, *([NATS] if stack.nats else [])]}

    def total_restarts(self) -> int:
        return sum(s.restarts for s in self.services.values())

    def is_running(self, name: str) -> bool:
        """The service's process is alive (not dead, waiting out its backoff, or given up on)."""
        service = self.services[name]
        return not service.given_up and service.restart_at is None and self._exit_code(name) is None

    def given_up(self) -> list[str]:
        """The services left down because they kept dying at start-up."""
        return [name for name, s in self.services.items() if s.given_up]

    def poll(self) -> str:
        """Look at every service once: note new deaths, start those whose backoff is over. Returns "" or, when a
        service keeps dying at start-up, why the stack should stop."""
        now = self.clock()
        for name, service in self.services.items():
            if service.given_up:
                continue
            if service.restart_at is not None:
                if now >= service.restart_at:
                    self._start_again(name, service, now)
                continue
            code = self._exit_code(name)
            if code is None:
                continue
            lived_s = now - service.started
            service.quick_deaths = service.quick_deaths + 1 if lived_s < QUICK_DEATH_S else 0
            if service.quick_deaths >= self.max_quick_deaths:
                service.given_up = True
                why = (f"{name} died {service.quick_deaths} times in a row within {QUICK_DEATH_S:.0f} s of starting "
                       f"(last: {_describe(code)}); giving up on it — its log above says why")
                role = _role(name)
                left = [other for other, s in self.services.items() if _role(other) == role and not s.given_up]
                if name == NATS or not left:
                    return why + ("" if name == NATS else f"; no {role} replica is left")
                self.say(f"{why}; {len(left)} other {role} replica(s) keep serving")
                continue
            delay = self.backoff_s[min(max(service.quick_deaths - 1, 0), len(self.backoff_s) - 1)]
            service.restart_at = now + delay
            self.say(f"{name} exited ({_describe(code)}) after {lived_s:.0f} s; restarting it in {delay:g} s "
                     f"(restart {service.restarts + 1})")
        return ""

    def _exit_code(self, name: str) -> int | None:
        if name == NATS:
            assert self.stack.nats is not None
            process = self.stack.nats.process
            return None if process is None else process.poll()
        return self.stack.processes[name].poll()

    def _start_again(self, name: str, service: _Service, now: float) -> None:
        service.restarts += 1
        service.restart_at, service.started = None, now
        if name == NATS:
            assert self.stack.nats is not None
            try:
                self.stack.nats.start()  # same port, token and store: the services reconnect by themselves
            except (RuntimeError, TimeoutError) as exc:  # its process is dead: the next poll counts the death
                self.say(f"{NATS} did not come back: {exc}")
        else:
            self.stack.respawn(name, {"SMARTGEN_RESTARTS": str(service.restarts)})


def _role(name: str) -> str:
    """A process's role from its name in the stack ("decode-1" → "decode", "gateway" → "gateway")."""
    base, _, index = name.rpartition("-")
    return base if base and index.isdigit() else name


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
