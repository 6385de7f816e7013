#!/bin/sh
# The decode-step table of issue #33 (bench decode-step, 10% budget, 1 and 2 threads, configurations interleaved
# step by step, medians of 16 steps after 2 warm-up), the 8K/2K profiles, and the batched goal (8 requests at 4K).
# Run from the repository root: sh docs/results/decode-step-2026-12-05/run.sh
set -e
D=docs/results/decode-step-2026-12-05
export OMP_WAIT_POLICY=PASSIVE
for ctx in 2048 4096 8192; do
  .venv/bin/smartgen bench decode-step --context $ctx --threads 1,2 --steps 18 \
    --selectors quest,hata,infinigen,positional --json $D/step-$ctx.json | tee $D/step-$ctx.txt
done
.venv/bin/smartgen bench decode-batch --context 4096 --batch 8 --selector quest --steps 10 --threads 2 \
  --json $D/batch-4096.json | tee $D/batch-4096.txt
