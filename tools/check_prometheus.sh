#!/usr/bin/env bash
# A real Prometheus (Debian's package) scraping `smartgen up`, then every query of SmartGen's Grafana dashboard asked
# of it: each must answer with data. Also lists the vllm:* and smartgen_* names Prometheus stored (the stack runs
# with --vllm-metrics), which must include vLLM's main ones. Writes its report to OUT (default
# docs/results/prometheus-dashboard) and exits 1 if a query had no data or a vLLM name is missing.
#
#   bash tools/check_prometheus.sh                      # the default model (SmolLM2); about 2 minutes
#   MODEL=/path/to/model LOAD_S=60 OUT=/tmp/check bash tools/check_prometheus.sh
#
# Prometheus: `prometheus` on PATH (apt-get install prometheus), else the .deb fetched with `apt-get download` and
# unpacked under ~/.cache/smartgen/prometheus (no root needed). Needs curl and this checkout's Python environment.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
OUT=${OUT:-docs/results/prometheus-dashboard}
LOAD_S=${LOAD_S:-45}
WORK=$(mktemp -d /tmp/smartgen-promcheck-XXXXXX)
mkdir -p "$OUT"

prometheus_binary() {
  if command -v prometheus >/dev/null; then command -v prometheus; return; fi
  local cache="$HOME/.cache/smartgen/prometheus"
  if [ ! -x "$cache/usr/bin/prometheus" ]; then
    mkdir -p "$cache" && (cd "$cache" && apt-get download prometheus >&2 && dpkg-deb -x prometheus_*.deb .)
  fi
  echo "$cache/usr/bin/prometheus"
}

free_port() { "$PY" -c "from tools.nats_server import free_port; print(free_port())"; }

PROMETHEUS=$(prometheus_binary)
API_PORT=$(free_port); PROM_PORT=$(free_port)
API="http://127.0.0.1:$API_PORT"; PROM="http://127.0.0.1:$PROM_PORT"
export SMARTGEN_ADMIN_TOKEN=${SMARTGEN_ADMIN_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
cleanup() {
  [ -n "${PROM_PID:-}" ] && kill "$PROM_PID" 2>/dev/null || true
  [ -n "${UP_PID:-}" ] && kill -INT "$UP_PID" 2>/dev/null && wait "$UP_PID" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

echo "starting smartgen up on $API (log: $WORK/up.log)" >&2
"$PY" -m tools.cli up --port "$API_PORT" --vllm-metrics ${MODEL:+--model "$MODEL"} >"$WORK/up.log" 2>&1 &
UP_PID=$!
for _ in $(seq 1 180); do grep -qs '"stack_ready"' "$WORK/up.log" && break; sleep 1; done
grep -q '"stack_ready"' "$WORK/up.log" || { tail -20 "$WORK/up.log" >&2; echo "smartgen up did not become ready" >&2; exit 1; }

# One job per role, as deploy/prometheus/prometheus.yml has them, at the addresses the gateway's /workers gives
curl -sf -H "Authorization: Bearer $SMARTGEN_ADMIN_TOKEN" "$API/workers" | "$PY" -c '
import json, sys
from urllib.parse import urlsplit
jobs = {}
for w in json.load(sys.stdin)["workers"]:
    jobs.setdefault(w["role"], []).append(urlsplit(w["admin_url"]).netloc)
print("global: {scrape_interval: 1s, evaluation_interval: 1s}\nscrape_configs:")
for role, targets in sorted(jobs.items()):
    print(f"  - job_name: {role}\n    static_configs: [{{targets: {json.dumps(targets)}}}]")
' >"$WORK/prometheus.yml"
"$PROMETHEUS" --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PROM_PORT" >"$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
for _ in $(seq 1 30); do curl -sf "$PROM/-/ready" >/dev/null && break; sleep 1; done

echo "load for $LOAD_S s: completions in every mode, and refused ones" >&2
PROMPT=$(printf 'The river city grew from a settlement where traders met. %.0s' $(seq 1 30))
END=$((SECONDS + LOAD_S))
while [ $SECONDS -lt $END ]; do
  for mode in full smartgen partial quantized colocated; do
    curl -s -o /dev/null "$API/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"prompt\": \"$PROMPT\", \"max_tokens\": 8, \"temperature\": 0, \"transfer_mode\": \"$mode\"}"
  done
  curl -s -o /dev/null "$API/v1/completions" -H 'Content-Type: application/json' -d '{"prompt": "Hi", "max_tokens": -1}'
done
sleep 3  # the last requests' counters scraped

set +e
"$PY" -m tools.dashboard query --prometheus "$PROM" --rate-interval "${LOAD_S}s" --markdown "$OUT/queries.md" >/dev/null
STATUS=$?
set -e
curl -sf "$PROM/api/v1/label/__name__/values" | "$PY" -c '
import json, sys
names = json.load(sys.stdin)["data"]
print("\n".join(n for n in names if n.startswith(("vllm:", "smartgen_"))))' >"$OUT/metric-names.txt"
MISSING=""
for name in vllm:time_to_first_token_seconds_bucket vllm:inter_token_latency_seconds_bucket \
    vllm:time_per_output_token_seconds_bucket vllm:e2e_request_latency_seconds_bucket vllm:num_requests_running \
    vllm:num_requests_waiting vllm:prompt_tokens_total vllm:generation_tokens_total vllm:request_success_total \
    vllm:kv_cache_usage_perc; do
  grep -qx "$name" "$OUT/metric-names.txt" || MISSING="$MISSING $name"
done
[ -z "$MISSING" ] || STATUS=1
UP_TARGETS=$(curl -sf "$PROM/api/v1/targets" | "$PY" -c '
import json, sys
targets = json.load(sys.stdin)["data"]["activeTargets"]
print(", ".join(sorted(t["labels"]["job"] + " " + t["health"] for t in targets)))')
{
  echo "# A real Prometheus scraping \`smartgen up\`, asked every query of deploy/grafana/dashboards/smartgen.json"
  echo
  echo "Made by \`bash tools/check_prometheus.sh\` on $(git rev-parse --short HEAD) ($(date -u +%F)): $("$PROMETHEUS" --version 2>&1 | head -1);"
  echo "\`smartgen up --vllm-metrics\` (model: ${MODEL:-the default SmolLM2}), scraped every 1 s, under $LOAD_S s of completions in"
  echo "every transfer mode plus refused ones; Grafana's \`\$__rate_interval\` taken as ${LOAD_S}s."
  echo
  echo "Targets: $UP_TARGETS."
  echo
  echo "$(grep -c '\*\*no data\*\*' "$OUT/queries.md" || true) queries without data; the table: [queries.md](queries.md);"
  echo "names stored: [metric-names.txt](metric-names.txt) ($(grep -c '^vllm:' "$OUT/metric-names.txt") vllm:*, $(grep -c '^smartgen_' "$OUT/metric-names.txt") smartgen_*);"
  echo "vLLM's names this check requires, missing:${MISSING:- none}."
} >"$OUT/README.md"
cat "$OUT/README.md"
exit $STATUS
