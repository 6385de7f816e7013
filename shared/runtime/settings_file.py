"""The settings file (`--config stack.toml` or SMARTGEN_CONFIG): the same settings as the flags and SMARTGEN_* env,
in TOML, for the whole stack; and each setting's help text, read from its field's comment in the config class.

    log_level = "info"           # a top-level key applies to every service that has the setting (as env does)
    kv_cache_mb = 256
    [gateway]                    # a table applies to that role only, and wins over a top-level key
    max_waiting = 128
    [decode]
    max_batch = 16

A key inside a role's table that the role does not have is an error naming the file and the closest setting. A
top-level key no service has is caught where every role is known (`smartgen up`, `smartgen config show`,
tools/settings.py); a service started alone applies the top-level keys it has and leaves the rest to the others.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

ROLES = ("gateway", "broker", "kvprofile", "prefill", "decode")
_FIELD_LINE = re.compile(r"^    (\w+): [^=]+=.*?(?:#\s*(.*))?$")


class SettingsFileError(ValueError):
    """A settings file that cannot be used, with a message that says where and how to fix it (a ConfigError)."""


def read_settings_file(path: str | Path) -> dict[str, Any]:
    """The file's TOML as a dict; its role tables must name a role."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise SettingsFileError(f"settings file {str(path)!r}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsFileError(f"settings file {str(path)!r} is not valid TOML: {exc}") from None
    for key, value in data.items():
        if isinstance(value, dict) and key not in ROLES:
            raise SettingsFileError(f"settings file {str(path)!r}: [{key}] is not a role; tables are "
                                    + ", ".join(f"[{r}]" for r in ROLES))
    return data


def file_values(cls: type, role: str, data: dict[str, Any], path: str | Path) -> dict[str, tuple[Any, str]]:
    """{field: (value, where)} of `cls` from the file's top level, then its `[role]` table (which wins). A key of the
    role's table that `cls` lacks is an error; top-level keys `cls` lacks belong to other roles."""
    names = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values = {key: (value, str(path)) for key, value in data.items() if key in names and not isinstance(value, dict)}
    table = data.get(role, {}) if role else {}
    for key, value in table.items():
        if key not in names:
            raise SettingsFileError(unknown_key_message(key, f"[{role}] of {str(path)!r}", names))
        values[key] = (value, f"{path} [{role}]")
    return {key: (_typed(hints[key], value, key, where), where) for key, (value, where) in values.items()}


def unknown_key_message(key: str, where: str, names: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(names), n=1)
    return f"unknown setting {key!r} in {where}" + (f"; did you mean {close[0]!r}?" if close else
                                                     "; `smartgen config show` lists every setting")


def _typed(tp: Any, value: Any, key: str, where: str) -> Any:
    """A TOML value as the field's type: ints for floats, and any string parsed as the env's would be (by the
    caller: a str comes back as is, marked by type)."""
    if isinstance(value, str) or (tp is float and isinstance(value, int) and not isinstance(value, bool)):
        return value if isinstance(value, str) else float(value)
    if type(value) is not tp:
        raise SettingsFileError(f"setting {key!r} in {where} is {value!r}: it takes a {tp.__name__}")
    return value


def field_help(cls: type) -> dict[str, str]:
    """{field: its help}: the comment on the field's line in its config class, after the comment block above it; a
    block also describes the fields below it that have no comment of their own (up to a blank line)."""
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        block: list[str] = []
        after_field = False
        for line in inspect.getsource(klass).splitlines():
            stripped = line.strip()
            if stripped.startswith("#"):
                block = [] if after_field else block
                block.append(stripped.lstrip("#").strip())
                after_field = False
            elif match := _FIELD_LINE.match(line):
                own = match.group(2) or ""
                if match.group(1) in {f.name for f in dataclasses.fields(klass)}:
                    # NOTE: a later field of the block with a comment of its own is described by that alone
                    helps[match.group(1)] = own if own and after_field else " ".join(filter(None, [*block, own]))
                after_field = True
            else:
                block, after_field = [], False
    return helps
