"""The supervisor of `smartgen up` (tools/supervisor.py) over real child processes, on a clock the test moves:
who is restarted when, with what, and when it gives up."""
from __future__ import annotations

import subprocess
import sys
import urllib.request

from tools.supervisor import BACKOFF_S, MAX_QUICK_DEATHS, QUICK_DEATH_S, Supervisor
from tools.supervisor_metrics import serve_metrics


class ProcessStack:
    """Just what the supervisor uses of tools.stack.Stack: named child processes it can start again."""

    def __init__(self, **scripts: str):
        self.nats = None
        self.scripts = scripts
        self.restart_envs: dict[str, list[dict[str, str]]] = {name: [] for name in scripts}
        self.processes = {name: self._popen(script) for name, script in scripts.items()}

    def _popen(self, script: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", script])

    def respawn(self, name: str, extra_env: dict[str, str]) -> None:
        assert self.processes[name].poll() is not None
        self.restart_envs[name].append(extra_env)
        self.processes[name] = self._popen(self.scripts[name])

    def stop(self) -> None:
        for p in self.processes.values():
            p.kill()
            p.wait()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_service_that_had_run_a_while_is_restarted_after_one_second_and_the_rest_are_left_alone():
    stack = ProcessStack(worker="import time; time.sleep(60)", other="import time; time.sleep(60)")
    clock, said = Clock(), []
    supervisor = Supervisor(stack, said.append, clock)
    try:
        clock.now = QUICK_DEATH_S + 5
        victim, bystander = stack.processes["worker"], stack.processes["other"]
        victim.kill()
        victim.wait()
        assert supervisor.poll() == ""
        assert said == [f"worker exited (killed by SIGKILL) after {QUICK_DEATH_S + 5:.0f} s; restarting it in 1 s "
                        "(restart 1)"]
        clock.now += 0.5
        assert supervisor.poll() == "" and stack.processes["worker"] is victim, "not before its backoff"
        clock.now += 0.6
        assert supervisor.poll() == ""
        assert stack.processes["worker"] is not victim and stack.processes["worker"].poll() is None
        assert stack.restart_envs["worker"] == [{"SMARTGEN_RESTARTS": "1"}]
        assert stack.processes["other"] is bystander and bystander.poll() is None and not stack.restart_envs["other"]
        assert supervisor.total_restarts() == 1
    finally:
        stack.stop()


def test_a_service_that_keeps_dying_at_start_backs_off_then_is_given_up_on():
    stack = ProcessStack(broken="raise SystemExit(2)")
    clock, said = Clock(), []
    supervisor = Supervisor(stack, said.append, clock)
    try:
        verdict = ""
        for _ in range(MAX_QUICK_DEATHS):
            stack.processes["broken"].wait()
            clock.now += 0.1
            verdict = supervisor.poll()
            if verdict:
                break
            clock.now += BACKOFF_S[-1]
            assert supervisor.poll() == ""  # started again
        assert f"broken died {MAX_QUICK_DEATHS} times in a row" in verdict and "exit code 2" in verdict
        assert "giving up" in verdict and "no broken replica is left" in verdict
        # the whole backoff, as documented: 1, 2, 4, … 30 s
        assert [s.split("restarting it in ")[1].split(" s ")[0] for s in said] == [f"{b:g}" for b in BACKOFF_S]
        assert len(stack.restart_envs["broken"]) == MAX_QUICK_DEATHS - 1
    finally:
        stack.stop()


def test_a_crash_looping_replica_stays_down_while_another_of_its_role_serves():
    """Two decode replicas, one crash-looping: after its backoff it is left down and said so, the stack goes on
    (poll returns ""), the healthy replica is untouched; had it been the last of its role, the stack would stop."""
    stack = ProcessStack(**{"decode-0": "raise SystemExit(3)", "decode-1": "import time; time.sleep(60)"})
    clock, said = Clock(), []
    supervisor = Supervisor(stack, said.append, clock)
    healthy = stack.processes["decode-1"]
    try:
        for _ in range(MAX_QUICK_DEATHS):
            stack.processes["decode-0"].wait()
            clock.now += 0.1
            assert supervisor.poll() == ""  # never a reason to stop: decode-1 serves
            clock.now += BACKOFF_S[-1]
            supervisor.poll()
        assert supervisor.given_up() == ["decode-0"]
        assert "giving up on it" in said[-1] and "1 other decode replica(s) keep serving" in said[-1]
        assert stack.processes["decode-1"] is healthy and healthy.poll() is None
        clock.now += 100
        assert supervisor.poll() == "" and len(stack.restart_envs["decode-0"]) == MAX_QUICK_DEATHS - 1  # left down
    finally:
        stack.stop()


def test_the_supervisor_metrics_show_a_crash_looping_replica_down_while_the_other_runs():
    """`smartgen up`'s /metrics (over a real socket): the given-up replica is down and given up, with its restarts;
    a dead service waiting out its backoff shows the seconds left; the healthy one is up."""
    stack = ProcessStack(**{"decode-0": "raise SystemExit(3)", "decode-1": "import time; time.sleep(60)",
                            "broker": "import time; time.sleep(60)"})
    clock = Clock()
    supervisor = Supervisor(stack, lambda _: None, clock)
    server = serve_metrics(supervisor)
    try:
        for _ in range(MAX_QUICK_DEATHS):
            stack.processes["decode-0"].wait()
            clock.now += 0.1
            supervisor.poll()
            clock.now += BACKOFF_S[-1]
            supervisor.poll()
        stack.processes["broker"].kill()
        stack.processes["broker"].wait()
        supervisor.poll()  # dead: restarted in 1 s
        clock.now += 0.25
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics") as response:
            text = response.read().decode()
        assert 'smartgen_supervisor_given_up{service="decode-0"} 1.0' in text
        assert 'smartgen_supervisor_service_up{service="decode-0"} 0.0' in text
        assert f'smartgen_supervisor_restarts_total{{service="decode-0"}} {MAX_QUICK_DEATHS - 1:.1f}' in text
        assert 'smartgen_supervisor_service_up{service="decode-1"} 1.0' in text
        assert 'smartgen_supervisor_given_up{service="decode-1"} 0.0' in text
        assert 'smartgen_supervisor_service_up{service="broker"} 0.0' in text
        assert 'smartgen_supervisor_backoff_seconds{service="broker"} 0.75' in text
    finally:
        server.shutdown()
        stack.stop()
