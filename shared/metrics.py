"""Prometheus text exposition without a dependency: counters, gauges and histograms with labels.

Names shared by every service that records them (the contract with dashboards and tests):
    smartgen_time_to_first_token_seconds      histogram, t1 - t0
    smartgen_time_to_second_token_seconds     histogram, t2 - t1 (the stall SmartGen attacks)
    smartgen_inter_token_latency_seconds      histogram, gaps between tokens from the second on
    smartgen_kv_transfer_bytes_total{path}    counter
    smartgen_requests_total{status}           counter
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _labels_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{v}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self._lock = threading.Lock()  # NOTE: metrics are touched from the torch thread too

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()):
        super().__init__(name, help_text, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(str(labels[n]) for n in self.label_names)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def by_first_label(self) -> dict[str, float]:
        """{first label value: count}, e.g. {"full": 1024.0} for kv_bytes by path (for /stats)."""
        with self._lock:
            return {key[0]: v for key, v in self._values.items()}

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(str(labels[n]) for n in self.label_names), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_labels_text(self.label_names, k)} {v:g}" for k, v in items]


class Gauge(_Metric):
    """A value read when scraped (e.g. pages in use)."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], float]):
        super().__init__(name, help_text)
        self._read = read

    def render(self) -> list[str]:
        return self.header() + [f"{self.name} {self._read():g}"]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS):
        super().__init__(name, help_text)
        self.buckets = tuple(sorted(buckets))
        self._counts = [0] * (len(self.buckets) + 1)  # last slot: above the largest bucket
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def render(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines, cumulative = self.header(), 0
        for bound, c in zip(self.buckets, counts):
            cumulative += c
            lines.append(f'{self.name}_bucket{{le="{bound:g}"}} {cumulative}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {n}', f"{self.name}_sum {total:g}", f"{self.name}_count {n}"]
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric) -> _Metric:
        self._metrics.append(metric)
        return metric

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        return self.add(Counter(name, help_text, labels))  # type: ignore[return-value]

    def histogram(self, name: str, help_text: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Histogram:
        return self.add(Histogram(name, help_text, buckets))  # type: ignore[return-value]

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> Gauge:
        return self.add(Gauge(name, help_text, read))  # type: ignore[return-value]

    def render(self) -> str:
        return "\n".join(line for m in self._metrics for line in m.render()) + "\n"


class LatencyMetrics:
    """The per-request latency histograms and counters every request-serving service exposes."""

    def __init__(self, registry: Registry):
        self.ttft = registry.histogram("smartgen_time_to_first_token_seconds", "Time from arrival to the first token")
        self.ttst = registry.histogram("smartgen_time_to_second_token_seconds", "Time from the first to the second token")
        self.itl = registry.histogram("smartgen_inter_token_latency_seconds", "Gap between consecutive tokens, from the second token on")
        self.kv_bytes = registry.counter("smartgen_kv_transfer_bytes_total", "KV bytes moved over the data plane", ["path"])
        self.requests = registry.counter("smartgen_requests_total", "Requests by final status", ["status"])

    def observe_timeline(self, token_times_s: Sequence[float]) -> None:
        if token_times_s:
            self.ttft.observe(token_times_s[0])
        if len(token_times_s) > 1:
            self.ttst.observe(token_times_s[1] - token_times_s[0])
        for a, b in zip(token_times_s[1:], token_times_s[2:]):
            self.itl.observe(b - a)
