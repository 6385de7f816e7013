"""A fork server for the test suite: one interpreter imports torch, transformers and the other heavy libraries
once, and every service a Stack starts is a fork of it instead of a fresh `python -m services.<role>`.

Why: a model process spends ~8 s of CPU importing torch and transformers before it runs a line of ours, and the
suite starts about fifty stacks of three to five such processes on two cores: most of its time went there.
A fork is a real process all the same (its own pid, memory, sockets, signals; `kill -9` kills it), entered
through the same `services.<role>.__main__` as on the command line, with the environment, working folder and
stdout/stderr the Stack gives it. What differs: third-party modules are imported already (never ours, so
nothing of ours reads its settings before the fork), and /proc/<pid>/cmdline shows this server's command.
`smartgen up` and `make up` never use it; tests/conftest.py starts one per session and names its socket in
SMARTGEN_FORKSERVER, which tools/stack.py follows when set (tests that check the cold path unset it).

Protocol (AF_UNIX SOCK_SEQPACKET, one connection a process): the client sends one message, JSON
{"module", "args", "env", "cwd"} with its stdout and stderr as two file descriptors (SCM_RIGHTS); the server
answers {"pid": n}, and {"exit": code} (Popen's returncode: -N for signal N) once the process has ended, then
closes. A client that goes away (closes, dies) takes its process with it: SIGTERM, as die_with_parent does.

    python -m tools.forkserver PATH      # serves until killed; PATH appears once the imports are done
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import traceback

PRELOAD = ("numpy", "torch", "transformers", "transformers.models.llama.modeling_llama", "transformers.cache_utils",
           "transformers.masking_utils", "transformers.integrations.sdpa_attention", "tokenizers", "safetensors",
           "aiohttp", "nats", "msgpack", "structlog", "crc32c")
MAX_MESSAGE = 1 << 20  # bytes: a request (its environment) is a few KiB


class ForkedProcess:
    """The client's handle on a forked service, as much of subprocess.Popen as a Stack uses."""

    def __init__(self, sock: socket.socket, pid: int, args: list[str]):
        self.sock, self.pid, self.args = sock, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._receive(timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _receive(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)
        try:
            message = self.sock.recv(MAX_MESSAGE)
        except (BlockingIOError, TimeoutError):
            return
        # NOTE: the server gone without a word: its processes died with it (PDEATHSIG)
        self.returncode = json.loads(message)["exit"] if message else -signal.SIGKILL
        self.sock.close()


def spawn(server: str, module: str, args: list[str], env: dict[str, str], cwd: str, stdout: int,
          stderr: int) -> ForkedProcess:
    """Start `python -m module *args` as a fork of the server listening at `server`."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(server)
    request = json.dumps({"module": module, "args": args, "env": env, "cwd": cwd}).encode()
    socket.send_fds(sock, [request], [stdout, stderr])
    reply = sock.recv(MAX_MESSAGE)
    if not reply:
        raise RuntimeError(f"the fork server at {server} did not start {module}")
    return ForkedProcess(sock, json.loads(reply)["pid"], [sys.executable, "-m", module, *args])


# --- the server -----------------------------------------------------------------------------------------
def serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # NOTE: the path appears only once requests can be served
    clients: dict[int, socket.socket] = {}  # pid → the connection that asked for it
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in events.select(timeout=0.02):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _start(conn, listener, clients)
                if pid:
                    clients[pid] = conn
                    events.register(conn, selectors.EVENT_READ, pid)
            else:  # a client never sends twice: this is its end (closed, or its process died)
                _stop(key.data)
        while True:  # reap: each ended process's client learns its exit code
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            conn = clients.pop(pid, None)
            if conn is not None:
                events.unregister(conn)
                try:
                    conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _start(conn: socket.socket, listener: socket.socket, clients: dict[int, socket.socket]) -> int:
    """Fork the process `conn` asks for; its pid (0 if the request was unreadable)."""
    try:
        message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
        request = json.loads(message)
    except (OSError, ValueError):
        conn.close()
        return 0
    pid = os.fork()
    if pid == 0:
        _run_child(request, fds, [listener, conn, *clients.values()])
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    return pid


def _run_child(request: dict, fds: list[int], inherited: list[socket.socket]) -> None:
    """In the fork: become `python -m <module> <args>` with the client's environment, folder and stdout/stderr."""
    code = 1
    try:
        for sock in inherited:
            sock.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from tools.nats_server import die_with_parent

        die_with_parent()  # as a Stack's own children: SIGTERM when the server dies, and a process group of its own
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # as the interpreter exits: None is 0, a number is itself, anything else is printed, 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
