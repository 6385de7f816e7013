#!/bin/bash
# The runs of this folder, in the order they ran (2026-12-07, 18:13–18:32 UTC, main 116053e; nothing else running).
# Run from the repository root: bash docs/results/decode-step-2026-12-07-late/run.sh
set -e
export OMP_WAIT_POLICY=PASSIVE
D=docs/results/decode-step-2026-12-07-late
B=".venv/bin/python -m tools.cli bench"
S=quest,hata,infinigen,positional
for i in 1 2 3; do $B decode-step --context 2048 --budget 0.1 --threads 1,2 --steps 66 --selectors $S --json $D/step-2048-$i.json > $D/step-2048-$i.txt 2>&1; done
$B decode-step --context 4096 --budget 0.1 --threads 1,2 --steps 34 --selectors $S --json $D/step-4096.json > $D/step-4096.txt 2>&1
$B decode-step --context 8192 --budget 0.1 --threads 1,2 --steps 34 --selectors $S --json $D/step-8192.json > $D/step-8192.txt 2>&1
for i in 1 2; do $B decode-batch --context 4096 --batch 8 --selector quest --steps 14 --threads 2 --json $D/batch-4096x8-quest-2t-$i.json > $D/batch-$i.txt 2>&1; done
for i in 2 3; do $B decode-step --context 8192 --budget 0.1 --threads 1,2 --steps 34 --selectors $S --json $D/step-8192-$i.json > $D/step-8192-$i.txt 2>&1; done
$B decode-step --context 2048 --budget 0.1 --threads 1,2 --steps 66 --selectors $S --json $D/step-2048-4.json > $D/step-2048-4.txt 2>&1
$B decode-batch --context 4096 --batch 8 --selector quest --steps 14 --threads 2 --json $D/batch-4096x8-quest-2t-3.json > $D/batch-3.txt 2>&1
