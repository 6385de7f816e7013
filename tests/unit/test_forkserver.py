"""tools/forkserver.py, the suite's fork server (the session's, tests/conftest.py): a fork runs the module with the
environment, folder, arguments and stdout it was given; its exit code and death by a signal read as Popen's; a
client that goes away takes its process with it."""
from __future__ import annotations

import signal
import subprocess
import time

import psutil
import pytest

from tools.forkserver import spawn
from tools.stack import REPO_ROOT


def _spawn(server: str, args: list[str], out, cwd) -> object:
    # NOTE: the repository on PYTHONPATH: the probe's module is found from the fork's folder (`cwd`) too
    return spawn(server, "tests.forkserver_probe", args, {"PROBE": "hello", "PYTHONPATH": str(REPO_ROOT)}, str(cwd),
                 out.fileno(), out.fileno())


def test_a_fork_runs_the_module_as_asked_and_its_exit_code_comes_back(forkserver, tmp_path):
    if not forkserver:
        pytest.skip("SMARTGEN_FORKSERVER=0")
    with open(tmp_path / "out", "wb") as out:
        process = _spawn(forkserver, ["7"], out, tmp_path)
        assert process.wait(30) == 7 and process.poll() == 7
    assert (tmp_path / "out").read_text().split() == ["hello", str(tmp_path)]
    assert not psutil.pid_exists(process.pid)  # reaped by the server, which told us its exit code then


def test_a_killed_fork_reads_as_popen_and_a_gone_client_takes_its_process(forkserver, tmp_path):
    if not forkserver:
        pytest.skip("SMARTGEN_FORKSERVER=0")
    with open(tmp_path / "out", "wb") as out:
        killed = _spawn(forkserver, ["sleep"], out, tmp_path)
        with pytest.raises(subprocess.TimeoutExpired):
            killed.wait(0.5)
        assert killed.poll() is None
        killed.kill()
        assert killed.wait(10) == -signal.SIGKILL
        orphan = _spawn(forkserver, ["sleep"], out, tmp_path)
        assert psutil.pid_exists(orphan.pid)
        orphan.sock.close()  # as if the client died
        deadline = time.monotonic() + 10
        while psutil.pid_exists(orphan.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not psutil.pid_exists(orphan.pid), "the fork outlived its client"
