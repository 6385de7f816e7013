#!/usr/bin/env bash
# Issue #33, item 5: the selective decode step on an accelerator, as one prepared script that a lent GPU runs in
# under 8 minutes. Writes seven files under $OUT (the device tool brings back at most eight):
#   device.txt                  what ran it (torch's view of the device; nvidia-smi where there is one)
#   log.txt                     every table the benchmarks printed
#   decode-step-<context>.json  `smartgen bench decode-step`: dense against each selector, 10% budget (two contexts)
#   decode-batch-<context>.json `smartgen bench decode-batch`: 8 requests stepped together, dense against quest
#   serve-runs.json, serve-report.md   one step-matched `smartgen bench serve` (link 10x what the prefill needs)
#
#   OUT=/tmp/gpu bash tools/gpu_check.sh                          # on the GPU (bf16: the model's default there)
#   OUT=/tmp/g GPU_CHECK_DEVICE=cpu GPU_CHECK_MODEL=<tiny> GPU_CHECK_CONTEXTS=128 GPU_CHECK_SELECTORS=quest \
#       GPU_CHECK_SERVE_TOKENS=96 GPU_CHECK_SERVE_SELECTOR=quest GPU_CHECK_SERVE_REQUESTS=1 bash tools/gpu_check.sh
#                                                                     # the same at tiny size (the suite runs this)
#
# Run from the repository root after `make model`. A part that fails stops the script (pipefail: through the tee too).
set -euo pipefail
: "${OUT:?set OUT to the folder the results go to}"
DEVICE=${GPU_CHECK_DEVICE:-cuda}
MODEL=${GPU_CHECK_MODEL:-}
CONTEXTS=${GPU_CHECK_CONTEXTS:-2048 8192}
SELECTORS=${GPU_CHECK_SELECTORS:-quest,hata,infinigen,positional}
SERVE_TOKENS=${GPU_CHECK_SERVE_TOKENS:-2048}
SERVE_SELECTOR=${GPU_CHECK_SERVE_SELECTOR:-hata}
SERVE_REQUESTS=${GPU_CHECK_SERVE_REQUESTS:-3}
PY=${PY:-.venv/bin/python}
SMARTGEN="$PY -m tools.cli"
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
MODEL_ARG=""
[ -n "$MODEL" ] && MODEL_ARG="--model $MODEL"

$PY - "$DEVICE" > "$OUT/device.txt" <<'EOF'
import sys, torch
device = torch.device(sys.argv[1])
name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
print(f"device {device} ({name}), torch {torch.__version__}")
EOF
command -v nvidia-smi > /dev/null && nvidia-smi >> "$OUT/device.txt" || true
cat "$OUT/device.txt"

for context in $CONTEXTS; do
  # shellcheck disable=SC2086  # MODEL_ARG is two words or none
  $SMARTGEN bench decode-step $MODEL_ARG --device "$DEVICE" --context "$context" --budget 0.1 --steps 18 \
    --selectors "$SELECTORS" --json "$OUT/decode-step-$context.json" | tee -a "$OUT/log.txt"
done
last=$(echo $CONTEXTS | awk '{print $NF}')
# shellcheck disable=SC2086
$SMARTGEN bench decode-batch $MODEL_ARG --device "$DEVICE" --context "$last" --batch 1,8 --selector quest \
  --steps 10 --json "$OUT/decode-batch-$last.json" | tee -a "$OUT/log.txt"

# every model process on the device; step-matched: the link is 10x what the prefill needs at R (TBT, not TTST)
# shellcheck disable=SC2086
SMARTGEN_DEVICE="$DEVICE" $SMARTGEN bench serve $MODEL_ARG --prompt-tokens "$SERVE_TOKENS" --pressure 2 \
  --regime step --requests "$SERVE_REQUESTS" --max-tokens 32 --selector "$SERVE_SELECTOR" --modes colocated-selective,quantized-4bit,smartgen \
  --no-quality --out "$WORK/serve" --json "$OUT/serve-runs.json" | tee -a "$OUT/log.txt"
cp "$WORK/serve/report.md" "$OUT/serve-report.md"
echo "gpu_check: done, results in $OUT"
