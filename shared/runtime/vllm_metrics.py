"""vLLM's metric names beside SmartGen's, so dashboards and alerts built for vLLM read SmartGen (the gateway's
`vllm_metrics` setting, SMARTGEN_VLLM_METRICS or `smartgen up --vllm-metrics`).

Each is what the gateway measures for its own smartgen_* name (shared/runtime/metrics.py), under vLLM's name,
type and labels (`model_name`; `finished_reason` on vllm:request_success_total); vllm:prefix_cache_queries/hits count
the prompt tokens looked up in the prefill workers' prefix caches and those found (each request's
`cached_tokens`). Not exported: its engine internals (iteration tokens, preemptions, scheduler steps), and its
prefill/decode split per request.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from shared.runtime.metrics import LATENCY_BUCKETS, Registry

TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# SmartGen's finish reasons → vLLM's (stop, length, abort); a failed request is no success in vLLM either
FINISHED_REASONS = {"stop": "stop", "stop_string": "stop", "tool_calls": "stop", "length": "length",
                    "client_gone": "abort"}


class VllmMetrics:
    """The gateway's request figures under vLLM's names, each labelled with the served model's name."""

    def __init__(self, registry: Registry, model_name: str, running: Callable[[], float],
                 waiting: Callable[[], float], kv_usage: Callable[[], float]):
        self.model_name = model_name
        label = {"model_name": model_name}
        histogram = lambda name, text, buckets=LATENCY_BUCKETS: registry.histogram(name, text, ["model_name"], buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Gap between consecutive output tokens")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Gap between consecutive output tokens "
                              "(vLLM's older name of vllm:inter_token_latency_seconds)")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue = histogram("vllm:request_queue_time_seconds", "Time waiting in the gateway's admission queue")
        self.decode_time = histogram("vllm:request_decode_time_seconds", "Time from the first token to the last")
        self.prompt_lengths = histogram("vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS)
        self.output_lengths = histogram("vllm:request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS)
        self.prompt_tokens = registry.counter("vllm:prompt_tokens", "Prompt tokens of finished requests", ["model_name"])
        self.generation_tokens = registry.counter("vllm:generation_tokens", "Tokens generated", ["model_name"])
        self.prefix_queries = registry.counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                               ["model_name"])
        self.prefix_hits = registry.counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                            ["model_name"])
        self.successes = registry.counter("vllm:request_success", "Requests finished, by vLLM's finish reason",
                                          ["model_name", "finished_reason"])
        registry.gauge("vllm:num_requests_running", "Requests admitted and not finished", running, label)
        registry.gauge("vllm:num_requests_waiting", "Requests waiting in the admission queue", waiting, label)
        registry.gauge("vllm:kv_cache_usage_perc", "Share of the decode workers' KV pages in use (1 = full)",
                       kv_usage, label)
        registry.gauge("vllm:gpu_cache_usage_perc", "vLLM's older name of vllm:kv_cache_usage_perc", kv_usage, label)

    def observe(self, token_times_s: Sequence[float], num_prompt_tokens: int, finish_reason: str, queue_s: float,
                num_queried_tokens: int = 0, num_cached_tokens: int = 0) -> None:
        """One finished request: token_times_s[i] is token i's time since its arrival; `num_queried_tokens` of its
        prompt were looked up in a prefill worker's prefix cache (all of it where a prefill worker ran it, none in
        colocated mode) and `num_cached_tokens` found there."""
        label = {"model_name": self.model_name}
        self.prompt_tokens.inc(num_prompt_tokens, **label)
        self.prefix_queries.inc(num_queried_tokens, **label)
        self.prefix_hits.inc(num_cached_tokens, **label)
        self.generation_tokens.inc(len(token_times_s), **label)
        self.prompt_lengths.observe(num_prompt_tokens, **label)
        self.output_lengths.observe(len(token_times_s), **label)
        self.queue.observe(queue_s, **label)
        if token_times_s:
            self.ttft.observe(token_times_s[0], **label)
            self.e2e.observe(token_times_s[-1], **label)
            self.decode_time.observe(token_times_s[-1] - token_times_s[0], **label)
        for a, b in zip(token_times_s, token_times_s[1:]):
            self.itl.observe(b - a, **label)
            self.tpot.observe(b - a, **label)
        if finish_reason in FINISHED_REASONS:
            self.successes.inc(finished_reason=FINISHED_REASONS[finish_reason], **label)
