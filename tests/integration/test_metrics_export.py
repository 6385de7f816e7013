"""What the running services' /metrics export: every metric SmartGen's dashboard queries, with samples, and vLLM's
names beside SmartGen's when the option is on; started as an operator would, `smartgen up --config stack.toml`."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import list_workers, post_json
from tests.integration.test_cli_up import ADMIN_TOKEN, interrupt_and_check_clean_exit, start_up, wait_for_workers
from tools.dashboard import exposed_sample_names, metric_names, queries
from tools.nats_server import free_port

VLLM_NAMES = ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
              "vllm:time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
              "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:prompt_tokens_total",
              "vllm:generation_tokens_total", "vllm:request_success_total", "vllm:kv_cache_usage_perc")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def total(text: str, sample_name: str) -> float:
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == sample_name)


def test_the_dashboards_metrics_and_vllms_names_are_exported(tiny_model_path, tmp_path):
    """With a settings file turning vLLM's names on: after requests in three modes and a refused one, every
    metric the dashboard selects has samples in some service's /metrics, and vLLM's names count what SmartGen's
    count, labelled with the served model's name."""
    port = free_port()
    settings = tmp_path / "stack.toml"
    settings.write_text(f"kv_cache_mb = 32\n[gateway]\nvllm_metrics = true\ngateway_port = {port}\n"
                        'served_model_name = "tiny-test"\n')
    log = tmp_path / "up.log"
    proc = start_up(["--model", str(tiny_model_path), "--config", str(settings)], {"SMARTGEN_NATS_URL": ""}, log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_workers(url, {"prefill": 1, "decode": 1, "broker": 1, "kvprofile": 1}, proc, log)
        for mode in ("full", "smartgen", "colocated"):
            status, body = post_json(url + "/v1/completions", {"prompt": "The river city grew " * 8, "max_tokens": 4,
                                                               "temperature": 0, "transfer_mode": mode})
            assert status == 200, body
        status, _ = post_json(url + "/v1/completions", {"prompt": "Hi", "max_tokens": -1})
        assert status == 400
        scraped = {w["role"] + ":" + w["id"]: scrape(w["admin_url"]) for w in list_workers(url, ADMIN_TOKEN)}
        interrupt_and_check_clean_exit(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    exposed = set().union(*(exposed_sample_names(text) for text in scraped.values()))
    for title, expr in queries():
        missing = metric_names(expr) - exposed
        assert not missing, f"panel {title!r} reads {missing}, which no service exposes with samples"
    gateway = next(text for name, text in scraped.items() if name.startswith("gateway:"))
    assert all(name in exposed_sample_names(gateway) for name in VLLM_NAMES)
    assert 'model_name="tiny-test"' in gateway.split("vllm:time_to_first_token_seconds_count", 1)[1].splitlines()[0]
    assert total(gateway, "vllm:generation_tokens_total") == total(gateway, "smartgen_generation_tokens_total") == 12
    assert total(gateway, "vllm:time_to_first_token_seconds_count") == 3 \
        == total(gateway, "smartgen_time_to_first_token_seconds_count")
    assert total(gateway, "vllm:request_success_total") == 3
    # the same prompt three times: full computes it, smartgen finds its full pages in the prefill's prefix cache
    # (vLLM's names count what the prefill's own counters do), colocated asks no prefill worker
    prefill = next(text for name, text in scraped.items() if name.startswith("prefill:"))
    assert total(gateway, "vllm:prefix_cache_hits_total") == total(prefill, "smartgen_prefix_cache_hits_total") > 0
    assert total(gateway, "vllm:prefix_cache_queries_total") == total(prefill, "smartgen_prefix_cache_queries_total")
    assert not any(name.startswith("vllm:") for text in scraped.values() if text is not gateway
                   for name in exposed_sample_names(text))
