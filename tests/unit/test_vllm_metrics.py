"""vLLM's metric names carry what the gateway measured, with vLLM's types and labels (shared/runtime/vllm_metrics.py)."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.runtime.metrics import Registry
from shared.runtime.vllm_metrics import VllmMetrics


def samples(registry: Registry) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(registry.render()) for s in family.samples}


def test_a_request_shows_under_vllms_names():
    """Two requests (one cut by max_tokens, one whose client left): counts, sums and gauges under vllm:* names."""
    registry = Registry()
    vllm = VllmMetrics(registry, "tiny", running=lambda: 3.0, waiting=lambda: 2.0, kv_usage=lambda: 0.25)
    vllm.observe([0.5, 0.7, 0.8, 1.0], num_prompt_tokens=12, finish_reason="length", queue_s=0.1)
    vllm.observe([0.4], num_prompt_tokens=5, finish_reason="client_gone", queue_s=0.0)
    vllm.observe([], num_prompt_tokens=5, finish_reason="error", queue_s=0.0)
    got = samples(registry)
    m = (("model_name", "tiny"),)
    assert got[("vllm:time_to_first_token_seconds_count", m)] == 2
    assert got[("vllm:time_to_first_token_seconds_sum", m)] == pytest.approx(0.9)
    assert got[("vllm:inter_token_latency_seconds_count", m)] == 3  # every gap, the first one included
    assert got[("vllm:time_per_output_token_seconds_sum", m)] == pytest.approx(0.5)
    assert got[("vllm:e2e_request_latency_seconds_sum", m)] == pytest.approx(1.4)
    assert got[("vllm:prompt_tokens_total", m)] == 22 and got[("vllm:generation_tokens_total", m)] == 5
    assert got[("vllm:request_success_total", (("finished_reason", "length"), *m))] == 1
    assert got[("vllm:request_success_total", (("finished_reason", "abort"), *m))] == 1
    assert not any(name == "vllm:request_success_total" and ("finished_reason", "stop") in labels for name, labels in got)
    assert got[("vllm:num_requests_running", m)] == 3 and got[("vllm:num_requests_waiting", m)] == 2
    assert got[("vllm:kv_cache_usage_perc", m)] == 0.25 == got[("vllm:gpu_cache_usage_perc", m)]
