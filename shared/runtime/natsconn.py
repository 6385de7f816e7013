"""How every SmartGen process reaches NATS: the server's URL plus, when configured, credentials and TLS.

`connect_options(config)` turns a ServiceConfig into `nats.connect` keyword arguments; the services
(shared/runtime/service.py), the CLIs (natsctl, `smartgen profile`) and the tests all go through it, so a setting
that works for one works for all. Tools without a config of their own use `client_options()`, which reads
the same SMARTGEN_* variables the services read.

    await nats.connect(**client_options(), name="my-tool")

NOTE: the returned dict holds secrets: pass it to nats.connect, never log it.
"""
from __future__ import annotations

import os
import ssl
import typing
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from schemas import subjects
from shared.runtime.config import ServiceConfig, load_config


def connect_options(config: ServiceConfig) -> dict[str, Any]:
    """`servers` (a cluster's several) and, where set, `token`, `user`/`password` or `user_credentials` (a .creds
    file), and `tls` (an SSLContext). Also puts this process's subjects under the config's namespace (every
    process reaches NATS through here, so they all agree)."""
    subjects.use_namespace(config.namespace)
    options: dict[str, Any] = {"servers": config.nats_urls}
    if config.nats_token:
        options["token"] = config.nats_token
    if config.nats_user:
        options["user"], options["password"] = config.nats_user, config.nats_password
    if config.nats_creds:
        options["user_credentials"] = config.nats_creds
    if config.nats_tls_ca or config.nats_tls_cert or any(url.startswith("tls://") for url in config.nats_urls):
        options["tls"] = tls_context(config)
    return options


def tls_context(config: ServiceConfig) -> ssl.SSLContext:
    """Verifies the server against nats_tls_ca (else the system's CAs); presents the client pair if set."""
    context = ssl.create_default_context(cafile=config.nats_tls_ca or None)
    if config.nats_tls_cert:
        context.load_cert_chain(config.nats_tls_cert, config.nats_tls_key)
    return context


def client_options(env: typing.Mapping[str, str] | None = None, server: str = "") -> dict[str, Any]:
    """connect_options from SMARTGEN_* variables (default os.environ); `server` overrides SMARTGEN_NATS_URL."""
    config = load_config(ServiceConfig, [], os.environ if env is None else env)
    if server:
        config.nats_url = server
        config.validate()
    return connect_options(config)


def redacted_url(url: str) -> str:
    """The URL (or comma-separated URLs) as it may be logged: credentials written into one
    (nats://user:pass@host) become ***."""
    if "," in url:
        return ",".join(redacted_url(one.strip()) for one in url.split(","))
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))
