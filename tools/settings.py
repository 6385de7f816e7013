"""`smartgen config show [--config PATH] [--role ROLE] [--json]`: every service's effective settings and where each
came from (flag, env, the settings file, or the default), having checked the settings file for every role.

The settings file and the precedence (flag > env > file > default) are in shared/runtime/settings_file.py and
shared/runtime/config.py. This is the one place that knows every role's settings, so it checks what a single
service cannot: that each top-level key of the file is a setting of some role.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

# NOTE: the services' config classes are data-only dataclasses: the settings surface, not a service's internals
CONFIG_CLASSES = {"gateway": "services.gateway.config:GatewayConfig", "broker": "services.broker.config:BrokerConfig",
                  "kvprofile": "services.kvprofile.config:KvProfileConfig",
                  "prefill": "services.prefill.config:PrefillConfig", "decode": "services.decode.config:DecodeConfig"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `config` to the `smartgen` sub-commands."""
    config = subparsers.add_parser("config", help="the services' effective settings (flags, env, settings file)")
    what = config.add_subparsers(dest="what", required=True)
    show = what.add_parser("show", help="print each setting's effective value and where it came from")
    show.add_argument("--config", metavar="PATH", default=None,
                      help="a TOML settings file (default: $SMARTGEN_CONFIG, else none)")
    show.add_argument("--role", choices=sorted(CONFIG_CLASSES), action="append",
                      help="only this role (repeatable; default: every role)")
    show.add_argument("--json", action="store_true", help="one JSON object: {role: {setting: {value, source}}}")
    show.set_defaults(run=show_command)


def config_class(role: str) -> type:
    module, name = CONFIG_CLASSES[role].split(":")
    return getattr(importlib.import_module(module), name)


def check_settings_file(path: str | Path) -> None:
    """Raise ConfigError if the file cannot configure the stack: not TOML, a table that is not a role, a key that
    no role has at the top level or that its table's role lacks."""
    from shared.runtime.config import ConfigError
    from shared.runtime.settings_file import SettingsFileError, file_values, read_settings_file, unknown_key_message

    try:
        data = read_settings_file(path)
        names = {f.name for role in CONFIG_CLASSES for f in dataclasses.fields(config_class(role))}
        for key, value in data.items():
            if not isinstance(value, dict) and key not in names:
                raise SettingsFileError(unknown_key_message(key, f"{str(path)!r}", names))
        for role in CONFIG_CLASSES:
            file_values(config_class(role), role, data, path)
    except SettingsFileError as exc:
        raise ConfigError(str(exc)) from None


def effective_settings(role: str, env: dict[str, str]) -> dict[str, dict[str, object]]:
    """{setting: {"value", "source"}} of `role` as it would start with `env` (secrets shown as "***")."""
    from shared.runtime.config import SECRET_FIELDS, resolve_config
    from shared.runtime.natsconn import redacted_url

    config, sources = resolve_config(config_class(role), [], env, role)
    shown = {}
    for name, source in sources.items():
        value = getattr(config, name)
        if name in SECRET_FIELDS and value:
            value = "***"
        elif name == "nats_url":
            value = ",".join(redacted_url(url) for url in config.nats_urls)
        shown[name] = {"value": value, "source": source}
    return shown


def show_command(args: argparse.Namespace) -> int:
    from shared.runtime.config import CONFIG_ENV, ConfigError

    env = dict(os.environ)
    if args.config:
        env[CONFIG_ENV] = args.config
    try:
        if env.get(CONFIG_ENV):
            check_settings_file(env[CONFIG_ENV])
        settings = {role: effective_settings(role, env) for role in args.role or CONFIG_CLASSES}
    except ConfigError as exc:
        print(f"smartgen config: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(settings, indent=1))
        return 0
    print(f"# settings file: {env.get(CONFIG_ENV) or 'none'}; precedence: flag > env > file > default")
    for role, values in settings.items():
        print(f"\n[{role}]")
        width = max(map(len, values))
        for name, item in values.items():
            print(f"{name:<{width}} = {json.dumps(item['value']):<34} # {item['source']}")
    return 0
