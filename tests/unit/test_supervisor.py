"""The supervisor of `smartgen up` (tools/supervisor.py) over real child processes, on a clock the test moves:
who is restarted when, with what, and when it gives up."""
from __future__ import annotations

import subprocess
import sys

from tools.supervisor import BACKOFF_S, MAX_QUICK_DEATHS, QUICK_DEATH_S, Supervisor


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
        assert "broken died 3 times in a row" in verdict and "exit code 2" in verdict and "giving up" in verdict
        assert [s.split("restarting it in ")[1] for s in said] == ["1 s (restart 1)", "2 s (restart 2)"]
        assert len(stack.restart_envs["broken"]) == MAX_QUICK_DEATHS - 1
    finally:
        stack.stop()
