"""`smartgen config show [--config PATH] [--role ROLE] [--json]`: every service's effective settings and where each
came from (flag, env, the settings file, or the default), having checked the settings file for every role.

Each service says it itself (`python -m services.<role> --show-config`, run here as a process, as the stack runs
them), so the precedence (flag > env > file > default, shared/runtime/config.py) has one implementation. Knowing
every role's settings, this also checks what a single service cannot: that each top-level key of the file is a
setting of some role (shared/runtime/settings_file.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from shared.runtime.config import CONFIG_ENV, SHOW_CONFIG_FLAG, ConfigError
from shared.runtime.settings_file import ROLES, SettingsFileError, read_settings_file, unknown_key_message

REPO_ROOT = Path(__file__).resolve().parent.parent


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `config` to the `smartgen` sub-commands."""
    config = subparsers.add_parser("config", help="the services' effective settings (flags, env, settings file)")
    what = config.add_subparsers(dest="what", required=True)
    show = what.add_parser("show", help="print each setting's effective value and where it came from")
    show.add_argument("--config", metavar="PATH", default=None,
                      help=f"a TOML settings file (default: ${CONFIG_ENV}, else none)")
    show.add_argument("--role", choices=ROLES, action="append", help="only this role (repeatable; default: every role)")
    show.add_argument("--json", action="store_true", help="one JSON object: {role: {setting: {value, source, help}}}")
    show.set_defaults(run=show_command)


def effective_settings(roles: tuple[str, ...] | list[str], env: dict[str, str]) -> dict[str, dict[str, dict]]:
    """{role: {setting: {"value", "source", "help"}}} as each service would start with `env` (all at once).
    Raises ConfigError with the first service's complaint."""
    runs = {role: subprocess.Popen([sys.executable, "-m", f"services.{role}", SHOW_CONFIG_FLAG], cwd=REPO_ROOT,
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for role in roles}
    settings = {}
    for role, run in runs.items():
        out, err = run.communicate(timeout=120)
        if run.returncode != 0:
            raise ConfigError(f"{role}: {_complaint(err)}")
        settings[role] = json.loads(out)["settings"]
    return settings


def _complaint(stderr: str) -> str:
    """The `error` of a service's config_error line, else its last line of output."""
    for line in reversed(stderr.splitlines()):
        try:
            return json.loads(line)["error"]
        except (ValueError, KeyError, TypeError):
            continue
    return (stderr.strip().splitlines() or ["exited without a word"])[-1]


def check_top_level_keys(path: str | Path, names: set[str]) -> None:
    """Raise ConfigError for a top-level key of the file that is none of `names` (every role's settings)."""
    try:
        for key, value in read_settings_file(path).items():
            if not isinstance(value, dict) and key not in names:
                raise SettingsFileError(unknown_key_message(key, repr(str(path)), names))
    except SettingsFileError as exc:
        raise ConfigError(str(exc)) from None


def checked_settings(env: dict[str, str], roles: tuple[str, ...] | list[str] = ROLES) -> dict[str, dict[str, dict]]:
    """effective_settings of every role, and the settings file (if env names one) checked against all of them."""
    settings = effective_settings(ROLES, env)
    if env.get(CONFIG_ENV):
        check_top_level_keys(env[CONFIG_ENV], {name for values in settings.values() for name in values})
    return {role: settings[role] for role in roles}


def show_command(args: argparse.Namespace) -> int:
    env = dict(os.environ)
    if args.config:
        env[CONFIG_ENV] = str(Path(args.config).resolve())
    try:
        settings = checked_settings(env, args.role or ROLES)
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
