"""Every service's /metrics: prometheus_client metrics in a registry of the service's own (with the process
collector: CPU, memory, open files), behind a small API the services share.

Names shared by every service that records them (the contract with dashboards and tests):
    smartgen_time_to_first_token_seconds{transfer_mode,model_name}    histogram, t1 - t0
    smartgen_time_to_second_token_seconds{transfer_mode,model_name}   histogram, t2 - t1 (the stall SmartGen attacks)
    smartgen_inter_token_latency_seconds{transfer_mode,model_name}    histogram, gaps between tokens from the second on
    smartgen_e2e_request_latency_seconds{transfer_mode,model_name}    histogram, arrival to the last token
    smartgen_kv_transfer_bytes_total{path}                            counter
    smartgen_requests_total{status}                                   counter (gateway: stop, length, error,
                                                                      client_gone, …; workers: their finish reason)
The gateway adds its queue (smartgen_queue_seconds, smartgen_requests_running, smartgen_requests_waiting), token
counters (smartgen_prompt_tokens_total, smartgen_generation_tokens_total) and the decode workers' KV usage
(smartgen_kv_cache_usage_ratio), the names vLLM exports under its own prefix.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import prometheus_client as prom
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CONTENT_TYPE = prom.CONTENT_TYPE_LATEST


class Counter:
    def __init__(self, registry: CollectorRegistry, name: str, help_text: str, labels: Sequence[str] = ()):
        self.label_names = tuple(labels)
        self._metric = prom.Counter(name, help_text, self.label_names, registry=registry)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        (self._metric.labels(**{n: str(labels[n]) for n in self.label_names}) if self.label_names else self._metric).inc(amount)

    def _samples(self) -> dict[tuple[str, ...], float]:
        return {tuple(s.labels[n] for n in self.label_names): s.value
                for family in self._metric.collect() for s in family.samples if s.name.endswith("_total")}

    def by_first_label(self) -> dict[str, float]:
        """{first label value: count}, e.g. {"full": 1024.0} for kv_bytes by path (for /stats)."""
        return {key[0]: value for key, value in self._samples().items()}

    def value(self, **labels: str) -> float:
        return self._samples().get(tuple(str(labels[n]) for n in self.label_names), 0.0)


class Histogram:
    def __init__(self, registry: CollectorRegistry, name: str, help_text: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS):
        self.label_names = tuple(labels)
        self._metric = prom.Histogram(name, help_text, self.label_names, buckets=tuple(buckets), registry=registry)

    def observe(self, value: float, **labels: str) -> None:
        (self._metric.labels(**{n: str(labels[n]) for n in self.label_names}) if self.label_names else self._metric).observe(value)

    @property
    def count(self) -> int:
        """Observations so far, over every label set."""
        return int(sum(s.value for family in self._metric.collect() for s in family.samples if s.name.endswith("_count")))


class Registry:
    """One service's metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(self.registry, name, help_text, labels)

    def histogram(self, name: str, help_text: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(self.registry, name, help_text, labels, buckets)

    def gauge(self, name: str, help_text: str, read: Callable[[], float], labels: dict[str, str] | None = None) -> None:
        """A value read when scraped (e.g. pages in use), with fixed `labels` if given."""
        gauge = prom.Gauge(name, help_text, list(labels or {}), registry=self.registry)
        (gauge.labels(**labels) if labels else gauge).set_function(read)

    def counter_read(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        """A counter counted elsewhere (e.g. by the prefix cache), read when scraped; exported as `<name>_total`."""
        self.registry.register(_ReadCounter(name, help_text, read))

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _ReadCounter(Collector):
    def __init__(self, name: str, help_text: str, read: Callable[[], float]):
        self.name, self.help_text, self.read = name.removesuffix("_total"), help_text, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.help_text, value=self.read())


class LatencyMetrics:
    """The per-request latency histograms and counters every request-serving service exposes."""

    LABELS = ("transfer_mode", "model_name")

    def __init__(self, registry: Registry):
        self.ttft = registry.histogram("smartgen_time_to_first_token_seconds", "Time from arrival to the first token",
                                       self.LABELS)
        self.ttst = registry.histogram("smartgen_time_to_second_token_seconds", "Time from the first to the second token",
                                       self.LABELS)
        self.itl = registry.histogram("smartgen_inter_token_latency_seconds",
                                      "Gap between consecutive tokens, from the second token on", self.LABELS)
        self.e2e = registry.histogram("smartgen_e2e_request_latency_seconds", "Time from arrival to the last token",
                                      self.LABELS)
        self.kv_bytes = registry.counter("smartgen_kv_transfer_bytes_total", "KV bytes moved over the data plane", ["path"])
        self.requests = registry.counter("smartgen_requests_total", "Requests by final status", ["status"])

    def observe_timeline(self, token_times_s: Sequence[float], transfer_mode: str, model_name: str) -> None:
        """token_times_s[i]: token i's time since the request's arrival."""
        labels = {"transfer_mode": transfer_mode, "model_name": model_name}
        if token_times_s:
            self.ttft.observe(token_times_s[0], **labels)
            self.e2e.observe(token_times_s[-1], **labels)
        if len(token_times_s) > 1:
            self.ttst.observe(token_times_s[1] - token_times_s[0], **labels)
        for a, b in zip(token_times_s[1:], token_times_s[2:]):
            self.itl.observe(b - a, **labels)
