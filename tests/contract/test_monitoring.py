"""The monitoring files agree with the code: the dashboard reads only metrics the services define, Prometheus
scrapes every role at the port its compose service serves /metrics on, Grafana's data source is the one the
panels name, and the compose `monitoring` profile runs both."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from shared.runtime.config import load_config
from tests.contract.service_configs import CONFIG_CLASSES, config_class
from tests.contract.test_compose import ROOT, required_env, run_compose
from tools.dashboard import DASHBOARD, family_name, metric_names, queries

PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"


def defined_in_code() -> set[str]:
    """The family names of every string literal that names a metric in services/ and shared/ (smartgen_* and
    vllm:*; a counter may be defined with or without its _total)."""
    names = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "shared").rglob("*.py")]:
        names |= {family_name(n) for n in re.findall(r'"((?:smartgen_|vllm:)[a-z0-9_:]+)"', path.read_text())}
    return names


def test_every_dashboard_query_reads_metrics_defined_in_code():
    """Each panel query selects at least one metric, and each metric it selects is defined by a service."""
    defined = defined_in_code()
    assert len(queries()) >= 14
    for title, expr in queries():
        names = metric_names(expr)
        assert names, f"{title}: no metric selector found in {expr}"
        unknown = {n for n in names if family_name(n) not in defined}
        assert not unknown, f"{title}: {unknown} is defined nowhere in services/ or shared/"


def test_the_name_check_can_fail():
    """A misspelt metric is caught: its family is not among the code's names."""
    assert family_name("smartgen_time_to_frist_token_seconds_bucket") not in defined_in_code()
    assert metric_names('sum(rate(foo_total{job="x"}[5m])) / bar[1m]') == {"foo_total", "bar"}


def test_prometheus_scrapes_every_role_where_it_serves_metrics():
    """One job per role, its target at the port the compose service's config serves /metrics on (the gateway's
    API port; the admin port elsewhere); scaled workers found by DNS."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(CONFIG_CLASSES)
    for role, job in jobs.items():
        env = {k: str(v) for k, v in services[role]["environment"].items()
               if k.startswith("SMARTGEN_") and "${" not in str(v) and not k.endswith("_FILE")}
        settings = load_config(config_class(role), [], env)
        port = settings.gateway_port if role == "gateway" else settings.admin_port
        targets = [t for c in job.get("static_configs", []) for t in c["targets"]]
        dns = job.get("dns_sd_configs", [])
        assert targets == [f"{role}:{port}"] or (dns and dns[0]["names"] == [role] and dns[0]["port"] == port), job


def test_promtool_accepts_the_prometheus_config():
    """The real promtool (Debian's prometheus package, where installed) checks the file."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; tools/check_prometheus.sh runs it)")
    result = subprocess.run([promtool, "check", "config", "--syntax-only", str(PROMETHEUS)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisions_the_dashboard_on_the_data_source_its_panels_name():
    """The data source's uid is every panel's; the provider's path is where compose mounts the dashboards."""
    source = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    dashboard = json.loads(DASHBOARD.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in [p, *p["targets"]]}
    assert uids == {source["uid"]} and source["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "smartgen.yml").read_text())["providers"][0]
    grafana = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]


def test_the_monitoring_profile_adds_prometheus_and_grafana(tmp_path):
    """Compose (the real binary) runs Prometheus and Grafana only with --profile monitoring, both on loopback."""
    plain = json.loads(run_compose(tmp_path, "config", "--format", "json", **required_env(tmp_path)).stdout)
    assert not {"prometheus", "grafana"} & set(plain["services"])
    result = run_compose(tmp_path, "--profile", "monitoring", "config", "--format", "json", **required_env(tmp_path))
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert {"prometheus", "grafana"} <= set(services)
    for name in ("prometheus", "grafana"):
        assert all(p["host_ip"] == "127.0.0.1" for p in services[name]["ports"]), services[name]["ports"]
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
