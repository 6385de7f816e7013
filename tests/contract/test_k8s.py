"""deploy/k8s is valid Kubernetes (every object against the API schemas of kubernetes-validate, offline), every
SmartGen Deployment's command, environment, ports and probes match what the code's config accepts, secrets are
mounted files, the NATS config passes the real nats-server's check, and the kustomizations name what exists."""
from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from shared.runtime.config import env_name, load_config
from tests.contract.service_configs import CONFIG_CLASSES, config_class

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "k8s" / "base"
OVERLAYS = ROOT / "deploy" / "k8s" / "overlays"
K8S_VERSION = "1.30.0"
SECRET_MOUNT = "/run/secrets/smartgen"


def documents() -> list[dict]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in yaml.safe_load_all((BASE / name).read_text()) if doc]


def deployment(role: str) -> dict:
    return next(d for d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == role)


def test_every_object_is_valid_kubernetes():
    """Each object validates strictly (unknown fields are errors) against the Kubernetes API schemas."""
    import kubernetes_validate

    docs = documents()
    assert {d["kind"] for d in docs} >= {"StatefulSet", "Deployment", "Service", "ConfigMap"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_can_fail():
    """A misspelt field is an error (so the test above means something)."""
    import kubernetes_validate

    bad = deployment("decode")
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.parametrize("role", sorted(CONFIG_CLASSES))
def test_deployment_matches_its_config(role, tmp_path):
    """The container runs the role's module; every SMARTGEN_* variable is a field of its config and the config
    builds from them (secret files stand in for the mounted Secret); the container port is the config's port and
    the probes use it: readiness on /ready, liveness on /live; it requests CPU and memory; every secret arrives as
    a file under the Secret's mount, none as a value."""
    cls = config_class(role)
    container = deployment(role)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", f"services.{role}"]
    env = {e["name"]: e["value"] for e in container["env"]}
    fields = {env_name(f.name) for f in dataclasses.fields(cls)}
    assert not [k for k in env if k not in fields], f"{role}: environment names no config field"
    assert not [k for k in env if any(s in k for s in ("TOKEN", "SECRET", "PASSWORD")) and not k.endswith("_FILE")]
    secret_files = {k: v for k, v in env.items() if k.endswith("_FILE")}
    assert secret_files and all(v.startswith(SECRET_MOUNT + "/") for v in secret_files.values())
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volume = next(v for v in deployment(role)["spec"]["template"]["spec"]["volumes"] if v["name"] == mounts[SECRET_MOUNT])
    assert {i["path"] for i in volume["secret"]["items"]} == {Path(v).name for v in secret_files.values()}
    for key, path in secret_files.items():
        stand_in = tmp_path / Path(path).name
        stand_in.write_text("k8s-test-secret")
        env[key] = str(stand_in)
    config = load_config(cls, [], env)
    port = config.gateway_port if role == "gateway" else config.admin_port
    assert port in {p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/live", "port": port}
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert config.nats_urls == [f"nats://nats-{i}.nats:4222" for i in range(3)], "all three NATS servers"
    assert config.advertise_host == "", "each pod advertises its own address"
    if role in ("prefill", "decode"):
        assert config.cluster_secret == "k8s-test-secret"
        assert config.dataplane_port in {p["containerPort"] for p in container["ports"]}
    if role == "kvprofile":
        assert config.bucket_replicas == 3


def test_nats_is_a_three_server_jetstream_cluster_that_wants_the_token(tmp_path):
    """The StatefulSet runs three servers; their config (from the ConfigMap) clusters them over routes that need
    the route password, with JetStream on. The token and the password are the Secret's files, mounted, and the
    container's command sets them (and each route URL, carrying the password) for the server process only: no env
    value holds them. That command, run here on such files, makes a config the real nats-server accepts; the
    config without the token or the route password is refused."""
    from tools.nats_server import nats_server_binary

    docs = documents()
    statefulset = next(d for d in docs if d["kind"] == "StatefulSet")
    assert statefulset["spec"]["replicas"] == 3 and statefulset["spec"]["serviceName"] == "nats"
    conf_text = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config")["data"]["nats.conf"]
    assert "jetstream" in conf_text and "password: $SMARTGEN_NATS_ROUTE_PASSWORD" in conf_text
    pod = statefulset["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert {e["name"] for e in container["env"]} == {"POD_NAME"}  # nothing secret in the pod's environment
    mount = next(m for m in container["volumeMounts"] if m["name"] == "secrets")
    volume = next(v for v in pod["volumes"] if v["name"] == "secrets")["secret"]
    assert mount["mountPath"] == "/run/secrets/nats" and mount["readOnly"]
    assert {i["key"] for i in volume["items"]} == {"nats-token", "nats-route-password"}
    conf = tmp_path / "nats.conf"
    conf.write_text(conf_text.replace("/data/jetstream", str(tmp_path / "js")))
    (tmp_path / "route-tls.conf").write_text(route_tls_conf(docs))  # NOTE: nats-server includes beside the config
    files = tmp_path / "secrets"
    files.mkdir()
    (files / "nats-token").write_text("k8s-test-token")
    (files / "nats-route-password").write_text("pw")
    script = container["command"][2].replace("/run/secrets/nats/", f"{files}/")
    clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("SMARTGEN_", "NATS_ROUTE"))}
    started = subprocess.run(["sh", "-c", script, "nats", "-c", str(conf), "-t"], capture_output=True, text=True,
                             timeout=30, env={**clean_env, "POD_NAME": "nats-0",
                                              "PATH": f"{Path(nats_server_binary()).parent}:{os.environ['PATH']}"})
    assert started.returncode == 0, started.stderr
    clean = {k: v for k, v in os.environ.items() if k not in ("SMARTGEN_NATS_TOKEN", "POD_NAME")}
    routes = {f"NATS_ROUTE_{i}": f"nats://route:pw@nats-{i}.nats:6222" for i in range(3)}
    full = {**clean, **routes, "SMARTGEN_NATS_TOKEN": "k8s-test-token", "SMARTGEN_NATS_ROUTE_PASSWORD": "pw",
            "POD_NAME": "nats-0"}

    def check(env: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run([nats_server_binary(), "-c", conf, "-t"], capture_output=True, text=True, timeout=30,
                              env=env)

    assert check(full).returncode == 0, check(full).stderr
    for missing in ("SMARTGEN_NATS_TOKEN", "SMARTGEN_NATS_ROUTE_PASSWORD"):
        refused = check({k: v for k, v in full.items() if k != missing})
        assert refused.returncode != 0 and missing in refused.stderr


def route_tls_conf(docs: list[dict]) -> str:
    """The nats-config ConfigMap's route-tls.conf, which its nats.conf includes inside the `cluster` block."""
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config")
    assert "include ./route-tls.conf" in config["data"]["nats.conf"]
    return config["data"]["route-tls.conf"]


def with_overlay(name: str) -> list[dict]:
    """The base's objects with an overlay's patches applied as kustomize's strategic merge does for these: a
    ConfigMap's data keys replaced, a StatefulSet's containers merged by name and their volume mounts and the pod's
    volumes appended (by name)."""
    docs = documents()
    overlay = OVERLAYS / name
    for entry in yaml.safe_load((overlay / "kustomization.yaml").read_text())["patches"]:
        patch = yaml.safe_load((overlay / entry["path"]).read_text())
        target = next(d for d in docs if d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"])
        if patch["kind"] == "ConfigMap":
            target["data"].update(patch["data"])
            continue
        pod, extra = target["spec"]["template"]["spec"], patch["spec"]["template"]["spec"]
        for container in extra.get("containers", []):
            into = next(c for c in pod["containers"] if c["name"] == container["name"])
            into["volumeMounts"] = into["volumeMounts"] + container.get("volumeMounts", [])
        pod["volumes"] = pod["volumes"] + extra.get("volumes", [])
    return docs


def test_the_route_tls_overlay_puts_the_routes_under_mutual_tls(tmp_path):
    """deploy/k8s/overlays/route-tls: every NATS server mounts the nats-route-tls Secret's CA, certificate and key
    as files, and the included route-tls.conf (empty in the base) turns on verified TLS with them; the patched
    objects are valid Kubernetes, and the real nats-server accepts the patched config with real certificates (and
    refuses it when the certificate's file is missing)."""
    import kubernetes_validate

    from tests.certificates import make_certificates
    from tools.nats_server import nats_server_binary

    assert "tls {" not in route_tls_conf(documents())  # the base: no TLS on the routes
    docs = with_overlay("route-tls")
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    statefulset = next(d for d in docs if d["kind"] == "StatefulSet")
    pod = statefulset["spec"]["template"]["spec"]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "route-tls")
    volume = next(v for v in pod["volumes"] if v["name"] == "route-tls")["secret"]
    assert mount == {"name": "route-tls", "mountPath": "/run/secrets/nats-route-tls", "readOnly": True}
    assert volume["secretName"] == "nats-route-tls" and volume["defaultMode"] == 0o440
    settings = route_tls_conf(docs)
    files = {i["path"] for i in volume["items"]}
    assert files == {"ca.pem", "cert.pem", "key.pem"} and "verify: true" in settings
    assert all(f"/run/secrets/nats-route-tls/{f}" in settings for f in files)
    pem = make_certificates(tmp_path)
    secrets = tmp_path / "route-tls"
    secrets.mkdir()
    for name, source in (("ca.pem", "ca.pem"), ("cert.pem", "peer.pem"), ("key.pem", "peer.key")):
        (secrets / name).write_bytes(pem[source].read_bytes())
    conf_text = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["nats.conf"]
    conf = tmp_path / "nats.conf"
    conf.write_text(conf_text.replace("/data/jetstream", str(tmp_path / "js")))
    (tmp_path / "route-tls.conf").write_text(settings.replace("/run/secrets/nats-route-tls", str(secrets)))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SMARTGEN_", "NATS_ROUTE"))},
           "SMARTGEN_NATS_TOKEN": "t", "SMARTGEN_NATS_ROUTE_PASSWORD": "pw", "POD_NAME": "nats-0",
           **{f"NATS_ROUTE_{i}": f"nats://route:pw@nats-{i}.nats:6222" for i in range(3)}}

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, text=True,
                              timeout=30, env=env)

    accepted = check()
    assert accepted.returncode == 0, accepted.stderr
    (secrets / "cert.pem").unlink()
    refused = check()
    assert refused.returncode != 0 and "cert.pem" in refused.stderr


def test_pods_run_as_non_root_behind_network_policies_and_disruption_budgets():
    """Every pod runs as a non-root user without privilege escalation or capabilities, and can read its secret
    files through its group; NetworkPolicies deny by default and open the API, NATS (routes to NATS servers
    only), the data plane between model workers, and admin ports within the stack; NATS, prefill and decode
    have PodDisruptionBudgets; SIGTERM's drain fits the grace period."""
    docs = documents()
    pods = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    assert len(pods) == 6
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        for container in pod["containers"]:
            assert container["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"]
    for d in docs:
        if d["kind"] == "Deployment":
            assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 30  # drain_s
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["smartgen-default-deny"]["policyTypes"] == ["Ingress"] and "ingress" not in policies["smartgen-default-deny"]
    nats_rules = policies["smartgen-nats"]["ingress"]
    route_rule = next(r for r in nats_rules if {p["port"] for p in r["ports"]} == {6222})
    assert route_rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "nats"}}}]
    budgets = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert budgets == {"nats", "prefill", "decode"}


def test_kustomizations_name_what_exists():
    """The base lists every manifest in its folder; each overlay builds on the base and scales only Deployments
    the base has."""
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    names = {d["metadata"]["name"] for d in documents() if d["kind"] == "Deployment"}
    overlays = list(OVERLAYS.glob("*/kustomization.yaml"))
    assert overlays
    for path in overlays:
        overlay = yaml.safe_load(path.read_text())
        assert "../../base" in overlay["resources"]
        assert {r["name"] for r in overlay.get("replicas", [])} <= names
        for entry in overlay.get("patches", []):  # each patch is a file beside it, naming an object of the base
            patch = yaml.safe_load((path.parent / entry["path"]).read_text())
            assert any(d["kind"] == patch["kind"] and d["metadata"]["name"] == patch["metadata"]["name"]
                       for d in documents()), entry["path"]
