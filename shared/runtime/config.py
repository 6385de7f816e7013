"""Service configuration: one dataclass per service, filled from CLI flags, then env, then the settings file, then
defaults.

Each field `foo_bar` is set by `--foo-bar`, `SMARTGEN_FOO_BAR` or `foo_bar = …` in the settings file
(shared/runtime/settings_file.py); its comment is the flag's help. A service's config class
subclasses `ServiceConfig` and validates itself in `validate()` with a sentence a person can act on.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from schemas.subjects import is_token
from shared.runtime.tracing import has_otlp_exporter, otlp_endpoint
from shared.runtime.settings_file import ROLES, SettingsFileError, field_help, file_values, read_settings_file

C = TypeVar("C", bound="ServiceConfig")
ENV_PREFIX = "SMARTGEN_"
CONFIG_ENV = "SMARTGEN_CONFIG"  # the settings file, where no --config says
SHOW_CONFIG_FLAG = "--show-config"
# Settings that hold a secret: each can instead be read from the file named by `<name>_file` (docker secrets).
# NOTE: their fields are repr=False and nothing logs them; keep it that way for any secret added here.
SECRET_FIELDS = ("nats_token", "nats_password", "admin_token", "cluster_secret", "api_key")


class ConfigError(ValueError):
    """A setting that cannot work, with a message that says how to fix it."""


@dataclass(slots=True)
class ServiceConfig:
    nats_url: str = "nats://127.0.0.1:4222"  # several, comma-separated, for a cluster: the client fails over
    namespace: str = ""  # subjects under smartgen.<namespace>. and a bucket of its own: stacks sharing one NATS
    host: str = "127.0.0.1"  # bind address of the admin server (and data plane); loopback unless told otherwise
    advertise_host: str = ""  # the name peers reach this process by (e.g. its compose service); "" = host
    admin_port: int = 0  # 0 = pick a free port and advertise it
    worker_id: str = ""  # "" = "<role>-<8 hex>"
    log_level: str = "info"  # debug, info, warning or error (other libraries log from warning on)
    heartbeat_s: float = 1.0  # how often this process announces itself (load, addresses) on NATS
    restarts: int = 0  # how many times a supervisor (`smartgen up`) started this service again after it died
    # NATS credentials (see shared/runtime/natsconn.py): a token, or a user and password; none = an open server
    nats_token: str = field(default="", repr=False)
    nats_token_file: str = ""  # a file holding nats_token (e.g. /run/secrets/nats_token)
    nats_user: str = ""
    nats_password: str = field(default="", repr=False)
    nats_password_file: str = ""
    nats_creds: str = ""  # a .creds file (user JWT + NKey seed) for a server in operator/JWT mode
    # TLS to NATS: on when nats_url is tls:// or a CA is given; the client pair only if the server asks for one
    nats_tls_ca: str = ""  # PEM bundle of the CA that signed the server's certificate ("" = the system's CAs)
    nats_tls_cert: str = ""  # PEM client certificate
    nats_tls_key: str = ""  # PEM private key of nats_tls_cert
    # Bearer token for admin routes that change state (POST/DELETE…); "" = those routes answer 403
    admin_token: str = field(default="", repr=False)
    admin_token_file: str = ""
    # On SIGTERM/SIGINT a service first drains: it takes nothing new (its heartbeats say so, so gateways pick
    # others) and waits up to this long for what it holds to finish, then stops (0 = stop at once)
    drain_s: float = 30.0
    # The HTTP server closes a connection that has not sent a whole request head (request line and headers) within
    # this long of connecting or of its last response: a client trickling its headers (slowloris) holds a socket
    # for this long at most. The same limit closes an idle keep-alive connection.
    header_timeout_s: float = 10.0
    # OpenTelemetry tracing (shared/runtime/tracing.py): one trace per request across the services, its context
    # carried in NATS headers; spans go to tracing_file and/or the OTLP collector at OTEL_EXPORTER_OTLP_ENDPOINT
    tracing: bool = False
    tracing_file: str = ""  # JSON lines, one span a line, appended; every process of a stack may share one file

    @property
    def nats_urls(self) -> list[str]:
        """The servers of `nats_url` (one, or a cluster's, comma-separated)."""
        return [url.strip() for url in self.nats_url.split(",") if url.strip()]

    @property
    def public_host(self) -> str:
        """The host name or address peers reach this process by: `advertise_host`; else, bound to every
        interface (a container), this host's own address, so each replica of a scaled service advertises
        itself; else `host`."""
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return own_address()
        return self.host

    def validate(self) -> None:
        self.read_secret_files()
        for url in self.nats_urls:
            if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ConfigError(f"nats_url {url!r} must start with nats:// (or tls://); several are comma-separated")
        if self.namespace and not is_token(self.namespace):
            raise ConfigError(f"namespace {self.namespace!r} must be letters, digits, '-' or '_' (one subject token)")
        if self.nats_creds:
            if self.nats_token or self.nats_user:
                raise ConfigError("NATS takes a .creds file or a token or a user and password: keep one of "
                                  "SMARTGEN_NATS_CREDS, SMARTGEN_NATS_TOKEN, SMARTGEN_NATS_USER")
            if not Path(self.nats_creds).is_file():
                raise ConfigError(f"nats_creds {self.nats_creds!r} is not a file (set SMARTGEN_NATS_CREDS to a .creds file)")
        if not 0 <= self.admin_port < 65536:
            raise ConfigError(f"admin_port {self.admin_port} is not a TCP port")
        if self.heartbeat_s <= 0:
            raise ConfigError("heartbeat_s must be positive")
        if self.header_timeout_s <= 0:
            raise ConfigError("header_timeout_s must be positive (seconds a client has to send a request's headers)")
        if self.restarts < 0:
            raise ConfigError("restarts must be ≥ 0")
        if self.worker_id and not is_token(self.worker_id):
            raise ConfigError(f"worker_id {self.worker_id!r} must be letters, digits, '-' or '_' (it is part of NATS subjects)")
        if self.tracing and not (self.tracing_file or (otlp_endpoint() and has_otlp_exporter())):
            raise ConfigError("tracing needs somewhere to send spans: set SMARTGEN_TRACING_FILE, or "
                              "OTEL_EXPORTER_OTLP_ENDPOINT (with opentelemetry-exporter-otlp-proto-http installed)")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log_level {self.log_level!r}: use debug, info, warning or error")
        if self.nats_token and (self.nats_user or self.nats_password):
            raise ConfigError("NATS takes a token or a user and password, not both: unset SMARTGEN_NATS_TOKEN or SMARTGEN_NATS_USER")
        if bool(self.nats_user) != bool(self.nats_password):
            raise ConfigError("set both SMARTGEN_NATS_USER and SMARTGEN_NATS_PASSWORD (or _FILE), or neither")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ConfigError("a NATS client certificate needs its key: set both SMARTGEN_NATS_TLS_CERT and SMARTGEN_NATS_TLS_KEY")
        for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name} {path!r} is not a file (set {env_name(name)} to a PEM file)")

    def read_secret_files(self) -> None:
        """Fill each secret from its `_file` setting. Idempotent; both set to different values is an error."""
        for name in SECRET_FIELDS:
            path = getattr(self, name + "_file", "")  # cluster_secret: model workers only
            if not path:
                continue
            try:
                # NOTE: one trailing newline is dropped (echo and most editors add one); other whitespace counts
                secret = Path(path).read_text().removesuffix("\n").removesuffix("\r")
            except OSError as exc:
                raise ConfigError(f"{name}_file: cannot read {path!r} ({exc.strerror}); set {env_name(name + '_file')} "
                                  "to a readable file") from None
            if not secret:
                raise ConfigError(f"{name}_file {path!r} is empty")
            if getattr(self, name) and getattr(self, name) != secret:
                raise ConfigError(f"{env_name(name)} and {env_name(name + '_file')} are both set and differ: keep one")
            setattr(self, name, secret)


def own_address() -> str:
    """This host's address as its own name resolves (in a container: its address on the compose network)."""
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def load_config(cls: type[C], argv: list[str] | None = None, env: typing.Mapping[str, str] | None = None,
                role: str | None = None) -> C:
    """Build `cls` from argv (highest precedence), then env, then the settings file (--config or SMARTGEN_CONFIG,
    shared/runtime/settings_file.py), then the dataclass defaults. `role`: whose table of the file applies
    (default: from the class's module, services.<role>.config)."""
    return resolve_config(cls, argv, env, role)[0]


def resolve_config(cls: type[C], argv: list[str] | None = None, env: typing.Mapping[str, str] | None = None,
                   role: str | None = None) -> tuple[C, dict[str, str]]:
    """(config, {field: where its value came from}): "flag --x", "env SMARTGEN_X", "<file>", "<file> [role]" or
    "default"."""
    env = os.environ if env is None else env
    role = _role_of(cls) if role is None else role
    hints = typing.get_type_hints(cls)
    args = vars(build_parser(cls).parse_args(argv))
    args.pop("show_config")
    config_path = args.pop("config") or env.get(CONFIG_ENV, "")
    try:
        from_file = file_values(cls, role, read_settings_file(config_path), config_path) if config_path else {}
    except SettingsFileError as exc:
        raise ConfigError(str(exc)) from None
    values, sources = {}, {}
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if args[f.name] is not None:
            raw, sources[f.name] = args[f.name], f"flag {flag}"
        elif env_name(f.name) in env:
            raw, sources[f.name] = env[env_name(f.name)], f"env {env_name(f.name)}"
        elif f.name in from_file:
            raw, sources[f.name] = from_file[f.name]
        else:
            sources[f.name] = "default"
            continue
        values[f.name] = _parse(hints[f.name], raw, f.name) if isinstance(raw, str) else raw
    config = cls(**values)
    config.validate()
    return config, sources


def build_parser(cls: type) -> argparse.ArgumentParser:
    """The flags of `cls`: `--config` and one per field, each with its help (the field's comment), its env name and
    its default."""
    helps = field_help(cls)
    parser = argparse.ArgumentParser(prog=f"python -m {cls.__module__.rsplit('.', 1)[0]}",
                                     description="Each setting: --flag, else SMARTGEN_<NAME>, else the settings file, "
                                                 "else its default.")
    parser.add_argument("--config", metavar="PATH", default=None,
                        help=f"a TOML settings file (also {CONFIG_ENV}); flags and env win over it")
    parser.add_argument(SHOW_CONFIG_FLAG, action="store_true",
                        help="print the effective settings as JSON, with where each came from, and exit")
    for f in dataclasses.fields(cls):
        default = "" if f.name in SECRET_FIELDS else f" (default {f.default!r})"
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            help=f"{helps.get(f.name, '')} [{env_name(f.name)}]{default}".replace("%", "%%"))
    return parser


def describe_config(config: ServiceConfig, sources: dict[str, str]) -> dict[str, dict[str, typing.Any]]:
    """{setting: {"value", "source", "help"}} for `smartgen config show`: secrets as "***", NATS URLs without
    credentials."""
    from shared.runtime.natsconn import redacted_url

    helps = field_help(type(config))
    shown = {}
    for name, source in sources.items():
        value = getattr(config, name)
        if name in SECRET_FIELDS and value:
            value = "***"
        elif name == "nats_url":
            value = ",".join(redacted_url(url) for url in config.nats_urls)
        shown[name] = {"value": value, "source": source, "help": helps.get(name, "")}
    return shown


def _role_of(cls: type) -> str:
    """"decode" for services.decode.config.DecodeConfig; "" for a class outside services/."""
    parts = cls.__module__.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "services" and parts[1] in ROLES else ""


def _parse(tp: typing.Any, raw: str, name: str) -> typing.Any:
    try:
        if tp is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return tp(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {tp.__name__} (set {env_name(name)} or --{name.replace('_', '-')})") from None


@dataclass(slots=True)
class ModelWorkerConfig(ServiceConfig):
    """Settings shared by the two services that hold the model and a KV store (prefill, decode)."""

    model: str = ""  # a transformers model folder; "" = the cached default SmolLM2
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", …
    dtype: str = "auto"  # compute: "auto" = float32 on CPU, bfloat16 on CUDA
    # how KV is stored and moved, in every mode (colocated too, so tokens agree across modes): 16 bits as a
    # deployment keeps a bf16 model's KV; "" = the compute dtype
    kv_dtype: str = "bfloat16"
    torch_threads: int = 0  # 0 = torch's default; `smartgen up` gives each model process its share of the cores
    kv_cache_mb: int = 512  # size of the preallocated page store
    page_tokens: int = 16  # tokens per KV page
    transport: str = "auto"  # data plane: "auto" (RDMA if a device exists, else TCP), "tcp", "rdma"
    rdma_device: str = ""  # "" = the first RDMA device
    dataplane_port: int = 0  # 0 = a free port, advertised in heartbeats
    link_gbps: float = 0.0  # pace every data-plane link to this rate (10⁹ bit/s) to emulate a slow NIC; 0 = unpaced
    dataplane_checksums: bool = True  # crc32c per chunk; a mismatch fails the transfer
    # TCP: run the data plane in a transfer agent, a process of its own over the KV arena in shared memory
    # (shared/dataplane/agent.py), so no chunk's Python work waits for, or holds up, the model's GIL
    dataplane_agent: bool = False
    # every data-plane link starts with a challenge–response keyed by this (shared/dataplane/handshake.py):
    # the same in every prefill and decode of a cluster; "" = a data plane any process that reaches it may use
    cluster_secret: str = field(default="", repr=False)
    cluster_secret_file: str = ""
    # mutual TLS on every TCP data-plane link (shared/dataplane/channel.py): this worker's certificate and key, and
    # the CA whose signature a peer's certificate must carry; all three or none ("" = plain TCP)
    dataplane_tls_ca: str = ""
    dataplane_tls_cert: str = ""
    dataplane_tls_key: str = ""
    max_active_requests: int = 8  # requests this worker holds at once (the gateway admits no more than all take)

    def validate(self) -> None:
        ServiceConfig.validate(self)
        if self.kv_cache_mb <= 0 or self.page_tokens <= 0:
            raise ConfigError("kv_cache_mb and page_tokens must be positive")
        if self.transport not in ("auto", "tcp", "rdma"):
            raise ConfigError(f"transport {self.transport!r}: use auto, tcp or rdma")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype {self.dtype!r}: use auto, float32, bfloat16 or float16")
        if self.kv_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ConfigError(f"kv_dtype {self.kv_dtype!r}: use float32, bfloat16, float16, or '' for the compute dtype")
        if self.link_gbps < 0:
            raise ConfigError("link_gbps must be ≥ 0 (0 = unpaced)")
        if self.max_active_requests <= 0:
            raise ConfigError("max_active_requests must be positive")
        tls = ("dataplane_tls_ca", "dataplane_tls_cert", "dataplane_tls_key")
        if any(getattr(self, name) for name in tls) and not all(getattr(self, name) for name in tls):
            raise ConfigError("data-plane TLS needs all three of " + ", ".join(env_name(name) for name in tls))
        for name in tls:
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name} {path!r} is not a file (set {env_name(name)} to a PEM file)")


def write_secret_file(path: Path, secret: str) -> Path:
    """Write `secret` to `path` readable by this user only (mode 0600, set before any byte is written)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return path
