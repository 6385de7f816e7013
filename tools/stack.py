"""The whole stack as local processes: an embedded NATS (unless SMARTGEN_NATS_URL names one) and the
five services, each `python -m services.<role>` (in the test suite, a fork of tools/forkserver.py where
SMARTGEN_FORKSERVER names one). Used by `smartgen up` and by the integration tests.

Secrets, per run: the embedded NATS wants a fresh random token; with an external server the services
take whatever credentials the environment gives (SMARTGEN_NATS_TOKEN…). The admin token is
SMARTGEN_ADMIN_TOKEN(_FILE) if set, else random; so is the cluster secret that every data-plane link must
prove (SMARTGEN_CLUSTER_SECRET(_FILE), shared/dataplane/handshake.py). Services get them as files (mode 0600) in a private
folder, never on a command line; `client_env()` points a tool at them.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from shared.runtime.admin_auth import admin_token_from_env
from shared.runtime.config import write_secret_file
from tools.client import list_workers, request
from tools.forkserver import ForkedProcess, spawn as spawn_forked
from tools.nats_server import NatsServer, die_with_parent, free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
LOG_TAIL_CHARS = 5000  # how much of the log a failed start-up or a dead service shows


@dataclass
class StackSpec:
    num_prefill: int = 1
    num_decode: int = 1
    model: str = ""  # "" = the cached default SmolLM2
    transfer_mode: str = "full"  # "" = the services' own setting (env, settings file, default)
    gateway_port: int = 8000
    num_gateway: int = 1  # the first on gateway_port, named "gateway"; others "gateway-1"… on free ports
    nats_url: str = ""  # "" = start an embedded server
    env: dict[str, str] = field(default_factory=dict)  # extra SMARTGEN_* settings for every service
    log_file: Path | None = None  # None = services log to this terminal


class Stack:
    def __init__(self, spec: StackSpec):
        self.spec = spec
        self.nats: NatsServer | None = None
        self.processes: dict[str, subprocess.Popen | ForkedProcess] = {}
        self._envs: dict[str, tuple[str, dict[str, str]]] = {}
        self._log = None
        self.admin_token = ""  # the bearer token of state-changing admin routes (set by start)
        self.secrets_dir: Path | None = None  # mode 0700: admin-token, cluster-secret (the embedded NATS keeps its own)

    def client_env(self) -> dict[str, str]:
        """SMARTGEN_* settings that let a tool reach this stack's NATS and admin routes (secrets by file)."""
        env = self.nats.client_env() if self.nats else {"SMARTGEN_NATS_URL": self.nats_url}
        return {**env, "SMARTGEN_ADMIN_TOKEN_FILE": str(self.secrets_dir / "admin-token")} if self.secrets_dir else env

    def nats_options(self) -> dict:
        """nats.connect keyword arguments for this stack's NATS (they hold the token: do not log them)."""
        from shared.runtime.natsconn import client_options

        return client_options(self._service_env({**os.environ, **self.spec.env}))

    def _service_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with this run's secrets in place of any the caller set: the admin token, the cluster secret, and
        with the embedded NATS every SMARTGEN_NATS_* setting (its URL and token are its own; an external
        server's stay as given)."""
        replaced = ("SMARTGEN_ADMIN_TOKEN", "SMARTGEN_CLUSTER_SECRET") + (("SMARTGEN_NATS_",) if self.nats else ())
        assert self.secrets_dir, "start() first"
        return {**{k: v for k, v in env.items() if not k.startswith(replaced)}, **self.client_env(),
                "SMARTGEN_CLUSTER_SECRET_FILE": str(self.secrets_dir / "cluster-secret")}

    @property
    def nats_url(self) -> str:
        return self.spec.nats_url or (self.nats.url if self.nats else "")

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.gateway_port}"

    @property
    def gateway_urls(self) -> list[str]:
        """Every gateway's URL, the first's (gateway_url) first: a load balancer's targets."""
        return [f"http://127.0.0.1:{self._envs[name][1]['SMARTGEN_GATEWAY_PORT']}" for name in self.processes
                if name == "gateway" or name.startswith("gateway-")]

    def start(self) -> "Stack":
        self.secrets_dir = Path(tempfile.mkdtemp(prefix="smartgen-stack-"))
        self.admin_token = admin_token_from_env({**os.environ, **self.spec.env}) or secrets.token_urlsafe(32)
        write_secret_file(self.secrets_dir / "admin-token", self.admin_token)
        write_secret_file(self.secrets_dir / "cluster-secret", _cluster_secret({**os.environ, **self.spec.env}))
        if not self.spec.nats_url:
            self.nats = NatsServer().start()
        if self.spec.log_file:
            self._log = open(self.spec.log_file, "ab")
        # Each model process gets its share of the cores, and OpenMP waits passively: spinning threads of
        # several model processes on a small machine made decode steps 3× slower (docs/operations.md, "On small CPU machines").
        num_model_procs = self.spec.num_prefill + self.spec.num_decode
        threads = str(max(1, (os.cpu_count() or 1) // num_model_procs))
        mode = {"SMARTGEN_TRANSFER_MODE": self.spec.transfer_mode} if self.spec.transfer_mode else {}
        base = self._service_env({**os.environ, **mode, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1",
                                  **self.spec.env})
        if self.spec.model:
            base["SMARTGEN_MODEL"] = self.spec.model
        # NOTE: the gateways first: their ports were picked free before this process spawned anything, and a port
        # is only theirs once bound; every other service binds port 0 or connects out, which may be handed the same
        # number meanwhile (an EADDRINUSE seen in CI). The gateway binds first thing, before the others have imported.
        self._spawn("gateway", "gateway", {**base, "SMARTGEN_GATEWAY_PORT": str(self.spec.gateway_port)})
        for i in range(1, self.spec.num_gateway):
            self._spawn(f"gateway-{i}", "gateway", {**base, "SMARTGEN_GATEWAY_PORT": str(free_port())})
        # NOTE: stable ids for the singletons, so a restarted broker answers on the subjects live plans name
        self._spawn("broker", "broker", {"SMARTGEN_WORKER_ID": "broker-0", **base})
        self._spawn("kvprofile", "kvprofile", {"SMARTGEN_WORKER_ID": "kvprofile-0", **base,
                                               "SMARTGEN_TORCH_THREADS": base.get("SMARTGEN_TORCH_THREADS", threads)})
        for i in range(self.spec.num_prefill):
            self._spawn(f"prefill-{i}", "prefill", {**base, "SMARTGEN_TORCH_THREADS": base.get("SMARTGEN_TORCH_THREADS", threads)})
        for i in range(self.spec.num_decode):
            self._spawn(f"decode-{i}", "decode", {**base, "SMARTGEN_TORCH_THREADS": base.get("SMARTGEN_TORCH_THREADS", threads)})
        return self

    def _spawn(self, name: str, role: str, env: dict[str, str]) -> None:
        out = self._log if self._log else None
        self._envs[name] = (role, env)
        if forkserver := os.environ.get("SMARTGEN_FORKSERVER"):  # the test suite's (tools/forkserver.py)
            self.processes[name] = spawn_forked(forkserver, f"services.{role}", [], env, str(REPO_ROOT),
                                                (out or sys.stdout).fileno(), (out or sys.stderr).fileno())
            return
        self.processes[name] = subprocess.Popen([sys.executable, "-m", f"services.{role}"], cwd=REPO_ROOT, env=env,
                                                stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                                preexec_fn=die_with_parent)

    def respawn(self, name: str, extra_env: dict[str, str]) -> None:
        """Start a service that has exited again, with its settings and `extra_env` (tools/supervisor.py)."""
        assert self.processes[name].poll() is not None, f"{name} is still running"
        role, env = self._envs[name]
        self._spawn(name, role, {**env, **extra_env})

    def restart(self, name: str, timeout_s: float = 15.0) -> None:
        """Stop one service (SIGTERM, then SIGKILL) and start it again with the same settings."""
        process = self.processes[name]
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._spawn(name, *self._envs[name])

    def dead(self) -> list[str]:
        return [name for name, p in self.processes.items() if p.poll() is not None]

    def health(self) -> dict:
        """The gateway's GET /health body, whatever its status (`status` says what is missing until "ok")."""
        try:
            return request(self.gateway_url + "/health", timeout=2).body
        except OSError as exc:
            return {"status": f"gateway not answering ({exc})"}

    def log_tail(self, num_chars: int = LOG_TAIL_CHARS) -> str:
        """The last `num_chars` of the services' log file, under a heading ("" when they log to the terminal)."""
        log_file = self.spec.log_file
        if log_file is None or not Path(log_file).is_file():
            return ""
        return f"\n--- the end of {log_file} ---\n" + Path(log_file).read_text(errors="replace")[-num_chars:]

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until the gateway says every role has a worker and has heard from every service this stack started,
        kvprofile included (it registers once its JetStream bucket is open: the gateway serves without it, but a
        stack that started one is not ready before it). Raises if a service dies first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.dead():
                raise RuntimeError(f"services exited during start-up: {', '.join(self.dead())}")
            health = self.health()
            workers = health.get("workers", {})
            if health.get("status") == "ok" and workers.get("prefill", 0) >= self.spec.num_prefill \
                    and workers.get("decode", 0) >= self.spec.num_decode and self._kvprofile_registered():
                return
            time.sleep(0.2)
        raise TimeoutError(f"stack not ready within {timeout_s} s: {self.health()}")

    def _kvprofile_registered(self) -> bool:
        try:
            return any(w["role"] == "kvprofile" for w in list_workers(self.gateway_url, self.admin_token, timeout=2))
        except (OSError, RuntimeError):
            return False

    def stop(self, timeout_s: float = 15.0) -> dict[str, int]:
        """SIGTERM every service, then SIGKILL stragglers; stop NATS last. Returns exit codes."""
        for p in self.processes.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes = {}
        for name, p in self.processes.items():
            try:
                codes[name] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait()
        if self.nats:
            self.nats.stop()
        if self._log:
            self._log.close()
        if self.secrets_dir:
            shutil.rmtree(self.secrets_dir, ignore_errors=True)
        return codes

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- fault injection (tests/integration/test_faults.py) -------------------------------------
    def restart_nats(self, down_s: float = 0.0) -> None:
        """Kill the embedded nats-server and start it again on the same port with the same token and JetStream
        store, after `down_s` seconds; the services reconnect by themselves."""
        if self.nats is None or self.nats.process is None:
            raise RuntimeError("restart_nats needs the stack's embedded NATS (SMARTGEN_NATS_URL names another)")
        self.nats.process.kill()  # NOTE: not stop(): that also deletes the store (profiles, the token files)
        self.nats.process.wait()
        time.sleep(down_s)
        self.nats.start()


def _cluster_secret(env: dict[str, str]) -> str:
    """The data plane's cluster secret: SMARTGEN_CLUSTER_SECRET(_FILE) where set (a stack that must link with
    workers started elsewhere), else a fresh random one for this run."""
    if env.get("SMARTGEN_CLUSTER_SECRET_FILE"):
        return Path(env["SMARTGEN_CLUSTER_SECRET_FILE"]).read_text().removesuffix("\n").removesuffix("\r")
    return env.get("SMARTGEN_CLUSTER_SECRET") or secrets.token_urlsafe(32)


class StackNotReady(RuntimeError):
    """The stack did not become ready (a service exited, or time ran out); the message ends with the log tail."""


@contextmanager
def started_stack(spec: StackSpec, timeout_s: float = 180.0, may_die: Container[str] = ()) -> Iterator[Stack]:
    """Start a stack, wait until it is ready (Stack.wait_ready), yield it, and stop it on exit.

    Raises StackNotReady, with the tail of `spec.log_file`, when it is not ready within `timeout_s` (having
    stopped what had started). On exit, if services other than those in `may_die` (read then, so a set the
    caller fills while the stack runs works) have died, their names and the log tail go to stderr."""
    stack = Stack(spec).start()
    try:
        stack.wait_ready(timeout_s)
    except Exception as exc:
        stack.stop()
        raise StackNotReady(f"{exc}{stack.log_tail()}") from exc
    except BaseException:
        stack.stop()
        raise
    try:
        yield stack
    finally:
        died = [name for name in stack.dead() if name not in may_die]
        if died:
            print(f"services died: {', '.join(died)}{stack.log_tail()}", file=sys.stderr, flush=True)
        stack.stop()
