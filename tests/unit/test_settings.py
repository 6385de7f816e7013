"""The settings file beside flags and env (flag > env > file > default), its errors, help for every flag, and
`smartgen config show` naming where each value came from."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from services.decode.config import DecodeConfig
from services.gateway.config import GatewayConfig
from shared.runtime.config import ConfigError, build_parser, load_config, resolve_config
from shared.runtime.settings_file import field_help
from tests.contract.service_configs import CONFIG_CLASSES, config_class
from tools.settings import check_top_level_keys
from tools.stack import REPO_ROOT

SETTINGS = """
kv_cache_mb = 64          # every role that has it
max_batch = 3             # decode's, at the top level
[decode]
max_batch = 5             # the role's table wins over the top level
heartbeat_s = 0.5
[gateway]
max_waiting = 7
"""


@pytest.fixture
def settings_file(tmp_path):
    path = tmp_path / "stack.toml"
    path.write_text(SETTINGS)
    return path


def test_a_file_value_applies(settings_file):
    """Top-level keys reach every role that has them, a role's table only that role and over the top level."""
    decode = load_config(DecodeConfig, ["--config", str(settings_file)], {})
    assert (decode.kv_cache_mb, decode.max_batch, decode.heartbeat_s) == (64, 5, 0.5)
    gateway = load_config(GatewayConfig, [], {"SMARTGEN_CONFIG": str(settings_file)})
    assert gateway.max_waiting == 7 and gateway.heartbeat_s == GatewayConfig().heartbeat_s


def test_env_beats_file_and_flag_beats_env(settings_file):
    """SMARTGEN_MAX_BATCH wins over the file; --max-batch wins over both; each source is reported."""
    env = {"SMARTGEN_CONFIG": str(settings_file), "SMARTGEN_MAX_BATCH": "9"}
    config, sources = resolve_config(DecodeConfig, [], env)
    assert config.max_batch == 9 and sources["max_batch"] == "env SMARTGEN_MAX_BATCH"
    assert sources["kv_cache_mb"] == str(settings_file) and sources["heartbeat_s"] == f"{settings_file} [decode]"
    assert sources["page_tokens"] == "default"
    config, sources = resolve_config(DecodeConfig, ["--max-batch", "11"], env)
    assert config.max_batch == 11 and sources["max_batch"] == "flag --max-batch"


@pytest.mark.parametrize("text, message", [
    ("[decode]\nmax_bach = 4\n", "unknown setting 'max_bach' in [decode]"),
    ("[decoder]\nmax_batch = 4\n", "[decoder] is not a role"),
    ("[decode]\nmax_batch = 'many'\n", "max_batch='many' is not a valid int"),
    ("[decode]\nmax_batch = 2.5\n", "it takes a int"),
    ("max_batch = [\n", "is not valid TOML"),
])
def test_a_bad_file_is_refused_with_the_reason(tmp_path, text, message):
    """A typo in a role's table, a table that is not a role, a value of the wrong type, broken TOML: ConfigError
    with the reason (and the closest setting for a typo)."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as exc:
        load_config(DecodeConfig, ["--config", str(path)], {})
    if "max_bach" in text:
        assert "did you mean 'max_batch'" in str(exc.value)


def test_an_unknown_top_level_key_is_refused_where_every_role_is_known(tmp_path):
    """A top-level key no role has: a service alone leaves it to the others, the stack-wide check refuses it."""
    path = tmp_path / "typo.toml"
    path.write_text("max_runing = 4\n")
    load_config(GatewayConfig, ["--config", str(path)], {})
    names = {f.name for role in CONFIG_CLASSES for f in dataclasses.fields(config_class(role))}
    with pytest.raises(ConfigError, match="unknown setting 'max_runing'.*did you mean 'max_running'"):
        check_top_level_keys(path, names)
    result = subprocess.run([sys.executable, "-m", "tools.cli", "config", "show", "--config", str(path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "unknown setting 'max_runing'" in result.stderr


def test_every_flag_has_help():
    """Every setting of every role has help text (its field's comment), and its flag's help names its env."""
    for role in CONFIG_CLASSES:
        cls = config_class(role)
        helps = field_help(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not helps.get(f.name)]
        assert not missing, f"{role}: settings without a comment to serve as help: {missing}"
        text = build_parser(cls).format_help()
        for f in dataclasses.fields(cls):
            assert f"SMARTGEN_{f.name.upper()}" in text, (role, f.name)


def test_config_show_names_each_source(settings_file):
    """`smartgen config show` prints every role's settings with their sources, secrets masked."""
    env = {"PATH": "/usr/bin:/bin", "SMARTGEN_MAX_WAITING": "12", "SMARTGEN_ADMIN_TOKEN": "do-not-print"}
    run = lambda *args: subprocess.run([sys.executable, "-m", "tools.cli", "config", "show", "--config",
                                        str(settings_file), *args], cwd=REPO_ROOT, env=env, capture_output=True,
                                       text=True, timeout=60)
    text = run().stdout
    assert "do-not-print" not in text and '"***"' in text
    assert "[decode]" in text and "[gateway]" in text and "[broker]" in text
    waiting = next(line for line in text.splitlines() if line.startswith("max_waiting "))
    assert waiting.split("=", 1)[1].split() == ["12", "#", "env", "SMARTGEN_MAX_WAITING"], waiting
    shown = json.loads(run("--json").stdout)
    assert shown["decode"]["max_batch"] | {"help": ""} == {"value": 5, "source": f"{settings_file} [decode]", "help": ""}
    assert (shown["gateway"]["max_waiting"]["value"], shown["gateway"]["max_waiting"]["source"]) == \
        (12, "env SMARTGEN_MAX_WAITING")
    assert "continuous batching" in shown["decode"]["max_batch"]["help"]
    assert shown["broker"]["drain_s"]["source"] == "default"
    assert shown["gateway"]["admin_token"]["value"] == "***"


def test_every_smartgen_option_has_help():
    """Every argument of every `smartgen` sub-command says what it is in --help."""
    import argparse

    from tools.cli import build_parser

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "smartgen")
    assert not missing, f"arguments without help: {missing}"
