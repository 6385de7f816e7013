"""The Grafana dashboard's queries (deploy/grafana/dashboards/smartgen.json) and the metric names they read: what
its tests check against the code and the running services, and what tools/check_prometheus.sh asks a real
Prometheus.

    python -m tools.dashboard query --prometheus http://127.0.0.1:9090 [--rate-interval 1m] [--markdown PATH]
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "dashboards" / "smartgen.json"
# a metric name is an identifier right before a label matcher or a range: PromQL's functions take "(", labels "="
_SELECTED = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*[{\[]")
SAMPLE_SUFFIXES = ("_bucket", "_sum", "_count")


def queries(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """[(panel title, PromQL expression)] of every panel's targets."""
    dashboard = json.loads(Path(path).read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The sample names an expression selects (a histogram's _bucket, a counter's _total, as exposed)."""
    return set(_SELECTED.findall(expr))


def family_name(sample_name: str) -> str:
    """The name a metric is defined under in code: without a histogram's _bucket/_sum/_count or a counter's _total."""
    for suffix in (*SAMPLE_SUFFIXES, "_total"):
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def exposed_sample_names(text: str) -> set[str]:
    """The sample names of a Prometheus text exposition (what /metrics answers) that have at least one sample."""
    return {re.split(r"[{\s]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def query_prometheus(url: str, expr: str, timeout_s: float = 10.0) -> list[dict]:
    """An instant query's result vector (raises on an error answer)."""
    with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}), timeout=timeout_s) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def query_command(args: argparse.Namespace) -> int:
    """Every dashboard query against a Prometheus: a Markdown table of series and values; exit 1 if any is empty."""
    rows, empty = [], 0
    for title, expr in queries(Path(args.dashboard)):
        result = query_prometheus(args.prometheus, expr.replace("$__rate_interval", args.rate_interval))
        values = [f"{_labels(s['metric'])}={float(s['value'][1]):.4g}" for s in result]
        empty += not result
        rows.append(f"| {title} | `{expr}` | {len(result)} | {'; '.join(values[:6]) or '**no data**'} |")
    report = "\n".join(["| panel | query | series | values (first 6) |", "|---|---|---|---|", *rows])
    print(report)
    if args.markdown:
        Path(args.markdown).write_text(report + "\n")
    print(f"\n{len(rows) - empty} of {len(rows)} queries answered with data", file=sys.stderr)
    return 1 if empty else 0


def _labels(metric: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(metric.items()) if k != "instance") or "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.dashboard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    query = commands.add_parser("query", help="run every dashboard query against a Prometheus")
    query.add_argument("--prometheus", required=True, help="its base URL, e.g. http://127.0.0.1:9090")
    query.add_argument("--dashboard", default=str(DASHBOARD), help="the dashboard JSON (default: SmartGen's)")
    query.add_argument("--rate-interval", default="1m", help="what Grafana's $__rate_interval stands for (default 1m)")
    query.add_argument("--markdown", metavar="PATH", help="also write the table here")
    args = parser.parse_args(argv)
    return query_command(args)


if __name__ == "__main__":
    sys.exit(main())
