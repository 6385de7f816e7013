"""`smartgen up`'s own /metrics: what its Supervisor (tools/supervisor.py) knows of every service, for the one
state no service can report itself, a replica that is down (waiting out its backoff, or given up on).

    smartgen_supervisor_service_up{service="decode-1"}          1 running, 0 dead / waiting / given up
    smartgen_supervisor_given_up{service="decode-1"}            1 crash-looping: left down for good
    smartgen_supervisor_backoff_seconds{service="decode-1"}     the pause before its next start (0 while running)
    smartgen_supervisor_restarts_total{service="decode-1"}      times it was started again

Served by a thread (the supervisor's loop is synchronous), on loopback unless told otherwise.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tools.supervisor import Supervisor


class SupervisorCollector(Collector):
    """The supervisor's per-service state, read when scraped."""

    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        supervisor, now = self.supervisor, self.supervisor.clock()
        up = GaugeMetricFamily("smartgen_supervisor_service_up", "1 while the service's process runs", labels=["service"])
        given_up = GaugeMetricFamily("smartgen_supervisor_given_up", "1 for a service left down because it kept dying "
                                     "at start-up (crash-looping)", labels=["service"])
        backoff = GaugeMetricFamily("smartgen_supervisor_backoff_seconds", "Seconds left before the supervisor starts "
                                    "the dead service again (0 while it runs)", labels=["service"])
        restarts = CounterMetricFamily("smartgen_supervisor_restarts", "Times the supervisor started the service "
                                       "again after it died", labels=["service"])
        for name, service in list(supervisor.services.items()):
            up.add_metric([name], float(supervisor.is_running(name)))
            given_up.add_metric([name], float(service.given_up))
            backoff.add_metric([name], max(0.0, service.restart_at - now) if service.restart_at is not None else 0.0)
            restarts.add_metric([name], float(service.restarts))
        yield from (up, given_up, backoff, restarts)


def serve_metrics(supervisor: Supervisor, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """Serve GET /metrics (Prometheus text) from a daemon thread; `server.server_address` says where. Stop it with
    `server.shutdown()`."""
    registry = CollectorRegistry()
    registry.register(SupervisorCollector(supervisor))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics here")
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # NOTE: scrapes are not events worth a log line
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="supervisor-metrics", daemon=True).start()
    return server
